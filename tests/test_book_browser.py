"""The built book, checked in a real browser with no internet.

The book is built into a temporary folder (`jupyter-book build . --path-output <tmp> -n
--keep-going`), served on 127.0.0.1 from a thread, and every page of `_toc.yml` is opened in
headless Chromium through Playwright (the DevTools protocol), in a 1280 x 1000 window, with every
host name except 127.0.0.1 unresolvable: the pages must work offline. Once MathJax has typeset a
page and its widgets are drawn, every `<details>` on it is opened (exercise solutions, hidden
cells) and the page must show

- typeset math: every Sphinx math element holds a MathJax `mjx-container`, no `mjx-merror`, and
  no raw TeX (`$$`, `\\begin{`, `\\(`, `\\[`, `\\mathbf`, ...) left in the visible text;
- equations that fit: no display equation is wider than its column, no equation number is
  drawn over its equation (code that fits: tests/test_book_layout.py);
- its figures: every `<img>` has a `data:image/...` source or one the server delivered, and alt
  text that describes it (not empty, not a file name); at least as many images as the notebook
  stores image outputs; animations (matplotlib `to_jshtml`) show a frame;
- its widgets: on pages that show widgets, every widget view rendered by the embedded ipywidgets
  manager;
- its chrome: nothing above the chapter title (no code cell), one search box, no Font Awesome
  script, the widget manager only where a widget shows;
- no failed request to the book's own server, no uncaught JavaScript error, no console error;
- a weight within its budget: the bytes of the HTML and of every request the page made
  (PAGE_BUDGETS_MB).

A screenshot of the top of each page lands in `_build/screenshots/<page>.png`.
The tests skip where no Chromium or no Playwright is installed (Debian: `apt-get install
chromium`; `.ci/run` installs it). `GPTLAB_CHROMIUM=/path/to/chrome` picks a browser explicitly.
"""

from __future__ import annotations

import fcntl
import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml

from browser import AUDIT_JS, CHROMIUM, CHROMIUM_ARGS, NOT_PROSE, RAW_TEX, SCREENSHOTS

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium found (install it: `apt-get install chromium` on Debian; or set GPTLAB_CHROMIUM): "
        "the browser check of the built book is skipped",
    ),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="Playwright for Python is not installed"),
]

TIMEOUT_MS = 120_000  # one page: load, typeset, draw its widgets (a loaded 2-core machine is slow)

# Page weight budgets, in MB (10^6 bytes) of HTML plus every response the page requested. Every
# page pays 1.1-1.3 MB for the book's frame: MathJax 3 as components (0.75 MB, see _config.yml)
# and the woff fonts its math uses (0.08-0.17 MB), the theme's stylesheet (0.19 MB, trimmed of
# the rules no page uses by tools/book_weight.py) and its icons (2 kB), bootstrap (0.08 MB) and
# the small scripts and stylesheets of the extensions. Figures are palette PNGs (book_weight.py)
# and SVG diagrams. A page with animations carries their frames inline (matplotlib to_jshtml); a
# page that shows ipywidgets loads the widget manager (1.9 MB) and the stored widget state. With
# this frame, the heaviest chapter of prose and figures weighs 1.86 MB, under the 2 MB goal.
PAGE_BUDGETS_MB = {"prose and figures": 2.0, "animations": 3.0, "widgets": 6.0}


def _toc_docnames() -> list[str]:
    """The root and every `file:` entry of _toc.yml, in reading order."""

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("root", "file"):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [str(Path(entry).with_suffix("")) if Path(entry).suffix in (".md", ".ipynb") else entry for entry in walk(toc)]


PAGES = _toc_docnames()


def _source(docname: str) -> Path | None:
    for suffix in (".ipynb", ".md"):
        path = ROOT / f"{docname}{suffix}"
        if path.is_file():
            return path
    return None


# --------------------------------------------------------------------------------------------
# The build and the server (once per test module)


@dataclass
class Build:
    html: Path
    log: str


