"""A chapter opened in a real JupyterLab, as `make lab` opens it, is not marked modified, and its
graded answers are folded.

JupyterLab (tests/test_jupyterlab.py's server, on 127.0.0.1, but here opening a notebook starts
its kernel, as it does for a reader) serves two copies of chapter 2 (graded answers, a folded
code solution, widget state): one in the form tools/notebook_form.py stores, and one as the
chapters were first stored (kernel display name "Python 3"). Each is opened in headless Chromium
at a 1280 px window; once its kernel has answered (language and kernel spec, which JupyterLab
writes into the notebook's metadata) the stored form must show no unsaved change (model and the
tab's dirty mark), and its first graded answer and grading cell must be folded to a placeholder.
The copy in the old form must show as modified: the check sees a change when there is one.
Kernels are shut down through JupyterLab before the server stops.
"""

from __future__ import annotations

import importlib.util

import pytest

from test_jupyterlab import MISSING, NOTEBOOK_LOAD_MS, OPEN_JS, ROOT, SHOTS, opened_lab_page, running_lab

from browser import CHROMIUM

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (Debian: `apt-get install chromium`; or set GPTLAB_CHROMIUM)"),
    pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)} (pip install jupyterlab playwright)"),
]

CHAPTER = ROOT / "book" / "02_positional_staircases.ipynb"

_spec = importlib.util.spec_from_file_location("notebook_form", ROOT / "tools" / "notebook_form.py")
form = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(form)

# Resolves once the opened notebook's kernel has told JupyterLab its language and spec (what
# JupyterLab copies into the notebook's metadata) and the page has had a moment to apply them.
KERNEL_READY_JS = """async () => {
    const panel = jupyterapp.shell.currentWidget;
    await panel.context.ready;
    await panel.sessionContext.ready;
    const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
    if (!kernel) return 'no kernel started';
    await kernel.info;
    await kernel.spec;
    await new Promise(resolve => setTimeout(resolve, 1000));
    return kernel.status;
}"""

STATE_JS = """() => {
    const panel = jupyterapp.shell.currentWidget;
    return {dirty: panel.context.model.dirty, marked: document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty').length};
}"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jupyterlab-state")
    book = tmp / "notebooks" / "book"
    book.mkdir(parents=True)
    text = CHAPTER.read_text(encoding="utf-8")
    formed = form.form_text(text)
    (book / "stored_form.ipynb").write_text(formed, encoding="utf-8")
    (book / "first_form.ipynb").write_text(formed.replace('"display_name": "Python 3 (ipykernel)"', '"display_name": "Python 3"'), encoding="utf-8")
    with running_lab(tmp, starts_kernel=True) as server:
        yield server


@pytest.fixture(scope="module")
def lab_page(lab):
    with opened_lab_page(lab) as loaded:
        yield loaded
        loaded.page.evaluate("() => jupyterapp.serviceManager.sessions.shutdownAll()")


def _open_and_wait(page, path: str) -> dict:
    page.evaluate(OPEN_JS, path)
    page.wait_for_function("() => { const w = jupyterapp.shell.currentWidget; return w && w.context && w.context.isReady; }",
                           timeout=NOTEBOOK_LOAD_MS)
    status = page.evaluate(KERNEL_READY_JS)
    assert status in ("idle", "busy", "starting"), f"{path}: the kernel did not start ({status})"
    return page.evaluate(STATE_JS)


def test_a_chapter_in_the_stored_form_opens_unmodified_with_graded_answers_folded(lab, lab_page):
    page = lab_page.page
    state = _open_and_wait(page, "book/stored_form.ipynb")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "stored_form-opened.png"))
    assert state == {"dirty": False, "marked": 0}, f"opening the chapter marked it modified: {state}"

    import nbformat

    nb = nbformat.reads(form.form_text(CHAPTER.read_text(encoding="utf-8")), as_version=4)
    graded = [i for i, cell in enumerate(nb.cells) if form.is_graded(cell)]
    assert len(graded) >= 2, "chapter 2 has an answer cell and a grading cell"
    cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    page.wait_for_function("n => document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell').length === n",
                           arg=len(nb.cells), timeout=NOTEBOOK_LOAD_MS)
    for index in graded[:2]:
        cell = cells.nth(index)
        cell.scroll_into_view_if_needed()
        placeholder = cell.locator(".jp-InputPlaceholder")
        assert placeholder.count() and placeholder.first.is_visible(), f"cell {index} (graded) is not folded"
        assert not cell.locator(".jp-InputArea").first.is_visible(), f"cell {index} (graded) shows its editor"
    page.screenshot(path=str(SHOTS / "stored_form-graded-folded.png"))


def test_the_check_sees_a_chapter_that_jupyterlab_modifies(lab, lab_page):
    state = _open_and_wait(lab_page.page, "book/first_form.ipynb")
    assert state["dirty"] and state["marked"] == 1, f"the old form was not marked modified: {state}"
