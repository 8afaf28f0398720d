"""The chapters as a reader sees them in JupyterLab: a real JupyterLab, driven by headless Chromium.

A JupyterLab server from the test environment starts on 127.0.0.1 (free port, random token, every
Jupyter directory in a temporary folder, no news, update check, extension manager or kernel) and
serves a temporary copy of `book/` and of the fixture notebook. One JupyterLab page opens each
notebook in turn, untrusted as in a fresh clone, with every cell attached to the page
(`windowingMode: none`). The constructs are found from the notebook's own cells, and the page
must show

- listings: a code cell calling `show_source(` stores a Markdown output with a ```python block;
  that output is rendered and visible, and its `pre` shows the stored code, `def ` included;
- math: every Markdown cell with `$...$`/`$$...$$` holds at least as many MathJax `mjx-container`s
  as it has formulas, no `mjx-merror`, no undefined macro (MathJax writes its name in red), and no
  raw `$$`, `\\(`, `\\[` or TeX command (`\\begin`, `\\frac`, ...) in its prose;
- code solutions (cell metadata `jupyter.source_hidden`, tag `hide-cell`): input and outputs are
  collapsed to a placeholder, no source line past the first and no output line on screen (the
  placeholder previews the first line); a click on the placeholder shows the whole source;
- prose solutions (Markdown cells starting `<details>` `<summary>`): the `details` is closed, its
  summary visible and the rest not; a click on the summary shows it, math typeset;
- Markdown (tests/test_portable_markdown.py): no MyST role, directive or label shown raw, and
  every image loaded;
- no uncaught JavaScript error, no kernel started.

Screenshots land in `_build/screenshots/jupyterlab/<notebook>-<what>.png`. The tests skip where
Chromium (see test_book_browser.py), JupyterLab or Playwright for Python is missing; Playwright
drives the system Chromium and never downloads a browser.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

from browser import CHROMIUM, NOT_PROSE, RAW_MATH, SCREENSHOTS
from test_portable_markdown import RAW_MYST_HTML

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = "tests/fixtures/jupyterlab_constructs.ipynb"
SHOTS = SCREENSHOTS / "jupyterlab"
MISSING = [name for name in ("jupyterlab", "playwright") if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (Debian: `apt-get install chromium`; or set GPTLAB_CHROMIUM)"),
    pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (pip install jupyterlab playwright)"),
]

SERVER_START_S = 60  # the server answers /api/status within this
TIMEOUT_MS = 30_000  # one browser action or wait
NOTEBOOK_LOAD_MS = 60_000  # JupyterLab loads and attaches every cell


# --------------------------------------------------------------------------------------------
# What a notebook's cells promise


@dataclass
class Constructs:
    listings: dict[int, str | None] = field(default_factory=dict)  # cell -> code its stored Markdown output shows
    code_solutions: list[int] = field(default_factory=list)  # cells with `jupyter.source_hidden`
    prose_solutions: list[int] = field(default_factory=list)  # Markdown cells opening with <details><summary>
    math: dict[int, int] = field(default_factory=dict)  # Markdown cell -> number of $-delimited formulas

    def __bool__(self) -> bool:
        return bool(self.listings or self.code_solutions or self.prose_solutions or self.math)


LISTING = re.compile(r"^(`{3,})python\n(?P<code>.*?)\n\1\s*$", re.M | re.S)
PROSE_SOLUTION = re.compile(r"\s*<details\b[^>]*>\s*<summary>")
FENCED_CODE = re.compile(r"^\s*(`{3,}|~{3,}).*?^\s*\1", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
DISPLAY_MATH = re.compile(r"\$\$.+?\$\$", re.S)
INLINE_MATH = re.compile(r"\$(?:\\.|[^$\\])+?\$")
# What MathJax left untypeset: the book's raw delimiters, or any TeX command.
RAW_TEX = re.compile("|".join(map(re.escape, RAW_MATH)) + r"|\\[A-Za-z]+")


def count_formulas(markdown: str) -> int:
    """The `$$...$$` and `$...$` formulas of a Markdown text, code and escaped `\\$` left out."""
    text = INLINE_CODE.sub("", FENCED_CODE.sub("", markdown)).replace(r"\$", "")
    n_display = len(DISPLAY_MATH.findall(text))
    return n_display + len(INLINE_MATH.findall(DISPLAY_MATH.sub("", text)))


def listing_code(cell) -> str | None:
    """The code of the stored `show_source` listing: a Markdown output's ```python block."""
    for output in cell.get("outputs", []):
        match = LISTING.search(output.get("data", {}).get("text/markdown", ""))
        if output.get("output_type") in ("display_data", "execute_result") and match:
            return match["code"]
    return None


