"""Checks of the project layout: pins, CI entry point, README, table of contents, notebooks."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").rglob("*.ipynb"))
NOTEBOOKS = [nb for nb in NOTEBOOKS if ".ipynb_checkpoints" not in nb.parts]


def test_requirements_pin_torch():
    lines = [line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    assert "torch==2.13.0" in lines


def test_ci_runs_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands


def test_readme_has_quick_start_commands():
    readme = (ROOT / "README.md").read_text()
    assert "## Quick start" in readme
    assert "make book" in readme
    assert "make test" in readme


def _toc_entries(node):
    """Yield every `root:` and `file:` value in a jb-book table of contents."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("root", "file"):
                yield value
            else:
                yield from _toc_entries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _toc_entries(item)


def test_toc_lists_only_existing_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    assert toc["format"] == "jb-book"
    entries = list(_toc_entries(toc))
    assert entries, "the table of contents lists no pages"
    for entry in entries:
        base = ROOT / entry
        candidates = [base] if base.suffix in (".md", ".ipynb") else [base.with_suffix(".md"), base.with_suffix(".ipynb")]
        assert any(path.is_file() for path in candidates), f"_toc.yml entry {entry!r} has no .md or .ipynb file"
        assert base.resolve().is_relative_to(ROOT), f"_toc.yml entry {entry!r} points outside the repository"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(nb.relative_to(ROOT)) for nb in NOTEBOOKS])
def test_notebook_code_cells_are_executed(path):
    nb = nbformat.read(path, as_version=4)
    unexecuted = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and cell.source.strip() and cell.execution_count is None
    ]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} have no stored outputs (execution_count is None)"


# --- The book's configuration -----------------------------------------------------------------

def _config():
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def _static_dirs():
    return [ROOT / entry for entry in _config().get("sphinx", {}).get("config", {}).get("html_static_path", [])]


def test_no_root_static_folder():
    """jupyter-book injects every .js file of a root _static/ into every page: serve files from _vendor/."""
    assert not (ROOT / "_static").exists(), "remove the root _static/ folder; put static files under _vendor/"
    static = [path.resolve() for path in _static_dirs()]
    assert (ROOT / "_static").resolve() not in static, "_config.yml lists _static in html_static_path"
    for path in static:
        assert path.is_dir(), f"html_static_path entry {path} is not a folder"
        assert path.is_relative_to(ROOT)


def test_offline_scripts_are_vendored():
    """MathJax and the widget manager come from html_static_path, not from a CDN (see tools/vendor_js.sh)."""
    from sphinx.util.matching import Matcher

    cfg = _config()
    sphinx_cfg = cfg["sphinx"]["config"]
    # Sphinx filters static files with exclude_patterns as well, relative to each static folder.
    excluded = Matcher([*cfg.get("exclude_patterns", []), "**/.*"])
    scripts = [sphinx_cfg["mathjax_path"], *sphinx_cfg["nb_ipywidgets_js"]]
    for script in scripts:
        assert "://" not in script and not script.startswith("//"), f"{script} is not a local file"
        found = [d / script for d in _static_dirs() if (d / script).is_file()]
        assert found, f"{script} is in no html_static_path folder: run tools/vendor_js.sh"
        assert not excluded(script), f"{script} matches exclude_patterns: Sphinx would not copy it"
    fonts = [d / Path(sphinx_cfg["mathjax_path"]).parent / "output/chtml/fonts/woff-v2" for d in _static_dirs()]
    assert any(list(f.glob("*.woff")) for f in fonts if f.is_dir()), "the MathJax fonts are not vendored"


BIB_KEY = re.compile(r"^@(?!comment\b|string\b|preamble\b)\w+\s*\{\s*([^,\s]+)\s*,", re.MULTILINE | re.IGNORECASE)
CITE_ROLE = re.compile(r"\{cite(?::\w+)?\}`([^`]*)`|:cite(?::\w+)?:`([^`]*)`")


def _book_markdown():
    """(where, text) for every Markdown page and notebook Markdown cell under book/."""
    for path in sorted((ROOT / "book").rglob("*.md")):
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown":
                yield f"{path.relative_to(ROOT)} cell {i}", cell.source


def test_cited_keys_exist_in_references_bib():
    keys = set(BIB_KEY.findall((ROOT / "references.bib").read_text(encoding="utf-8")))
    assert keys, "references.bib has no entries"
    missing = []
    for where, text in _book_markdown():
        for match in CITE_ROLE.finditer(text):
            for key in (match.group(1) or match.group(2) or "").split(","):
                if key.strip() and key.strip() not in keys:
                    missing.append(f"{where}: {key.strip()}")
    assert not missing, "cited keys missing from references.bib:\n" + "\n".join(missing)