@pytest.fixture(scope="session")  # tests/test_book_layout.py measures the same build
def book(tmp_path_factory) -> Build:
    """One build per test run: under xdist the first worker to ask builds into the run's shared
    temporary folder while the others wait on a lock, then all read the same build."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-N/, whose popen-gwK/ folders are the workers'
    out, result = shared / "book", shared / "book-build.json"
    with open(shared / "book-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            exe = Path(sys.executable).with_name("jupyter-book")
            command = [str(exe) if exe.is_file() else "jupyter-book", "build", str(ROOT),
                       "--path-output", str(out), "-n", "--keep-going"]
            proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
            result.write_text(json.dumps({"returncode": proc.returncode, "log": log}))
    built = json.loads(result.read_text())
    log = built["log"]
    assert built["returncode"] == 0, f"jupyter-book build failed ({built['returncode']}):\n{log[-6000:]}"
    return Build(html=out / "_build" / "html", log=log)


@dataclass
class Server:
    url: str
    requests: list = field(default_factory=list)  # (path, status), in arrival order
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture(scope="module")
def server(book):
    record = Server(url="")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-"):
            with record.lock:
                record.requests.append((urllib.parse.urlsplit(self.path).path, int(code) if str(code).isdigit() else 0))

        def log_message(self, format, *args):  # keep the test output quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(book.html)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    record.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield record
    httpd.shutdown()
    httpd.server_close()


def test_book_builds_without_warnings(book):
    """The same build as `make book` minus -W: list every warning instead of stopping at one."""
    problems = [line for line in book.log.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)]
    assert not problems, f"{len(problems)} build warning(s):\n" + "\n".join(problems)


def test_bibliography_labels_read_as_the_citations(book):
    """The references page labels its entries as the chapters cite them, "Ba et al., 2016"
    (tools/book_bibliography.py), not with pybtex's alpha labels "BKH16"."""
    page = parse_html((book.html / "book" / "references.html").read_text())
    labels = [node.text().strip().strip("[]") for node in page.find_all("span", cls="label")]
    assert len(labels) > 50, f"the references page shows {len(labels)} labelled entries"
    not_author_year = [label for label in labels if not re.search(r", (\d{4}[a-z]?|n\.d\.)$", label)]
    assert not not_author_year, f"labels that are not author-year: {not_author_year[:5]}"
    assert {"Ba et al., 2016", "Vaswani et al., 2017", "Kingma and Ba, 2015"} <= set(labels)


# --------------------------------------------------------------------------------------------
# A small DOM for the serialized page


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"}


class Node:
    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag: str, attrs: dict, parent: Node | None):
        self.tag, self.attrs, self.children, self.parent = tag, attrs, [], parent

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    def iter(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None) -> list[Node]:
        return [n for n in self.iter() if (tag is None or n.tag == tag) and (cls is None or cls in n.classes)]

    def text(self, skip=lambda node: False) -> str:
        parts = []
        for child in self.children:
            if isinstance(child, str):
                parts.append(child)
            elif not skip(child):
                parts.append(child.text(skip))
        return "".join(parts)


class _TreeBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, dict(attrs), self.current))

    def handle_endtag(self, tag):
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse_html(markup: str) -> Node:
    builder = _TreeBuilder()
    builder.feed(markup)
    builder.close()
    return builder.root


def _not_prose(node: Node) -> bool:
    return node.tag in NOT_PROSE or node.tag.startswith("mjx-")


# --------------------------------------------------------------------------------------------
# What a page's source promises


def _notebook_image_outputs(path: Path) -> int:
    if path.suffix != ".ipynb":
        return 0
    nb = nbformat.read(path, as_version=4)
    count = 0
    for cell in nb.cells:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell.cell_type != "code" or tags & {"remove-output", "remove-cell"}:
            continue
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if any(mime in data for mime in ("image/png", "image/jpeg", "image/svg+xml")):
                count += 1
    return count


# --------------------------------------------------------------------------------------------
# The browser


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Rendered:
    dom: Node  # the DOM once typeset and drawn, before anything was opened
    audit: dict  # what AUDIT_JS measured with every <details> open
    console: list[str]  # console errors and uncaught exceptions