def find_constructs(path: Path) -> Constructs:
    found = Constructs()
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code" and "show_source(" in cell.source:
            found.listings[index] = listing_code(cell)
        if cell.cell_type == "code" and cell.metadata.get("jupyter", {}).get("source_hidden"):
            found.code_solutions.append(index)
        if cell.cell_type == "markdown" and PROSE_SOLUTION.match(cell.source):
            found.prose_solutions.append(index)
        if cell.cell_type == "markdown" and (n_formulas := count_formulas(cell.source)):
            found.math[index] = n_formulas
    return found


NOTEBOOKS = [FIXTURE] + [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("book/*.ipynb")) if find_constructs(p)]


# --------------------------------------------------------------------------------------------
# The server and the browser (once per test module)


@dataclass
class Lab:
    url: str
    token: str

    def api(self, path: str):
        request = urllib.request.Request(f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)


def _write_settings(folder: Path) -> None:
    """User settings: every cell attached to the page; no news, update check or extension manager."""
    settings = {
        "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/extensionmanager-extension:plugin": {"enabled": False},
    }
    for plugin, values in settings.items():
        package, name = plugin.split(":")
        path = folder / package / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_lab(tmp: Path, starts_kernel: bool = False):
    """JupyterLab on 127.0.0.1 serving ``tmp/notebooks``, with its Jupyter folders in ``tmp``;
    killed with its process group. ``starts_kernel``: opening a notebook starts its kernel, as
    `make lab` does for a reader."""
    notebooks = tmp / "notebooks"
    _write_settings(tmp / "settings")
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
    )
    token = secrets.token_hex(24)
    port = _free_port()
    command = [
        sys.executable, "-m", "jupyter", "lab",
        "--ip=127.0.0.1", f"--port={port}", "--port-retries=0", "--no-browser", "--allow-root",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={notebooks}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.notebook_starts_kernel={starts_kernel}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: the test opens notebooks with its commands
    ]
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(url=f"http://127.0.0.1:{port}", token=token)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, f"jupyter lab exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"jupyter lab did not answer in {SERVER_START_S} s:\n{log_path.read_text()[-4000:]}"
            try:
                server.api("status")
                break
            except OSError:
                time.sleep(0.25)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a copy of `book/` and of the fixture notebook; no kernel starts."""
    tmp = tmp_path_factory.mktemp("jupyterlab")
    notebooks = tmp / "notebooks"
    shutil.copytree(ROOT / "book", notebooks / "book", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (notebooks / FIXTURE).parent.mkdir(parents=True)
    shutil.copy(ROOT / FIXTURE, notebooks / FIXTURE)
    with running_lab(tmp) as server:
        yield server


@dataclass
class LabPage:
    page: object  # playwright.sync_api.Page
    errors: list[str]  # uncaught JavaScript errors, message and stack, in order


@contextlib.contextmanager
def opened_lab_page(lab: Lab):
    """One JupyterLab page in headless Chromium, offline, at a 1280 px window, restored."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            timeout=TIMEOUT_MS,
            # Offline: no host name resolves except the server's address.
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"],
        )
        try:
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            loaded = LabPage(page=page, errors=[])
            page.on("pageerror", lambda error: loaded.errors.append(f"{error}\n{error.stack}"))
            page.goto(f"{lab.url}/lab?reset&token={lab.token}", timeout=NOTEBOOK_LOAD_MS)
            page.wait_for_function("() => window.jupyterapp", timeout=NOTEBOOK_LOAD_MS)
            page.evaluate("() => { jupyterapp.restored.then(() => { window.gptlabRestored = true; }); }")
            page.wait_for_function("() => window.gptlabRestored", timeout=NOTEBOOK_LOAD_MS)
            yield loaded
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def lab_page(lab):
    """One JupyterLab page for all notebooks."""
    with opened_lab_page(lab) as loaded:
        yield loaded


