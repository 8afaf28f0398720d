"""tools/slides.py: the reveal.js deck of a chapter, built from the chapter, opens offline."""

import html
import importlib.util
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "book" / "00_preface.ipynb"  # small: sections, labelled equations, a figure


def _slides_tool():
    spec = importlib.util.spec_from_file_location("slides", ROOT / "tools" / "slides.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Page(HTMLParser):
    """The slides (innermost <section>s), the URLs the page loads, and its PNG images."""

    def __init__(self):
        super().__init__()
        self.depth, self.slides, self.loaded, self.images = 0, 0, [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.depth += 1
            self.slides += self.depth == 2  # nbconvert nests every slide in a horizontal stack
        elif tag == "script" and attrs.get("src"):
            self.loaded.append(attrs["src"])
        elif tag == "link" and attrs.get("href"):
            self.loaded.append(attrs["href"])
        elif tag == "img" and (attrs.get("src") or "").startswith("data:image/png;base64,"):
            self.images += 1

    def handle_endtag(self, tag):
        self.depth -= tag == "section"


@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    path = _slides_tool().build(CHAPTER, out)
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return out, path, page


def _chapter_markdown():
    nb = nbformat.read(CHAPTER, as_version=4)
    return nb, "\n\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")


def test_the_deck_and_its_notebook_are_written(deck):
    out, path, _ = deck
    assert path == out / "00_preface.slides.html" and path.stat().st_size > 0
    slides_nb = nbformat.read(out / "00_preface.ipynb", as_version=4)
    assert all("slide_type" in cell.metadata["slideshow"] for cell in slides_nb.cells)


def test_one_slide_per_section_and_figure(deck):
    nb, markdown = _chapter_markdown()
    sections = [title for title in re.findall(r"^## +(.+)$", markdown, re.M) if title != "Exercises"]
    figures = [cell for cell in nb.cells if cell.metadata.get("mystnb", {}).get("figure")]
    assert sections and figures, "the test chapter must have sections and a captioned figure"
    assert deck[2].slides == 1 + len(sections) + len(figures)  # the title slide first
    assert deck[2].images == len(figures)


def test_the_labelled_equations_are_on_the_slides(deck):
    _, markdown = _chapter_markdown()
    equations = re.findall(r"\$\$(.+?)\$\$[ \t]*\(eq-", markdown, re.S)  # MyST, numbered by the deck
    equations += re.findall(r"\$\$((?:(?!\$\$).)*?\\tag\{.*?)\$\$", markdown, re.S)  # portable
    assert equations, "the test chapter must have labelled display equations"
    page = html.unescape(deck[1].read_text(encoding="utf-8"))
    for tex in equations:
        assert tex.strip() in page
    assert page.count(r"\tag{") == len(equations)


def test_the_deck_loads_only_local_files(deck):
    out, _, page = deck
    assert any(url.endswith("reveal.js") for url in page.loaded)
    assert any("mathjax" in url for url in page.loaded)
    for url in page.loaded:
        assert not re.match(r"(https?:)?//", url), f"{url} is loaded from the network"
        assert (out / url).is_file(), f"{url} is not next to the deck"


def test_a_notebook_without_a_title_is_refused():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("## No title")])
    with pytest.raises(ValueError, match="untitled.ipynb: no markdown cell"):
        _slides_tool().deck(nb, "untitled.ipynb")


def test_citations_read_as_the_book_prints_them():
    """{cite} and {cite:t} in the book's author-year style, never as raw bibliography keys."""
    slides = _slides_tool()
    text = "LayerNorm {cite}`ba2016layer, kingma2015adam`; as {cite:t}`xiong2020layer` found; {cite}`gpt3card`"
    assert slides.plain(text, {}) == (
        "LayerNorm [Ba et al., 2016, Kingma and Ba, 2015]; as Xiong et al. [2020] found; [GPT-3 (summary card), n.d.]")
    with pytest.raises(KeyError, match="nosuchkey2024"):
        slides.plain("{cite}`nosuchkey2024`", {})


def test_no_deck_shows_a_raw_role():
    """Across every chapter's slide text: no MyST role and no bibliography key is left raw."""
    slides = _slides_tool()
    keys = set(slides.citations())
    for chapter in slides.chapters():
        nb = nbformat.read(chapter, as_version=4)
        shown = "\n".join(cell.source for cell in slides.deck(nb, chapter.stem).cells if cell.cell_type == "markdown")
        assert not re.search(r"\{[\w:]+\}`", shown), f"{chapter.name}: a raw MyST role on a slide"
        assert not keys & set(re.findall(r"\w+", shown)), f"{chapter.name}: a bibliography key on a slide"