def render(chromium, url: str, screenshot: Path, widget_views: int) -> Rendered:
    """Open `url` at 1280 px, offline; wait for MathJax and the widgets; measure the page."""
    page = chromium.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: console.append(f"Uncaught {error}"))
    try:
        page.goto(url, wait_until="load")
        page.evaluate("async () => { if (window.MathJax && MathJax.startup) await MathJax.startup.promise; }")
        if widget_views:
            drawn = "n => document.querySelectorAll('.widget-subarea .jupyter-widgets').length >= n"
            page.wait_for_function(drawn, arg=widget_views)
        page.wait_for_load_state("networkidle")  # fonts and images the typesetting asked for
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot))
        dom = parse_html(page.content())
        audit = page.evaluate(AUDIT_JS, sorted(NOT_PROSE))
    finally:
        page.close()
    return Rendered(dom=dom, audit=audit, console=console)


def _budget(dom: Node, shows_widgets: bool) -> tuple[str, float]:
    if shows_widgets:
        return "widgets", PAGE_BUDGETS_MB["widgets"]
    if dom.find_all("div", "animation"):
        return "animations", PAGE_BUDGETS_MB["animations"]
    return "prose and figures", PAGE_BUDGETS_MB["prose and figures"]


# --------------------------------------------------------------------------------------------
# One test per page of the table of contents