# --------------------------------------------------------------------------------------------
# In the page

# Known and harmless: jupyterlab_widgets 3.0 reads `session.kernel.id` of every opened notebook,
# and with no kernel started (as here) the session is null. The widget manager is then not set up
# for that notebook; with a kernel, as a reader runs it, it is.
KNOWN_PAGE_ERRORS = [re.compile(r"^Cannot read properties of null \(reading 'kernel'\).*@jupyter-widgets/jupyterlab-manager/", re.S)]


# Closes every open document (unsaved changes dropped), then opens `path` as a notebook.
OPEN_JS = """path => {
    for (const widget of [...jupyterapp.shell.widgets('main')]) if (widget.context) widget.dispose();
    jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'});
}"""

# Waits until every cell is attached, every listing's output rendered and MathJax has typeset.
READY_JS = """([nCells, listings, nFormulas]) => {
    const cells = document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell');
    if (cells.length !== nCells) return false;
    if (!listings.every(i => cells[i].querySelector('.jp-OutputArea-output pre'))) return false;
    return document.querySelectorAll('.jp-NotebookPanel .jp-RenderedMarkdown mjx-container').length >= nFormulas;
}"""

# The prose a reader sees in a rendered element: text outside code, scripts and MathJax output.
PROSE_JS = """(element, notProse) => {
    const skip = node => notProse.includes(node.localName) || node.localName.startsWith('mjx-');
    const walk = node => [...node.childNodes].map(child =>
        child.nodeType === Node.TEXT_NODE ? child.textContent : (child.nodeType === Node.ELEMENT_NODE && !skip(child) ? walk(child) : '')
    ).join('');
    return walk(element);
}"""


def _visible_lines(locator) -> set[str]:
    return {line.strip() for line in locator.inner_text().splitlines() if line.strip()}


def _source_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _shoot(page, cell, name: str, what: str) -> None:
    cell.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / f"{name}-{what}.png"))


def check_listings(page, cells, found: Constructs, name: str) -> list[str]:
    problems = []
    for n, (index, code) in enumerate(found.listings.items()):
        if code is None:
            problems.append(f"cell {index} calls show_source( but stores no Markdown output with a ```python block (re-run it)")
            continue
        output = cells.nth(index).locator('.jp-OutputArea-output[data-mime-type="text/markdown"]')
        if not output.count() or not output.first.is_visible():
            problems.append(f"cell {index}: the listing's Markdown output is not rendered or not visible")
            continue
        pre = output.first.locator("pre")
        shown = pre.first.inner_text() if pre.count() else ""
        if not pre.count() or not pre.first.is_visible() or not shown.strip():
            problems.append(f"cell {index}: the listing shows no visible code (shown: {shown[:80]!r})")
        elif _source_lines(shown) != _source_lines(code):
            problems.append(f"cell {index}: the listing shows other code than stored: {shown[:200]!r}")
        if n == 0:
            _shoot(page, output.first, name, "listing")
    return problems


