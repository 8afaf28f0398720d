"""Build one reveal.js slide deck per chapter, from the chapter itself.

    .venv/bin/python tools/slides.py                                  # every chapter
    .venv/bin/python tools/slides.py book/03_attention_forward.ipynb --out /tmp/slides

A deck has a title slide (the chapter's title and the key sentences of its opening), then for
every ``##`` section a slide with the key sentences of its first paragraph and its labelled
display equations (numbered in the chapter's order, as the book numbers them), a slide for each
captioned figure (the PNG the chapter stores, with its caption), and the Summary's bullets. The
Exercises make no slide. The deck is first written as a small notebook (``<chapter>.ipynb``,
cells with ``slideshow.slide_type`` metadata), then converted by nbconvert's SlidesExporter into
``<chapter>.slides.html`` (default folder ``_build/slides/``). It opens offline: the page loads
reveal.js and MathJax from the copies of ``_vendor/reveal.js/`` and ``_vendor/mathjax/`` put
next to it (tools/vendor_js.sh), by relative URLs; figures are embedded as data URIs.
"""

import argparse
import functools
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import yaml
from jinja2 import DictLoader
from nbconvert import SlidesExporter
from pybtex.database import parse_file
from pybtex.richtext import Text

from gptlab.course import editions as course

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "_vendor"
OUT = ROOT / "_build" / "slides"
NO_SLIDE = {"Exercises"}  # sections left out of a deck: a deck is for the lecture

SECTION = re.compile(r"^## +(.+)$", re.M)
TITLE = re.compile(r"\A# +(.+)$", re.M)
EQUATION = re.compile(r"\$\$(.+?)\$\$[ \t]*\((eq-[\w-]+)\)", re.S)
TAGGED = re.compile(r"\$\$((?:(?!\$\$).)*?\\tag\{(?:(?!\$\$).)*?)\$\$", re.S)  # portable: numbered in the source
LOCAL_LINK = re.compile(r"\[([^\]]*)\]\((?![a-z]+:)[^)]*\)")  # [Ba et al., 2016](references.md#ba2016layer)
ROLE = re.compile(r"\{([\w:]+)\}`([^`]*)`")
SENTENCE_END = re.compile(r"(?<=[.!?:])\s+(?=[A-Z$*_`(])")
NOT_PROSE = ("$$", "#", "- ", "* ", "1. ", "<", "|", "```", ":::")
KEY_CHARS = 300  # the key sentences: the first one, and the next while they stay this short

# The deck's page: nbconvert's reveal template without jQuery, require.js and mermaid (all from
# CDNs), with MathJax 3 and reveal.js loaded from the copies next to the page.
TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{% block html_head_js %}{% endblock html_head_js %}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block html_head_js_mathjax %}
<script>
window.MathJax = MATHJAX_CONFIG;
</script>
<script src="mathjax/startup.js"></script>
<style>
.reveal .slides { text-align: left; }
.reveal h1, .reveal h2 { text-transform: none !important; }
.reveal .jp-RenderedImage img { max-height: 520px; width: auto; }
</style>
{% endblock html_head_js_mathjax %}
{% block footer_js %}
<script src="{{ resources.reveal.url_prefix }}/dist/reveal.js"></script>
<script>
Reveal.initialize({controls: true, progress: true, history: true, slideNumber: "c/t",
                   transition: "{{ resources.reveal.transition }}",
                   width: {{ resources.reveal.width }}, height: {{ resources.reveal.height }}});
// A slide taller than the deck (many equations, a long summary) is zoomed out until it fits.
function fit(slide) {
  slide.style.zoom = "";
  const height = Reveal.getConfig().height;
  if (slide.scrollHeight > height) slide.style.zoom = 0.97 * height / slide.scrollHeight;
  Reveal.layout();
}
Reveal.on("ready", (event) => MathJax.startup.promise.then(() => fit(event.currentSlide)));
Reveal.on("slidechanged", (event) => fit(event.currentSlide));
</script>
{% endblock footer_js %}
"""


@dataclass
class Section:
    """One ``##`` section of a chapter (the title slide's part has the chapter's title)."""
    title: str
    text: str = ""                                   # its markdown, subsections included
    figures: list = field(default_factory=list)      # (caption, image outputs) per figure


def chapters() -> list[Path]:
    """The numbered chapters and the capstone project (gptlab.course.editions's list)."""
    return course.chapters(ROOT / "book")


def sections(nb, name: str) -> list[Section]:
    """The chapter as its opening (titled with the chapter's title) and its ``##`` sections."""
    found: list[Section] = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            if not found:
                title = TITLE.search(cell.source)
                if title is None:
                    continue  # cells before the title
                found.append(Section(title.group(1).strip()))
                text = cell.source[title.end():]
            else:
                text = cell.source
            parts = SECTION.split(text)  # [before, title1, text1, title2, text2, ...]
            found[-1].text += parts[0] + "\n\n"
            found += [Section(title.strip(), body + "\n\n")
                      for title, body in zip(parts[1::2], parts[2::2])]
        elif found and (caption := cell.metadata.get("mystnb", {}).get("figure", {}).get("caption")):
            images = [out for out in cell.outputs if "image/png" in out.get("data", {})]
            if images:
                found[-1].figures.append((caption, images))
    if not found:
        raise ValueError(f"{name}: no markdown cell starts with a '# Title' line")
    return found


