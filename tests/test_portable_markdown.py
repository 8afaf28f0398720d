"""The chapters' Markdown reads the same in JupyterLab, Colab and the HTML book (docs/CHAPTERS.md,
"Portable Markdown"): no MyST role, directive or label, in the source or once rendered as classic
Jupyter renders it (nbconvert's Markdown renderer: CommonMark, math left to MathJax); images that
load; equations and figures numbered C.1, C.2, ... per chapter, and references to numbers that
exist. tools/portable_markdown.py, which converts MyST into that form, is tested on a planted
sample: its output, idempotence and untouched code cells.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbconvert.filters.markdown_mistune import markdown2html_mistune

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))

# A MyST role, a `(label)=` target, a ``` or ::: directive fence, a labelled `$$ ... $$ (label)`,
# a TeX \label (the hook's pattern, plus colon fences and \label).
RAW_MYST = re.compile(
    r"\{[a-z][a-z:\-]*\}`|^\([^)\s]+\)=\s*$|^\s*(`{3,}|:{3,})\s*\{[a-z\-:]+\}|\$\$[ \t]*\([^)\s]+\)|\\label\{",
    re.M,
)
# The same constructs as nbconvert renders them: a role before its <code>, a directive as a code
# block of language "{name}", a target or a colon fence as a paragraph, the label after `$$`.
RAW_MYST_HTML = re.compile(
    r"\{[a-z][a-z:\-]*\}<code>|language-\{|<p>\([^)\s]+\)=</p>|^\([^)\s]+\)=$|:{3,}\s*\{[a-z]|\$\$[ \t]*\([^)\s]+\)",
    re.M,
)
IMAGE = re.compile(r"!\[(?:\\.|[^\]\\])*\]\(")
IMG_SRC = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]*)\"")
CODE = re.compile(r"^\s*(`{3,}|~{3,}).*?^\s*\1|(`+).+?\2", re.M | re.S)


def _param(path: Path):
    return pytest.param(path, id=path.stem)


def _markdown_cells(nb):
    return [(i, cell.source) for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"]


def raw_myst(nb) -> list[str]:
    """'cell 7: {cite}`' for every raw MyST construct in a Markdown cell's source."""
    return [f"cell {i}: {m.group(0).strip()!r}" for i, src in _markdown_cells(nb) for m in RAW_MYST.finditer(src)]


def rendering_problems(nb, folder: Path) -> list[str]:
    """What classic Jupyter's rendering of the Markdown cells shows wrong: raw MyST, an image
    that did not parse (fewer <img> than `![...](...)`), an <img> whose file is missing."""
    problems = []
    for i, src in _markdown_cells(nb):
        rendered = markdown2html_mistune(src)
        text = html.unescape(re.sub(r"<[^>]+>", "", rendered))
        for m in (*RAW_MYST_HTML.finditer(rendered), *RAW_MYST_HTML.finditer(text)):
            problems.append(f"cell {i}: shown raw: {m.group(0)!r}")
        sources = IMG_SRC.findall(rendered)
        if len(sources) < len(IMAGE.findall(CODE.sub("", src))):
            problems.append(f"cell {i}: {len(IMAGE.findall(src))} images written, {len(sources)} rendered")
        for src_url in sources:
            if not re.match(r"(https?:|data:)", src_url) and not (folder / html.unescape(src_url)).is_file():
                problems.append(f"cell {i}: image {src_url} does not exist")
    return problems


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_markdown_has_no_raw_myst(path):
    found = raw_myst(nbformat.read(path, as_version=4))
    assert not found, f"{len(found)} MyST constructs that JupyterLab and Colab show raw:\n" + "\n".join(found[:20])


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_markdown_renders_in_classic_jupyter(path):
    problems = rendering_problems(nbformat.read(path, as_version=4), path.parent)
    assert not problems, "\n".join(problems[:20])


def test_the_checks_catch_a_planted_defect(tmp_path):
    """A chapter copy with a {cite} role, a MyST label and a missing image fails both checks."""
    copy = tmp_path / "03_attention_forward.ipynb"
    shutil.copy(ROOT / "book" / "03_attention_forward.ipynb", copy)
    nb = nbformat.read(copy, as_version=4)
    assert not raw_myst(nb) and not rendering_problems(nb, ROOT / "book")
    cell = next(c for c in nb.cells if c.cell_type == "markdown")
    cell.source += "\n\nAs {cite}`vaswani2017attention` shows.\n\n$$ x $$ (eq-planted)\n\n![A planted image](figures/none.svg)"
    assert len(raw_myst(nb)) == 2
    problems = rendering_problems(nb, ROOT / "book")
    assert any("{cite}" in p for p in problems) and any("$$ (eq-planted)" in p for p in problems)
    assert any("figures/none.svg does not exist" in p for p in problems)