def test_toc_follows_the_chapter_plan():
    """_toc.yml lists the chapters of docs/CHAPTERS.md, in order, then the references page."""
    planned = re.findall(r"`(book/\d\d_\w+)\.ipynb`", (ROOT / "docs" / "CHAPTERS.md").read_text())
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    entries = [entry for entry in _toc_entries(toc) if entry != toc["root"]]
    chapters = [entry for entry in entries if re.match(r"book/\d\d_", entry)]
    assert chapters == planned, "the chapters in _toc.yml differ from the table in docs/CHAPTERS.md"
    assert entries[len(chapters):] == ["book/course_guide", "book/capstone", "book/references"]
    assert "```{bibliography}" in (ROOT / "book" / "references.md").read_text()


def _notebook_title(entry: str) -> str:
    """'3 Attention, forward' from the first heading '# 3. Attention, forward' of a notebook."""
    nb = nbformat.read(ROOT / f"{entry}.ipynb", as_version=4)
    heading = next(line for cell in nb.cells if cell.cell_type == "markdown"
                   for line in cell.source.splitlines() if line.startswith("# "))
    return re.sub(r"^(\d+)\. ", r"\1 ", heading[2:].strip())


def test_preface_chapter_table_follows_the_toc():
    """The preface's table of parts and chapters is _toc.yml's, in order, with each chapter's own
    title: it cannot fall behind when a chapter or a part is added."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    expected = []  # (part caption on the part's first row only, chapter title)
    for part in toc["parts"]:
        caption = re.sub(r"^Part ([IVX]+): ", r"\1. ", part["caption"])
        titles = [_notebook_title(c["file"]) for c in part["chapters"]
                  if c["file"] not in ("book/00_preface", "book/references")]
        expected += [(caption if i == 0 else "", title) for i, title in enumerate(titles)]
    preface = nbformat.read(ROOT / "book" / "00_preface.ipynb", as_version=4)
    table = next(cell.source for cell in preface.cells if "| part | chapter |" in cell.source)
    rows = [[col.strip() for col in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    shown = [(part.strip("*"), chapter) for part, chapter, _ in rows]
    assert shown == expected, "the preface's chapter table differs from _toc.yml"


# --- Chapters read the same in JupyterLab, Colab and the HTML book ---------------------------

def _code_cells(path):
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def _tool(name: str):
    """The module tools/<name>.py."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_cells_match_the_repository_in_config():
    tool = _tool("setup_cells")
    stale = [path.name for path in tool.chapters() if tool.stale(path, tool.repository_url())]
    assert not stale, f"stale set-up cells (run tools/setup_cells.py): {stale}"