def key_sentences(text: str) -> str:
    """The first prose paragraph's first sentence, and the next ones while short."""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        if paragraph and not paragraph.startswith(NOT_PROSE):
            sentences = SENTENCE_END.split(paragraph)
            kept = sentences[0]
            for sentence in sentences[1:]:
                if len(kept) + len(sentence) > KEY_CHARS:
                    break
                kept += " " + sentence
            return kept
    return ""


@functools.cache
def citations() -> dict[str, tuple[str, str]]:
    """Each key of references.bib as the book's author-year style names it: ("Ba et al.", "2016").

    One author by surname, two joined by "and", more as "First et al."; an entry without
    authors by its title; "n.d." without a year."""
    labels = {}
    for key, entry in parse_file(ROOT / "references.bib").entries.items():
        surnames = [Text.from_latex(" ".join(person.last_names)).render_as("text") for person in entry.persons.get("author", [])]
        if len(surnames) > 2:
            who = f"{surnames[0]} et al."
        elif surnames:
            who = " and ".join(surnames)
        else:
            who = Text.from_latex(entry.fields["title"]).render_as("text")
        labels[key] = (who, entry.fields.get("year", "n.d."))
    return labels


def plain(text: str, numbers: dict[str, int]) -> str:
    """MyST roles as text a slide shows: {eq} as its number, {cite} as [Author et al., year]
    ({cite:t} as Author et al. [year]), others as is; a link within the book as its text."""
    def replace(match):
        role, content = match.groups()
        if role == "eq":
            return f"({numbers[content]})" if content in numbers else content
        if role.startswith("cite"):
            cited = [citations()[key.strip()] for key in content.split(",")]
            if role == "cite:t":
                return ", ".join(f"{who} [{year}]" for who, year in cited)
            return "[" + ", ".join(f"{who}, {year}" for who, year in cited) + "]"
        if role == "numref":
            return "the figure"
        return re.sub(r"\s*<[^>]*>$", "", content)  # {ref}`text <label>` -> text
    return LOCAL_LINK.sub(r"\1", ROLE.sub(replace, text))


def _markdown(source: str, slide_type: str):
    return nbformat.v4.new_markdown_cell(source, metadata={"slideshow": {"slide_type": slide_type}})


def deck(nb, name: str) -> nbformat.NotebookNode:
    """The slides notebook of a chapter: one cell per slide part, with slide types."""
    parts = sections(nb, name)
    labels = [label for part in parts for _, label in EQUATION.findall(part.text)]
    numbers = {label: k for k, label in enumerate(labels, start=1)}
    cells = [_markdown(f"# {parts[0].title}\n\n{plain(key_sentences(parts[0].text), numbers)}",
                       "slide")]
    for part in parts[1:]:
        if part.title in NO_SLIDE:
            continue
        if part.title == "Summary":
            body = part.text.strip()
        else:
            body = key_sentences(part.text)
            body += "".join(f"\n\n$$\n{tex.strip()}\n\\tag{{{numbers[label]}}}\n$$"
                            for tex, label in EQUATION.findall(part.text))
            body += "".join(f"\n\n$$\n{tex.strip()}\n$$" for tex in TAGGED.findall(part.text))
        cells.append(_markdown(f"## {part.title}\n\n{plain(body, numbers)}", "slide"))
        for caption, images in part.figures:
            figure = nbformat.v4.new_code_cell("", metadata={"slideshow": {"slide_type": "slide"}})
            figure.outputs = images
            cells += [figure, _markdown(plain(caption, numbers), "-")]
    return nbformat.v4.new_notebook(cells=cells, metadata={"title": parts[0].title})


def exporter() -> SlidesExporter:
    """nbconvert's reveal.js exporter, pointed at the vendored reveal.js, without code inputs."""
    template = TEMPLATE.replace("MATHJAX_CONFIG", json.dumps(mathjax_config()))
    slides = SlidesExporter(extra_loaders=[DictLoader({"gptlab_slides.html.j2": template})],
                            template_file="gptlab_slides.html.j2")
    slides.reveal_url_prefix = "reveal.js"
    slides.reveal_theme = "white"  # the one theme vendored
    slides.reveal_width, slides.reveal_height = "1280", "720"
    slides.exclude_input = True
    slides.exclude_input_prompt = slides.exclude_output_prompt = True
    return slides


def mathjax_config() -> dict:
    """The book's MathJax configuration (``_config.yml``: the components startup.js loads, the TeX
    packages), with inline math between single dollars as in the notebooks."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]["mathjax3_config"]
    tex = {**config["tex"], "inlineMath": [["$", "$"], ["\\(", "\\)"]], "processEscapes": True}
    return {**config, "tex": tex}


def build(chapter: Path, out: Path = OUT) -> Path:
    """Write ``out/<chapter>.ipynb`` and ``out/<chapter>.slides.html``; returns the HTML path."""
    out.mkdir(parents=True, exist_ok=True)
    for library in ("reveal.js", "mathjax"):
        shutil.copytree(VENDOR / library, out / library, dirs_exist_ok=True)
    slides_nb = deck(nbformat.read(chapter, as_version=4), str(chapter))
    nbformat.write(slides_nb, out / chapter.name)
    html, _ = exporter().from_notebook_node(slides_nb, resources={"metadata": {"name": chapter.stem}})
    path = out / f"{chapter.stem}.slides.html"
    path.write_text(html, encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("chapters", nargs="*", type=Path, help="default: every chapter")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT.relative_to(ROOT)}")
    args = parser.parse_args()
    for chapter in args.chapters or chapters():
        print(build(chapter, args.out))


if __name__ == "__main__":
    main()