def check_math(page, cells, found: Constructs) -> list[str]:
    problems = []
    for index, n_formulas in found.math.items():
        rendered = cells.nth(index).locator(".jp-RenderedMarkdown")
        if not rendered.count():
            problems.append(f"cell {index}: Markdown cell not rendered")
            continue
        n_typeset = rendered.locator("mjx-container").count()
        if n_typeset < n_formulas:
            problems.append(f"cell {index}: {n_typeset} of {n_formulas} formulas typeset")
        errors = rendered.locator("mjx-merror")
        if errors.count():
            problems.append(f"cell {index}: MathJax TeX error {errors.first.get_attribute('data-mjx-error') or errors.first.text_content()!r}")
        # MathJax shows an undefined macro as its name in red, not as an mjx-merror.
        red = rendered.locator('mjx-assistive-mml mtext[mathcolor="red"]').all_text_contents()
        undefined = [text for text in red if text.startswith("\\")]
        if undefined:
            problems.append(f"cell {index}: undefined TeX macros {undefined}")
        prose = rendered.evaluate(PROSE_JS, sorted(NOT_PROSE))
        raw = RAW_TEX.search(prose)
        if raw:
            problems.append(f"cell {index}: raw {raw[0]!r} in the visible text: ...{prose[max(0, raw.start() - 60): raw.end() + 60]!r}...")
    return problems


def check_markdown(cells, nb, name: str) -> list[str]:
    """No MyST shown raw in a rendered Markdown cell; every image in one loaded."""
    problems = []
    for index, cell in enumerate(nb.cells):
        rendered = cells.nth(index).locator(".jp-RenderedMarkdown")
        if cell.cell_type != "markdown" or not rendered.count():
            continue
        raw = RAW_MYST_HTML.search(rendered.first.inner_html())
        if raw:
            problems.append(f"cell {index}: MyST shown raw: {raw[0]!r}")
        images = rendered.first.locator("img")
        for i in range(images.count()):
            if not images.nth(i).evaluate("img => img.decode().then(() => img.naturalWidth > 0, () => false)"):
                problems.append(f"cell {index}: image {images.nth(i).get_attribute('src')} does not load")
    return problems


def check_code_solutions(page, cells, nb, found: Constructs, name: str) -> list[str]:
    problems = []
    for n, index in enumerate(found.code_solutions):
        cell, stored = cells.nth(index), nb.cells[index]
        meta = stored.metadata
        # hide-cell: a code solution, input and outputs folded; hide-input: a graded answer or
        # grading cell, input folded and its report shown.
        tags = meta.get("tags", [])
        folds_outputs = "hide-cell" in tags
        if not (folds_outputs or "hide-input" in tags) or (folds_outputs and stored.outputs and not meta["jupyter"].get("outputs_hidden")):
            problems.append(f"cell {index}: a folded cell needs tag hide-input, or hide-cell and, with outputs, jupyter.outputs_hidden")
        placeholder = cell.locator(".jp-InputPlaceholder")
        if not placeholder.count() or not placeholder.first.is_visible():
            problems.append(f"cell {index}: the solution's input is not collapsed to a placeholder")
        if cell.locator(".jp-InputArea").count() and cell.locator(".jp-InputArea").first.is_visible():
            problems.append(f"cell {index}: the solution's editor is on screen")
        if folds_outputs and cell.locator(".jp-OutputArea").count() and cell.locator(".jp-OutputArea").first.is_visible():
            problems.append(f"cell {index}: the solution's outputs are on screen")
        visible = _visible_lines(cell.locator(".jp-Cell-inputWrapper"))
        first, *rest = _source_lines(stored.source) or [""]
        outputs = "\n".join(o.get("text") or o.get("data", {}).get("text/plain", "") for o in stored.outputs if folds_outputs)
        leaked = [line for line in rest + _source_lines(outputs) if line in visible and line != first]
        if leaked:
            problems.append(f"cell {index}: solution lines visible while collapsed: {leaked[:3]}")
        if n == 0 and placeholder.count():
            _shoot(page, cell, name, "code-solution-collapsed")
            placeholder.first.locator(".jp-Placeholder-content").click()
            editor = cell.locator(".jp-InputArea-editor .cm-content")
            editor.wait_for(state="visible")
            # CodeMirror draws only the lines near the screen: a long answer's first 20 lines
            missing = [line for line in _source_lines(stored.source)[:20] if line not in _visible_lines(editor)]
            if missing:
                problems.append(f"cell {index}: after a click on the placeholder, source lines not shown: {missing[:3]}")
            _shoot(page, cell, name, "code-solution-open")
    return problems