# --------------------------------------------------------------------------------------------
# Numbers per chapter


TAG = re.compile(r"\\tag\{([^}]*)\}")
DISPLAY = re.compile(r"\$\$.+?\$\$", re.S)
EQ_REF = re.compile(r"\beqs?\.\s+\(\d[^)]*\)(?:(?: of \[[^\]]*\]\([^)]*\))?(?:,? and\s+|,\s+|\s+to\s+|\s+or\s+)\(\d[^)]*\))*")
FIGURE_CAPTION = re.compile(r"^\*Figure ([\w.]+): ", re.M)
FIGURE_REF = re.compile(r"\bFigure (\d+\.\d+|\d+)\b(?!:)")


@functools.cache
def _tool():
    """tools/portable_markdown.py as a module."""
    spec = importlib.util.spec_from_file_location("portable_markdown", ROOT / "tools" / "portable_markdown.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tags(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [tag for _, src in _markdown_cells(nb) for tex in DISPLAY.findall(src) for tag in TAG.findall(tex)]


ALL_TAGS = {tag for path in NOTEBOOKS for tag in _tags(path)}


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_equations_and_figures_are_numbered_per_chapter(path):
    """Tags C.1, C.2, ... in order; every eq. (C.k) names one; figure captions carry their place
    among the chapter's figures (Markdown and code-cell outputs); every "Figure C.k" exists."""
    tool = _tool()
    chapter = tool.chapter_of(path)
    nb = nbformat.read(path, as_version=4)
    tags = _tags(path)
    assert tags == [tool.number(chapter, k) for k in range(1, len(tags) + 1)], f"equation tags out of order: {tags}"
    prose = [(i, DISPLAY.sub("", src)) for i, src in _markdown_cells(nb)]
    missing = [f"cell {i}: {n} in {m.group(0)!r}" for i, src in prose for m in EQ_REF.finditer(src)
               for n in re.findall(r"\((\d+(?:\.\d+)?)\)", m.group(0)) if n not in (ALL_TAGS if "." in n else tags)]
    assert not missing, "equation references to no equation:\n" + "\n".join(missing)
    figures = tool.figure_names(nb)
    captions = [n for _, src in prose for n in FIGURE_CAPTION.findall(src)]
    places = [tool.number(chapter, k) for k, name in enumerate(figures, start=1) if name is None]
    assert captions == places, f"figure captions {captions}, but those figures are number {places}"
    numbers = {tool.number(chapter, k) for k in range(1, len(figures) + 1)}
    unknown = [f"cell {i}: Figure {n}" for i, src in prose for n in FIGURE_REF.findall(src)
               if n.startswith(f"{chapter}.") and n not in numbers]
    assert not unknown, "references to figures the chapter does not have:\n" + "\n".join(unknown)


CITATION_LINK = re.compile(r"\[([^\]]+)\]\(references\.md#([^)\s]+)\)")


def test_citation_links_hit_an_entry_under_its_label():
    """[Ba et al., 2016](references.md#ba2016layer): the anchor is a key of references.bib (the id
    the references page gives it) and the text its label there, or "Ba et al. (2016)"."""
    tool = _tool()
    labels = {tool.make_id(key): label for key, label in tool.citation_labels(ROOT / "references.bib").items()}
    wrong = []
    for path in NOTEBOOKS:
        for i, src in _markdown_cells(nbformat.read(path, as_version=4)):
            for text, anchor in CITATION_LINK.findall(src):
                label = labels.get(anchor)
                textual = label and "{} ({})".format(*label.rsplit(", ", 1))
                if text not in (label, textual):
                    wrong.append(f"{path.name} cell {i}: [{text}](references.md#{anchor}), entry labelled {label!r}")
    assert not wrong, "\n".join(wrong)


# --------------------------------------------------------------------------------------------
# The converter


SAMPLE = """\
## Scores
(sec-scores)=
### Scores by hand

The scores {cite}`vaswani2017attention` are

$$
\\begin{aligned}
s &= q^\\top k, \\\\
a &= \\operatorname{softmax}(s)
\\end{aligned}
$$ (eq-ch07-scores)

and $$ y = a v $$ (eq-ch07-out)

Look at {eq}`eq-ch07-scores` and {eq}`eq-ch07-out`, exactly ({eq}`eq-ch07-scores`), and at
{eq}`eq-ch03-row`. As {cite:t}`ba2016layer` found (see {cite}`kingma2015adam`), and
{cite:p}`radford2019language,brown2020language`. {numref}`fig-ch07-grid` and {ref}`sec-scores`.

```{figure} figures/gpt_block.svg
:name: fig-ch07-grid
:alt: A grid of a[i, j]

The grid {eq}`eq-ch07-out` draws.
```

```{note}
Unlabelled $$ z $$ stays as it is.
```

:::{dropdown} Hint
Two lines.
:::
"""

EXPECTED = """\
## Scores
### Scores by hand

The scores ([Vaswani et al., 2017](references.md#vaswani2017attention)) are

$$
% eq-ch07-scores
\\begin{aligned}
s &= q^\\top k, \\\\
a &= \\operatorname{softmax}(s)
\\end{aligned}
\\tag{7.1}
$$

and $$
% eq-ch07-out
y = a v
\\tag{7.2}
$$

Look at eqs. (7.1) and (7.2), exactly (eq. (7.1)), and at
eq. (3.1) of [chapter 3](03_other.ipynb). As [Ba et al. (2016)](references.md#ba2016layer) found (see [Kingma and Ba, 2015](references.md#kingma2015adam)), and
([Radford et al., 2019](references.md#radford2019language); [Brown et al., 2020](references.md#brown2020language)). Figure 7.2 and [Scores by hand](#scores-by-hand).

![A grid of a\\[i, j\\]](figures/gpt_block.svg)

*Figure 7.2: The grid eq. (7.2) draws.*

> **Note.** Unlabelled $$ z $$ stays as it is.

<details>
<summary>Hint</summary>

Two lines.

</details>
"""


def _sample_book(folder: Path) -> tuple[Path, Path]:
    """book/03_other.ipynb (one labelled equation) and book/07_sample.ipynb: a captioned figure
    output, the MyST sample, and a code cell with an output that prints MyST."""
    book = folder / "book"
    book.mkdir()
    other = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("$$\nx = Wy\n$$ (eq-ch03-row)")])
    figure = nbformat.v4.new_code_cell("plot()", metadata={"mystnb": {"figure": {"name": "fig-ch07-first", "caption": "A."}}})
    code = nbformat.v4.new_code_cell("print('{cite}`x`')", execution_count=1,
                                     outputs=[nbformat.v4.new_output("stream", name="stdout", text="{cite}`x`\n")])
    sample = nbformat.v4.new_notebook(cells=[figure, nbformat.v4.new_markdown_cell(SAMPLE), code])
    paths = book / "03_other.ipynb", book / "07_sample.ipynb"
    for path, nb in zip(paths, (other, sample)):
        path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return paths


