"""The built book, checked in a real browser with no internet.

The book is built into a temporary folder (`jupyter-book build . --path-output <tmp> -n
--keep-going`), served on 127.0.0.1 from a thread, and every page of `_toc.yml` is opened in
headless Chromium with every host name except 127.0.0.1 unresolvable: the pages must work
offline. From the rendered DOM (`--dump-dom`, after `--virtual-time-budget` lets MathJax and the
widget manager finish), each page must show

- typeset math: every Sphinx math element holds a MathJax `mjx-container`, no `mjx-merror`, and
  no raw `$$`, `\\begin{`, `\\(` or `\\[` left in the visible text;
- its figures: every `<img>` has a `data:image/...` source or one the server delivered, at least
  as many images as the notebook stores image outputs, and animations (matplotlib `to_jshtml`)
  show a frame;
- its widgets: on pages that store widget state, every widget view rendered by the embedded
  ipywidgets manager;
- no failed request to the book's own server and no uncaught JavaScript error.

A screenshot of the top of each page lands in `_build/screenshots/<page>.png`.
The tests skip where no Chromium is installed (Debian: `apt-get install chromium`; `.ci/run`
installs it). `GPTLAB_CHROMIUM=/path/to/chrome` picks a browser explicitly.
"""

from __future__ import annotations

import functools
import http.server
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

from browser import CHROMIUM, NOT_PROSE, RAW_MATH, SCREENSHOTS

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium found (install it: `apt-get install chromium` on Debian; or set GPTLAB_CHROMIUM): "
    "the browser check of the built book is skipped",
)


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


@pytest.fixture(scope="module")
def book(tmp_path_factory) -> Build:
    out = tmp_path_factory.mktemp("book")
    exe = Path(sys.executable).with_name("jupyter-book")
    command = [str(exe) if exe.is_file() else "jupyter-book", "build", str(ROOT), "--path-output", str(out), "-n", "--keep-going"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"jupyter-book build failed ({proc.returncode}):\n{log[-6000:]}"
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


# Chromium's console lines with --enable-logging=stderr: ...:INFO:CONSOLE(12)] "message", source: url (12)
CONSOLE_LINE = re.compile(r':CONSOLE[:(]\d+\)?\] "(?P<message>.*)", source: (?P<source>\S*)')
# Known and harmless: jupyter-book 1.0.4 with Sphinx 7.4 emits sphinx-thebe's inline configuration
# script twice on every page; the second copy re-declares its `const` (the first one works).
KNOWN_CONSOLE_ERRORS = [re.compile(r"Identifier 'THEBE_JS_URL' has already been declared")]


def render(url: str, screenshot: Path, profile: Path) -> tuple[str, list[tuple[str, str]]]:
    """Open `url` in headless Chromium, offline; return the rendered DOM and the console lines."""
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        # Offline: no host name resolves except the local server's address.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=10000",
        "--window-size=1280,1600",
        "--enable-logging=stderr",
        "--v=0",
        f"--screenshot={screenshot}",
        "--dump-dom",
        url,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "</html>" in proc.stdout, f"Chromium failed on {url} ({proc.returncode}):\n{proc.stderr[-3000:]}"
    console = [(m["message"], m["source"]) for m in map(CONSOLE_LINE.search, proc.stderr.splitlines()) if m]
    return proc.stdout, console


# --------------------------------------------------------------------------------------------
# One test per page of the table of contents


@pytest.mark.parametrize("docname", PAGES)
def test_page_renders_offline(docname, book, server, tmp_path):
    source = _source(docname)
    if source is None:
        pytest.skip(f"{docname}: listed in _toc.yml, not written yet")
    page = book.html / f"{docname}.html"
    assert page.is_file(), f"{docname}: the build wrote no {page.name}"
    static = parse_html(page.read_text(encoding="utf-8"))

    url = f"{server.url}/{docname}.html"
    with server.lock:
        first_request = len(server.requests)
    screenshot = SCREENSHOTS / f"{Path(docname).name}.png"
    markup, console = render(url, screenshot, tmp_path / "profile")
    with server.lock:
        requests = server.requests[first_request:]
    dom = parse_html(markup)
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
    prose = article.text(skip=_not_prose)
    for raw in RAW_MATH:
        at = prose.find(raw)
        if at >= 0:
            problems.append(f"raw {raw!r} in the visible text: ...{prose[max(0, at - 60): at + 60]!r}...")

    # Figures: images are there and load; animations show a frame.
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
    expected_images = _notebook_image_outputs(source)
    if len(images) < expected_images:
        problems.append(f"{len(images)} <img> rendered, the notebook stores {expected_images} image outputs")
    for anim in article.find_all("div", "animation"):
        frames = [img.attrs.get("src", "") for img in anim.find_all("img")]
        if not any(src.startswith("data:image/") for src in frames):
            problems.append("a matplotlib animation shows no frame (its JavaScript did not run)")

    # Widgets: on pages with stored widget state, every view is rendered by the widget manager.
    has_state = any(n.tag == "script" and n.attrs.get("type") == "application/vnd.jupyter.widget-state+json" for n in static.iter())
    views = [n for n in article.iter() if n.tag == "script" and n.attrs.get("type") == "application/vnd.jupyter.widget-view+json"]
    if has_state and views:
        rendered = [a for a in article.find_all("div", "widget-subarea") if any("jupyter-widgets" in n.classes for n in a.iter())]
        if len(rendered) < len(views):
            problems.append(f"{len(rendered)} of {len(views)} widget views rendered")
    elif views and not has_state:
        problems.append(f"{len(views)} widget view(s) but no widget state stored in the notebook (save it with the widget state)")

    # The book's own server answered every request; no uncaught JavaScript error.
    failed = sorted({f"{path} ({status})" for path, status in requests if status >= 400 and not path.endswith("favicon.ico")})
    if failed:
        problems.append(f"failed requests: {failed}")
    uncaught = [
        f"{message} [{source_url}]"
        for message, source_url in console
        if message.startswith("Uncaught") and not any(known.search(message) for known in KNOWN_CONSOLE_ERRORS)
    ]
    if uncaught:
        problems.append(f"uncaught JavaScript errors: {uncaught[:5]}")

    assert not problems, f"{docname} (screenshot: {screenshot}):\n- " + "\n- ".join(problems)