def check_prose_solutions(page, cells, found: Constructs, name: str) -> list[str]:
    problems = []
    for n, index in enumerate(found.prose_solutions):
        details = cells.nth(index).locator(".jp-RenderedMarkdown details")
        if not details.count():
            problems.append(f"cell {index}: no <details> element rendered (stripped by the sanitizer?)")
            continue
        details = details.first
        summary = details.locator("summary")
        inner = details.locator(":scope > :not(summary)")
        if details.evaluate("d => d.open"):
            problems.append(f"cell {index}: the solution's <details> is open")
        if not summary.count() or not summary.first.is_visible():
            problems.append(f"cell {index}: the solution's <summary> is not visible")
            continue
        if not inner.count():
            problems.append(f"cell {index}: the solution's <details> holds nothing besides its summary")
            continue
        shown = [inner.nth(i).inner_text()[:60] for i in range(inner.count()) if inner.nth(i).is_visible()]
        if shown:
            problems.append(f"cell {index}: solution text visible while closed: {shown[:2]}")
        if n == 0:
            _shoot(page, cells.nth(index), name, "prose-solution-collapsed")
            summary.first.click()
            if not details.evaluate("d => d.open") or not inner.first.is_visible():
                problems.append(f"cell {index}: a click on the summary does not open the solution")
            math = details.locator("mjx-container")
            if index in found.math and not (math.count() and math.first.is_visible()):
                problems.append(f"cell {index}: the opened solution shows no typeset math")
            _shoot(page, cells.nth(index), name, "prose-solution-open")
    return problems


# --------------------------------------------------------------------------------------------
# One test per notebook


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: Path(path).stem)
def test_notebook_in_jupyterlab(notebook, lab, lab_page):
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    nb = nbformat.read(ROOT / notebook, as_version=4)
    found = find_constructs(ROOT / notebook)
    name = Path(notebook).stem
    SHOTS.mkdir(parents=True, exist_ok=True)
    page, first_error = lab_page.page, len(lab_page.errors)
    problems: list[str] = []

    page.evaluate(OPEN_JS, notebook)
    try:
        page.wait_for_function(READY_JS, arg=[len(nb.cells), list(found.listings), sum(found.math.values())], timeout=NOTEBOOK_LOAD_MS)
    except PlaywrightTimeoutError:
        problems.append(f"not every cell attached, listing rendered and formula typeset after {NOTEBOOK_LOAD_MS / 1000:.0f} s")
    cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    page.screenshot(path=str(SHOTS / f"{name}-top.png"))
    trust = page.locator(".jp-StatusItem-trust").get_attribute("title") or ""
    if "not trusted" not in trust:
        problems.append(f"the notebook should open untrusted, as in a fresh clone; the status bar says {trust!r}")
    problems += (
        check_listings(page, cells, found, name)
        + check_math(page, cells, found)
        + check_markdown(cells, nb, name)
        + check_code_solutions(page, cells, nb, found, name)
        + check_prose_solutions(page, cells, found, name)
    )

    uncaught = [error for error in lab_page.errors[first_error:] if not any(known.search(error) for known in KNOWN_PAGE_ERRORS)]
    if uncaught:
        problems.append(f"uncaught JavaScript errors: {uncaught[:5]}")
    kernels = lab.api("kernels")
    if kernels:
        problems.append(f"opening the notebook started {len(kernels)} kernel(s)")
    assert not problems, f"{notebook} (screenshots: {SHOTS}/{name}-*.png):\n- " + "\n- ".join(problems)