def test_the_converter_writes_the_portable_form_once(tmp_path):
    tool = _tool()
    paths = _sample_book(tmp_path)
    book = tool.Book.read(paths, ROOT / "references.bib")
    before = nbformat.read(paths[1], as_version=4)
    changes = tool.convert(paths[1], book)
    after = nbformat.read(paths[1], as_version=4)
    assert after.cells[1].source == EXPECTED
    assert changes == {"citations": 4, "equation references": 5, "figure references": 1, "figures": 1,
                       "numbered equations": 2, "section targets": 1, "section links": 1,
                       "admonitions": 1, "dropdowns": 1}
    assert (after.cells[0], after.cells[2]) == (before.cells[0], before.cells[2]), "a code cell changed"
    assert not raw_myst(after) and not rendering_problems(after, ROOT / "book")
    # A second run, with the book read again from the converted files, changes nothing.
    tool.convert(paths[0], tool.Book.read(paths, ROOT / "references.bib"))
    text = paths[1].read_text(encoding="utf-8")
    assert tool.convert(paths[1], tool.Book.read(paths, ROOT / "references.bib")) == {}
    assert paths[1].read_text(encoding="utf-8") == text


def test_the_converter_names_what_it_cannot_convert(tmp_path):
    tool = _tool()
    paths = _sample_book(tmp_path)
    nb = nbformat.read(paths[1], as_version=4)
    nb.cells[1].source = "See {eq}`eq-nowhere`."
    paths[1].write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    with pytest.raises(tool.ConversionError, match=r"07_sample.ipynb cell 1: \{eq\}`eq-nowhere` names no equation"):
        tool.convert(paths[1], tool.Book.read(paths, ROOT / "references.bib"))


def test_the_converter_refuses_what_is_not_a_notebook(tmp_path, capsys):
    assert _tool().main([str(tmp_path / "missing.ipynb")]) == 2
    assert "not a notebook" in capsys.readouterr().err


def test_the_converter_writes_nothing_when_a_notebook_fails(tmp_path, capsys):
    """One clear line, exit code 2, and the notebook before the failing one is not written."""
    tool = _tool()
    paths = _sample_book(tmp_path)
    nb = nbformat.read(paths[1], as_version=4)
    nb.cells[1].source = "A {dropdown-menu} `x`, {unknownrole}`x`."
    paths[1].write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    before = paths[0].read_text(encoding="utf-8")
    assert tool.main([str(p) for p in paths]) == 2
    assert "07_sample.ipynb cell 1: no portable form for the role {unknownrole}" in capsys.readouterr().err
    assert paths[0].read_text(encoding="utf-8") == before
