"""Notebooks stored in the form JupyterLab saves them (tools/notebook_form.py), graded answers
folded in JupyterLab and Colab, and open in the student edition.

- every chapter is stored in that form: normalising it again changes no byte;
- the normaliser folds every graded answer cell (``### BEGIN SOLUTION``) and grading cell
  (``metadata.jupyter.source_hidden``), keeps them tagged ``hide-input`` for the HTML book and
  tags them ``exercise-answer`` / ``grading-cell`` (the labels of their toggles),
  keeps JupyterLab's ``collapsed`` in step with ``outputs_hidden``, and writes numbers as
  JavaScript does; it is idempotent; ``--check`` names a notebook out of form;
- the student edition (``make student``) shows the cells the student writes in unfolded.

That opening a chapter in a real JupyterLab marks nothing modified is checked in
tests/test_jupyterlab.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(ROOT.glob("book/*.ipynb"))
FIXTURE = ROOT / "tests" / "fixtures" / "course" / "01_fixture.ipynb"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


form = _tool("notebook_form")


def _graded(nb) -> list[int]:
    return [i for i, cell in enumerate(nb.cells) if form.is_graded(cell)]


# tools/execute_notebooks.py stores what it executes in this form; tools/notebook_form.py
# rewrites a chapter into it without running it.
@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.stem)
def test_chapter_is_stored_as_jupyterlab_saves_it(chapter):
    text = chapter.read_text(encoding="utf-8")
    assert form.form_text(text) == text, (
        f"{chapter.name} is not stored in JupyterLab's form: run "
        f".venv/bin/python tools/notebook_form.py {chapter.relative_to(ROOT)}")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda path: path.stem)
def test_normalised_chapter_folds_graded_cells_and_is_a_fixed_point(chapter):
    text = chapter.read_text(encoding="utf-8")
    formed = form.form_text(text)
    assert form.form_text(formed) == formed, "normalising twice changes the notebook"
    before, after = nbformat.reads(text, as_version=4), nbformat.reads(formed, as_version=4)
    assert [c.source for c in after.cells] == [c.source for c in before.cells]
    assert [c.get("outputs") for c in after.cells] == [c.get("outputs") for c in before.cells]
    assert after.metadata.kernelspec == form.KERNELSPEC
    graded = _graded(after)
    if chapter.stem[:2].isdigit() and chapter.stem != "00_preface" or chapter.stem == "capstone":
        assert graded, f"{chapter.name}: no graded answer or grading cell found"
    for index in graded:
        cell = after.cells[index]
        assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, f"cell {index} is not folded"
        assert "hide-input" in cell.metadata.get("tags", []), f"cell {index} is not folded in the HTML book"
        assert form.graded_tag(cell) in cell.metadata.tags, f"cell {index}: no tag that labels its toggle"
    if graded:
        kinds = [form.graded_tag(after.cells[i]) for i in graded]
        assert kinds.count("exercise-answer") == kinds.count("grading-cell"), f"answers and grading cells: {kinds}"
    for index, cell in enumerate(after.cells):
        if cell.metadata.get("jupyter", {}).get("outputs_hidden"):
            assert cell.metadata.get("collapsed") is True, f"cell {index}: collapsed not in step with outputs_hidden"


def test_numbers_are_written_as_javascript_writes_them():
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"state": {"min": -3.0, "step": 0.5, "big": 1e21, "n": 7}}})
    state = form.in_form(nb).metadata.widgets["state"]
    assert state == {"min": -3, "step": 0.5, "big": 1e21, "n": 7}
    assert [type(state[k]) for k in ("min", "step", "big", "n")] == [int, float, float, int]


def test_check_names_a_notebook_out_of_form_and_the_rewrite_fixes_it(tmp_path):
    path = tmp_path / "chapter.ipynb"
    shutil.copyfile(CHAPTERS[1], path)
    path.write_text(form.form_text(path.read_text(encoding="utf-8")), encoding="utf-8")
    tool = [sys.executable, str(ROOT / "tools" / "notebook_form.py")]
    assert subprocess.run([*tool, "--check", str(path)], capture_output=True).returncode == 0

    nb = nbformat.read(path, as_version=4)
    nb.metadata.kernelspec.display_name = "Python 3"  # as the chapters were first stored
    answer = _graded(nb)[0]
    nb.cells[answer].metadata.pop("jupyter")  # a graded answer left open
    nbformat.write(nb, path)
    checked = subprocess.run([*tool, "--check", str(path)], capture_output=True, text=True)
    assert checked.returncode == 1 and str(path) in checked.stdout

    assert subprocess.run([*tool, str(path)], capture_output=True).returncode == 0
    fixed = nbformat.read(path, as_version=4)
    assert fixed.metadata.kernelspec.display_name == "Python 3 (ipykernel)"
    assert fixed.cells[answer].metadata.jupyter.source_hidden is True
    assert subprocess.run([*tool, "--check", str(path)], capture_output=True).returncode == 0

    missing = subprocess.run([*tool, str(tmp_path / "nope.ipynb")], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such notebook" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.skipif(importlib.util.find_spec("nbgrader") is None, reason="nbgrader is not installed")
def test_the_student_edition_opens_the_cells_the_student_writes_in(tmp_path, monkeypatch):
    from gptlab.course import editions as course

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    source = tmp_path / "source"
    source.mkdir()
    (source / FIXTURE.name).write_text(form.form_text(FIXTURE.read_text(encoding="utf-8")), encoding="utf-8")
    folded = [c for c in nbformat.read(source / FIXTURE.name, as_version=4).cells
              if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    assert folded and all(c.metadata.jupyter.source_hidden for c in folded), "the instructor source folds its answers"

    edition = course.student_edition(tmp_path / "student", source, [FIXTURE.stem])
    student = nbformat.read(edition.notebooks[0], as_version=4)
    answers = [c for c in student.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    assert len(answers) == len(folded)
    still_folded = [c.source.splitlines()[0] for c in answers
                    if c.metadata.get("jupyter", {}).get("source_hidden") or c.metadata.get("collapsed")]
    assert not still_folded, f"answer cells folded in the student edition: {still_folded}"