@pytest.mark.parametrize("docname", PAGES)
def test_page_renders_offline(docname, book, server, chromium):
    source = _source(docname)
    if source is None:
        pytest.skip(f"{docname}: listed in _toc.yml, not written yet")
    page = book.html / f"{docname}.html"
    assert page.is_file(), f"{docname}: the build wrote no {page.name}"
    static = parse_html(page.read_text(encoding="utf-8"))
    static_views = [n for n in static.iter() if n.tag == "script" and n.attrs.get("type") == "application/vnd.jupyter.widget-view+json"]

    url = f"{server.url}/{docname}.html"
    with server.lock:
        first_request = len(server.requests)
    screenshot = SCREENSHOTS / f"{Path(docname).name}.png"
    rendered = render(chromium, url, screenshot, len(static_views))
    with server.lock:
        requests = server.requests[first_request:]
    dom, audit = rendered.dom, rendered.audit
    article = next(iter(dom.find_all("article", "bd-article")), dom)
    problems: list[str] = []

    # Math: what Sphinx marked as math is typeset, and nothing raw is left in the prose.
    n_math = sum(1 for n in static.iter() if {"math", "notranslate"} <= n.classes)
    math_nodes = [n for n in dom.iter() if {"math", "notranslate"} <= n.classes]
    if n_math:
        untypeset = [n.text().strip()[:80] for n in math_nodes if not n.find_all("mjx-container")]
        if untypeset:
            problems.append(f"{len(untypeset)} of {len(math_nodes)} math elements not typeset, e.g. {untypeset[:3]}")
        if not dom.find_all("mjx-container"):
            problems.append("page has math but no MathJax output (mjx-container)")
    errors = dom.find_all("mjx-merror")
    if errors:
        problems.append(f"MathJax reported {len(errors)} TeX error(s): {[e.attrs.get('data-mjx-error') or e.text()[:80] for e in errors[:3]]}")
    prose = audit["prose"]  # visible text with every <details> open, code and typeset math left out
    for raw in RAW_TEX.finditer(prose):
        problems.append(f"raw TeX {raw.group(0)!r} in the visible text: ...{prose[max(0, raw.start() - 60): raw.end() + 60]!r}...")

    # Equations fit the column at 1280 px (code: tests/test_book_layout.py).
    if audit["wideMath"]:
        problems.append(f"display equation(s) wider than the column at 1280 px: {audit['wideMath']}")
    if audit["numberOverMath"]:
        problems.append(f"equation number(s) drawn over the equation: {audit['numberOverMath']}")

    # Figures: images are there, load, and say what they show; animations show a frame.
    served = {path: status for path, status in requests}
    images = article.find_all("img")
    for img in images:
        src = img.attrs.get("src") or ""
        if src.startswith("data:"):
            if not src.startswith("data:image/"):
                problems.append(f"<img> with a non-image data URL: {src[:40]}")
            continue
        if not src:
            problems.append("<img> without src")
            continue
        target = urllib.parse.urlsplit(urllib.parse.urljoin(url, src))
        if target.hostname != "127.0.0.1":
            problems.append(f"<img> from outside the book: {src}")
        elif served.get(target.path) != 200:
            problems.append(f"<img> {src} not delivered (status {served.get(target.path)})")
    if audit["noAlt"]:
        problems.append(f"{len(audit['noAlt'])} image(s) without alt text that describes them: {audit['noAlt'][:4]}")
    expected_images = _notebook_image_outputs(source)
    if len(images) < expected_images:
        problems.append(f"{len(images)} <img> rendered, the notebook stores {expected_images} image outputs")
    for anim in article.find_all("div", "animation"):
        frames = [img.attrs.get("src", "") for img in anim.find_all("img")]
        if not any(src.startswith("data:image/") for src in frames):
            problems.append("a matplotlib animation shows no frame (its JavaScript did not run)")

    # Widgets: on pages that show widgets, every view is rendered by the widget manager.
    has_state = any(n.tag == "script" and n.attrs.get("type") == "application/vnd.jupyter.widget-state+json" for n in dom.iter())
    views = [n for n in article.iter() if n.tag == "script" and n.attrs.get("type") == "application/vnd.jupyter.widget-view+json"]
    if has_state and views:
        rendered_views = [a for a in article.find_all("div", "widget-subarea") if any("jupyter-widgets" in n.classes for n in a.iter())]
        if len(rendered_views) < len(views):
            problems.append(f"{len(rendered_views)} of {len(views)} widget views rendered")
    elif views and not has_state:
        problems.append(f"{len(views)} widget view(s) but no widget state stored in the notebook (save it with the widget state)")

    # The page's chrome: nothing above the title, one search box, only the scripts it uses.
    if audit["aboveTitle"]:
        problems.append(f"above the chapter title: {audit['aboveTitle']} (tag the set-up cell remove-cell)")
    if audit["searchBoxes"] > 1:
        problems.append(f"{audit['searchBoxes']} search boxes shown")
    scripts = audit["scripts"]
    if any(path.endswith("/fontawesome.js") for path in scripts):
        problems.append("loads the theme's Font Awesome script (tools/book_offline.py leaves it out)")
    if not views and any("jupyter-widgets/" in path for path in scripts):
        problems.append("loads the widget manager but shows no widget")

    # The book's own server answered every request; no uncaught error, no console error.
    failed = sorted({f"{path} ({status})" for path, status in requests if status >= 400})
    if failed:
        problems.append(f"failed requests: {failed}")
    if rendered.console:
        problems.append(f"console errors: {rendered.console[:5]}")

    # Weight: the HTML and everything the page requested.
    kind, budget = _budget(dom, bool(views))
    if audit["bytes"] > budget * 1e6:
        problems.append(f"weighs {audit['bytes'] / 1e6:.2f} MB in {audit['requests']} requests: over the {budget} MB budget of a page of {kind}")

    assert not problems, f"{docname} (screenshot: {screenshot}):\n- " + "\n- ".join(problems)


@pytest.mark.parametrize("page", ["search.html?q=softmax", "genindex.html"])
def test_template_pages_without_errors(page, book, server, chromium):
    """The pages Sphinx writes from its templates load without an error and, for the search
    page, find the chapters that teach the word searched for."""
    name = page.split(".")[0]
    rendered = render(chromium, f"{server.url}/{page}", SCREENSHOTS / f"{name}.png", 0)
    assert not rendered.console, f"{page}: console errors: {rendered.console[:5]}"
    if name == "search":
        found = [a.text() for results in rendered.dom.find_all("ul", "search") for a in results.find_all("a")]
        assert any("Softmax and cross-entropy" in title for title in found), f"the search for 'softmax' did not list chapter 6: {found[:10]}"