INSTALL = re.compile(r"pip[\"',\s]+install|%pip|!pip|git\+|easy_install|conda install")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_notebooks_install_only_from_the_books_repository(path):
    """Only the set-up cell installs, and only from repository.url of _config.yml: an address the
    project does not control would run a stranger's code on every Colab reader's machine."""
    setup, *rest = _code_cells(path)
    for index, cell in enumerate(rest, start=1):
        assert not INSTALL.search(cell.source), f"{path.name}: code cell {index} installs something"
    url = _config()["repository"]["url"]
    assigned = re.findall(r"^GPTLAB_REPOSITORY = (\"[^\"]*\")", setup.source, re.M)
    assert assigned == [f'"{url}"'], "the set-up cell must take its address from _config.yml"
    targets = re.findall(r"git\+(\S+?)[\"']", setup.source)
    assert targets and all(t == "{GPTLAB_REPOSITORY}" for t in targets if "<" not in t)
    assert not re.search(r"https?://", setup.source.replace(url, "") if url else setup.source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_package_code_is_shown_by_code_cells_not_sphinx_directives(path):
    """{literalinclude} shows in the HTML book only; JupyterLab and Colab print it raw."""
    nb = nbformat.read(path, as_version=4)
    directives = [i for i, cell in enumerate(nb.cells) if "{literalinclude}" in cell.source]
    assert not directives, f"{path.name}: cells {directives} use {{literalinclude}}; use show_source"
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("show_source("):
            (markdown,) = [out.data["text/markdown"] for out in cell.outputs if "data" in out]
            assert "```python\n" in markdown


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_solutions_are_collapsed_everywhere(path):
    """Prose solutions in <details> (closed in all three readers), code solutions hidden in the
    HTML book (hide-cell), JupyterLab (source_hidden) and Colab (a form with a title)."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            assert not re.search(r"\{admonition\} Solution|\{dropdown\}", cell.source), \
                f"{path.name} cell {i}: a MyST dropdown shows open in JupyterLab; use <details>"
            if "<details>" in cell.source:
                assert cell.source.startswith("<details>\n<summary>") and \
                    cell.source.rstrip().endswith("</details>"), f"{path.name} cell {i}"
        elif "hide-cell" in cell.metadata.get("tags", []):
            assert cell.metadata.get("jupyter") == {"source_hidden": True, "outputs_hidden": True}
            assert cell.metadata.get("cellView") == "form" and cell.source.startswith("# @title ")


def test_every_chapter_has_graded_work_in_nbgraders_format():
    """tools/grading_cells.py --check: nbgrader metadata derived from the exercise conventions,
    a grading cell with hidden tests and points in every chapter, an answer cell for each."""
    tool = _tool("grading_cells")
    found = {}
    for path in tool.chapters():
        nb = nbformat.read(path, as_version=4)
        found[path.name] = tool.problems(nb) + (["stale metadata"] if tool.stale(nb) else [])
    assert not any(found.values()), {name: p for name, p in found.items() if p}


def test_extras_are_pinned_in_requirements():
    """Every dependency and extra of pyproject.toml is pinned (==) in requirements.txt."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += [req for req in extra if not req.startswith("gptlab[")]
    names = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-") for req in wanted}
    assert sorted(names - pins.keys()) == []


# --- tools/book_weight.py: lighter pages, the same look ---------------------------------------

def test_figures_become_palette_pngs_only_where_they_look_the_same():
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    tool = _tool("book_weight")
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(np.sin(np.linspace(0, 6, 200)), label="sin")
    ax.imshow(np.linspace(0, 1, 64 * 64).reshape(64, 64), cmap="RdBu", extent=(150, 190, -1, 1), aspect="auto")
    ax.legend()
    plot = io.BytesIO()
    fig.savefig(plot, format="png", dpi=100)
    plt.close(fig)
    lighter = tool.palette_png(plot.getvalue())
    assert lighter is not None and len(lighter) < len(plot.getvalue())
    before = np.asarray(Image.open(plot).convert("RGB"), dtype=int)
    palette = Image.open(io.BytesIO(lighter))
    after = np.asarray(palette.convert("RGB"), dtype=int)
    assert palette.mode == "P" and np.abs(before - after).mean() < tool.MAX_MEAN_ERROR

    noise = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)  # 4,000 colours
    photo = io.BytesIO()
    Image.fromarray(noise).save(photo, format="PNG")
    assert tool.palette_png(photo.getvalue()) is None, "a palette cannot hold this image faithfully"
    seethrough = io.BytesIO()
    Image.new("RGBA", (8, 8), (255, 0, 0, 128)).save(seethrough, format="PNG")
    assert tool.palette_png(seethrough.getvalue()) is None, "transparency is kept as it is"


def test_theme_stylesheet_keeps_every_rule_a_page_can_use():
    tool = _tool("book_weight")
    css = (
        ':root{--x:1}.used{a:1}.unused{b:2}.unused:hover,.unused2{c:3}.used:hover,.unused{d:4}'
        ".unused .used{e:5}a.unused{f:6}.unused:not(.used){g:7}"
        "@media (min-width:1px){.unused{h:8}}@media (min-width:2px){.used{i:9}}"
        '.fa-bars:before,.fa-navicon:before{content:"\\f0c9"}.fa-sun:before{content:"\\f185"}'
    )
    kept = tool.drop_unused_rules(css, {"used", "fa-bars"})
    for rule in (":root{--x:1}", ".used{a:1}", ".used:hover,.unused{d:4}", ".unused .used{e:5}", "a.unused{f:6}",
                 "@media (min-width:2px){.used{i:9}}", ".fa-bars:before,.fa-navicon:before"):
        assert rule in kept, f"dropped a rule a page can use: {rule}"
    for rule in (".unused{b:2}", ".unused2{c:3}", ".unused:not(.used){g:7}", "min-width:1px", ".fa-sun"):
        assert rule not in kept, f"kept a rule no page can use: {rule}"
    assert [tool._css_character(c) for c in tool.ICON_RULE.findall(kept)] == [0xF0C9]


def test_cjk_font_covers_every_cjk_character_of_the_book():
    """_vendor/fonts/noto-sans-cjk-book.woff holds every Chinese or Japanese character the book
    shows: a page that gains one the subset lacks fails here (run tools/cjk_font.py again)."""
    from fontTools.ttLib import TTFont

    font = TTFont(ROOT / "_vendor" / "fonts" / "noto-sans-cjk-book.woff")
    covered = {chr(code) for code in font.getBestCmap()}
    missing = _tool("cjk_font").book_characters() - covered
    assert not missing, f"characters missing from the CJK subset: {''.join(sorted(missing))}"
