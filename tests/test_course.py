"""gptlab.course end to end: nbgrader's student edition of a chapter withholds the solutions and
the hidden tests, and the autograder scores the untouched student edition 0, the instructor
source full marks, and a source with one planted mistake all but that exercise's points.

Runs on tests/fixtures/course/01_fixture.ipynb (two graded exercises, one check_backward, one
check_function, a written question) and on chapter 8 once it has grading cells. Each submission
runs in its own sandbox (tests/test_grading_sandbox.py plants the attacks of issue 34): a few
seconds each."""

import json
import re
import shutil
from pathlib import Path

import nbformat
import psutil
import pytest

from gptlab.course import autograde, integrity
from gptlab.course import editions as course
from gptlab.cli import main

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "course" / "01_fixture.ipynb"
SECOND = FIXTURE.with_name("02_second.ipynb")  # a copy of the fixture, as a second chapter
CHAPTER_8 = ROOT / "book" / "08_layernorm_gelu_mlp_backward.ipynb"
MARKERS = {"solution": course.SOLUTION, "hidden": course.HIDDEN}

# Planted mistakes in the fixture's answers: exercise -> (model-answer line, wrong line).
# Exercise 1 drops RMSNorm's path through the root mean square; exercise 2 forgets to subtract
# the maximum, which only the hidden "large logits" case catches.
FIXTURE_MISTAKES = {
    "ex1": ("dx = rstd * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))", "dx = rstd * g"),
    "ex2": ("e = np.exp(x - np.max(x, axis=-1, keepdims=True))", "e = np.exp(x)"),
}


def _chapter_8_is_graded() -> bool:
    return bool(course._graded_cells(nbformat.read(CHAPTER_8, as_version=4)))


CHAPTERS = [
    pytest.param(FIXTURE, id="fixture"),
    pytest.param(CHAPTER_8, id="chapter-8", marks=pytest.mark.skipif(
        not _chapter_8_is_graded(), reason="chapter 8 has no grading cells yet")),
]


def _regions(source: str, markers) -> list[str]:
    return re.findall(re.escape(markers[0]) + r"(.*?)" + re.escape(markers[1]), source, re.S)


def _cell(nb, grade_id):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _plant(nb, exercise: str, wrong_line: tuple[str, str] | None = None):
    """A copy of ``nb`` whose answer to ``exercise`` is wrong: ``wrong_line`` replaced, or, for a
    chapter, the model answer raising before it returns."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    cell = _cell(nb, f"{exercise}_answer")
    if wrong_line is not None:
        assert wrong_line[0] in cell.source
        cell.source = cell.source.replace(*wrong_line)
    else:
        begin = MARKERS["solution"][0]
        indent = cell.source[:cell.source.index(begin)].rsplit("\n", 1)[-1]
        cell.source = cell.source.replace(
            begin, f"{begin}\n{indent}raise ArithmeticError('planted mistake')", 1)
    return nb


# Honest answers to the fixture's exercises, written otherwise than the model answers.
HONEST = {
    "ex1": """def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    g = dy * w
    projection = (g * xhat).sum(axis=-1, keepdims=True) / dy.shape[-1]
    return rstd * (g - xhat * projection), (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0)
""",
    "ex2": """def softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)
""",
}
ZERO_EX1 = """def rmsnorm_backward(dy, cache):
    return np.zeros_like(dy), np.zeros_like(cache[1])
"""
ZERO_EX2 = """def softmax(x):
    return np.zeros_like(x)
"""
TORCH_EX1 = """def rmsnorm_backward(dy, cache):
    import torch
    xhat, w, rstd = cache
    x = torch.tensor(xhat / rstd, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * wt
    {grad}
    return dx.detach().numpy(), dw.detach().numpy()
"""
GRAD = "dx, dw = torch.autograd.grad(y, (x, wt), torch.tensor(dy))"
# Cheats planted in the answer cells (issue 24): student -> (ex1 answer, ex2 answer, the flags
# it must raise). Each must score 0 on the exercise it cheats and be flagged.
CHEATS = {
    "patch-grading": ("import gptlab.course.grading as g\n"
                      "g._backward_case = lambda *a, **k: 'rel. error < 1e-7'\n"
                      "g._compare = lambda *a, **k: None\n" + ZERO_EX1, ZERO_EX2,
                      ["imports gptlab.course.grading", "assigns g._backward_case, g._compare"]),
    "patch-norm": ("np.linalg.norm = lambda *a, **k: 0.0\nnp.allclose = lambda *a, **k: True\n"
                   + ZERO_EX1, ZERO_EX2, ["assigns np.linalg.norm, np.allclose"]),
    "thread": (TORCH_EX1.format(grad="import threading\n    out = []\n    thread = threading."
                                     "Thread(target=lambda: out.append(torch.autograd.grad("
                                     "y, (x, wt), torch.tensor(dy))))\n    thread.start()\n"
                                     "    thread.join()\n    dx, dw = out[0]"),
               HONEST["ex2"], ["threads", "the autograd engine"]),
    "pool": (TORCH_EX1.format(grad="from concurrent.futures import ThreadPoolExecutor\n"
                                   "    with ThreadPoolExecutor(1) as pool:\n"
                                   "        dx, dw = pool.submit(lambda: " + GRAD.split("= ")[1]
                                   + ").result()"),
             HONEST["ex2"], ["threads", "the autograd engine"]),
    "setprofile": (TORCH_EX1.format(grad="import sys\n    sys.setprofile(None)\n    " + GRAD),
                   HONEST["ex2"], ["profile/trace hooks", "the autograd engine"]),
    "engine": (TORCH_EX1.format(grad="from torch.autograd.variable import Variable\n"
                                     "    dx, dw = Variable._execution_engine.run_backward("
                                     "(y,), (torch.tensor(dy),), False, False, (x, wt), False)"),
               HONEST["ex2"], ["the autograd engine"]),
    "redefine": ("def rmsnorm_forward(x, w, *, eps=1e-5):\n"
                 "    return 0 * x, (x, w, x)\n\n" + ZERO_EX1, HONEST["ex2"],
                 ["redefines the given rmsnorm_forward"]),
    "renamed": (HONEST["ex1"], "import types\n"
                "_code = softmax_forward.__code__.replace(co_name='mine')\n"
                "_mine = types.FunctionType(_code, softmax_forward.__globals__)\n"
                "def softmax(x):\n    return _mine(x)[0]\n", ["exec/getsource/__code__"]),
    "getsource": (HONEST["ex1"], "import inspect\n"
                  "_space = dict(softmax_forward.__globals__)\n"
                  "exec(inspect.getsource(softmax_forward).replace('softmax_forward', 'mine'),"
                  " _space)\n"
                  "def softmax(x):\n    return _space['mine'](x)[0]\n",
                  ["exec/getsource/__code__"]),
    "finite-differences": ("""def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    x, grads = xhat / rstd, []
    for a in (x, w):
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            saved = a[i]
            a[i] = saved + 1e-6
            up = np.sum(rmsnorm_forward(x, w)[0] * dy)
            a[i] = saved - 1e-6
            down = np.sum(rmsnorm_forward(x, w)[0] * dy)
            a[i] = saved
            g[i] = (up - down) / 2e-6
        grads.append(g)
    return tuple(grads)
""", HONEST["ex2"], []),
}


# Honest answers in the styles of issue 34: style -> (ex1 answer, ex2 answer).
STYLES = {
    "float32": ("""def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    g = dy * w
    dot = np.einsum("...c,...c->...", g, xhat)[..., None] * (1.0 / dy.shape[-1])
    dw = (dy * xhat).reshape(-1, dy.shape[-1]).sum(axis=0, dtype=dy.dtype)
    return (rstd * (g - xhat * dot)).astype(dy.dtype), dw
""", """def softmax(x):
    e = np.exp(x - np.amax(x, axis=-1, keepdims=True), dtype=x.dtype)
    return (e / np.sum(e, axis=-1, keepdims=True)).astype(x.dtype, copy=False)
"""),
    "deleted": ("""def _row_mean(a):
    return a.mean(axis=-1, keepdims=True)


def _sum_rows(a):
    return a.reshape(-1, a.shape[-1]).sum(axis=0)


def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    g = dy * w
    return rstd * (g - xhat * _row_mean(g * xhat)), _sum_rows(dy * xhat)
""", """def _stable(x):
    return x - x.max(axis=-1, keepdims=True)


def softmax(x):
    e = np.exp(_stable(x))
    return e / e.sum(axis=-1, keepdims=True)
"""),
    "colab": ("""def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    x = xhat / rstd
    g = dy * w
    dx = g * rstd - x * rstd**3 * np.sum(g * x, axis=-1, keepdims=True) / x.shape[-1]
    return dx, np.sum(dy * xhat, axis=tuple(range(dy.ndim - 1)))
""", """def softmax(x):
    m = np.max(x, axis=-1, keepdims=True)
    return np.exp(x - (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))))
"""),
    "jupyterlab": ("""def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    C = dy.shape[-1]
    flat_dy, flat_xhat = dy.reshape(-1, C), xhat.reshape(-1, C)
    g = dy * w
    dx = rstd * g - rstd * xhat * (g * xhat).mean(-1, keepdims=True)
    return dx, (flat_dy * flat_xhat).sum(0)
""", """def softmax(x):
    shifted = x - x.max(-1)[..., None]
    return np.exp(shifted) / np.exp(shifted).sum(-1)[..., None]
"""),
    "matplotlib": (HONEST["ex1"].replace("projection", "p"), HONEST["ex2"]),
    "out-of-order": ("""def rmsnorm_backward(dy, cache):
    xhat, w, rstd = cache
    g = dy * w
    mean = np.mean(g * xhat, axis=-1, keepdims=True)
    return rstd * g - rstd * mean * xhat, np.sum(dy * xhat, axis=tuple(range(dy.ndim - 1)))
""", """def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / np.add.reduce(e, axis=-1, keepdims=True)
"""),
}
MATPLOTLIB = """import matplotlib.pyplot as plt
xs = np.linspace(-3, 3, 50)
plt.plot(xs, softmax(np.stack([xs, -xs], -1))[:, 0])
plt.title("my softmax")
plt.show()
"""


def _as_colab(nb) -> None:
    """What Colab keeps of a notebook: its own metadata, nbgrader's gone."""
    nb.metadata = {"colab": {"provenance": []}, "kernelspec": {"name": "python3",
                                                             "display_name": "Python 3"}}
    for k, cell in enumerate(nb.cells):
        cell.metadata = {"id": f"c{k:04x}"}


def _as_jupyterlab(nb) -> None:
    """JupyterLab's metadata: execution times, tags, outputs of a run."""
    for cell in nb.cells:
        cell.metadata.setdefault("tags", [])
        if cell.cell_type == "code":
            cell.metadata["execution"] = {"iopub.execute_input": "2026-11-20T10:00:00.000Z"}
            cell.execution_count = 3
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]


def _out_of_order(nb) -> None:
    """Cells run out of order, and the answer to exercise 2 moved below its grading cell."""
    for k, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = 40 - k
    answer = _cell(nb, "ex2_answer")
    nb.cells.remove(answer)
    nb.cells.insert(nb.cells.index(_cell(nb, "ex2")) + 1, answer)


def _answered(nb, answers: dict):
    """A copy of the student edition ``nb`` with the answer cells of ``answers`` (exercise ->
    code) written in."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    for exercise, code in answers.items():
        cell = _cell(nb, f"{exercise}_answer")
        cell.source = cell.source.split("\n", 1)[0] + "\n" + code
    return nb


def _tamper(nb, exercise: str):
    """A copy of ``nb`` whose grading cell of ``exercise`` no longer checks anything."""
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    _cell(nb, exercise).source = "# Grading cell, edited by the student\npass"
    return nb


def _sandboxes() -> set[int]:
    """The sandboxes and runners this process started, and whatever they started."""
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if any("bwrap" in part or "gptlab.course.runner" in part
                   for part in process.cmdline()) or process.uids().real == 65534:
                found.add(process.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(scope="module", params=CHAPTERS)
def graded(request, tmp_path_factory, monkeypatch_module):
    """The student edition of one chapter, and the grades of submissions of it."""
    chapter = request.param
    monkeypatch_module.setenv("PYTHONPATH", str(ROOT))  # the kernels import this gptlab
    tmp = tmp_path_factory.mktemp("course")
    source, only = chapter.parent, [chapter.stem]
    if chapter == FIXTURE:  # and a second chapter that only one student hands in
        source, only = tmp / "source", [chapter.stem, SECOND.stem]
        source.mkdir()
        shutil.copyfile(chapter, source / chapter.name)
        shutil.copyfile(chapter, source / SECOND.name)
    edition = course.student_edition(tmp / "student", source, [chapter.stem])
    assert edition.notebooks == [tmp / "student" / chapter.name] and not edition.left_out
    student_nb = nbformat.read(edition.notebooks[0], as_version=4)
    source_nb = nbformat.read(chapter, as_version=4)
    graded_ids = [c.metadata.nbgrader["grade_id"] for c in course._graded_cells(source_nb)]

    submissions = {"untouched": student_nb, "instructor": source_nb}
    if chapter == FIXTURE:
        for exercise, wrong_line in FIXTURE_MISTAKES.items():
            submissions[f"mistake-{exercise}"] = _plant(source_nb, exercise, wrong_line)
        submissions["tampered"] = _tamper(student_nb, "ex1")
        honest = _answered(student_nb, HONEST)
        submissions["honest"] = honest
        submissions["chatty"] = _answered(student_nb, {
            exercise: code.replace("):\n", "):\n    import sys, warnings\n"
                                   "    warnings.warn('a float64 constant')\n"
                                   "    print('debug', file=sys.stderr)\n", 1)
            for exercise, code in HONEST.items()})
        for style, (ex1, ex2) in STYLES.items():
            submissions[style] = _answered(student_nb, {"ex1": ex1, "ex2": ex2})
        submissions["deleted"].cells = [
            c for c in submissions["deleted"].cells
            if c.metadata.get("nbgrader", {}).get("grade_id") not in ("ex1", "ex1_given")]
        _as_colab(submissions["colab"])
        _as_jupyterlab(submissions["jupyterlab"])
        _out_of_order(submissions["out-of-order"])
        submissions["matplotlib"].cells.append(nbformat.v4.new_code_cell(MATPLOTLIB))
        for student, (ex1, ex2, _) in CHEATS.items():
            submissions[student] = _answered(student_nb, {"ex1": ex1, "ex2": ex2})
    else:
        submissions[f"mistake-{graded_ids[0]}"] = _plant(source_nb, graded_ids[0])
    for student, nb in submissions.items():
        (tmp / "submitted" / student).mkdir(parents=True)
        nbformat.write(nb, tmp / "submitted" / student / chapter.name)
    if chapter == FIXTURE:
        nbformat.write(submissions["honest"], tmp / "submitted" / "honest" / SECOND.name)

    before = _sandboxes()
    grades = autograde.grade(tmp / "submitted", source, only, timeout=300,
                             autograded=tmp / "autograded", jobs=2)
    after = _sandboxes()
    return dict(chapter=chapter, tmp=tmp, grades=grades, graded_ids=graded_ids,
                student_nb=student_nb, source_nb=source_nb, leftover=after - before)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _points(grades, student, chapter=FIXTURE.stem) -> dict[str, tuple[float, float]]:
    return {r.exercise: (r.points, r.max_points) for r in grades.rows
            if (r.student, r.chapter) == (student, chapter)}


def test_the_student_edition_withholds_solutions_and_hidden_tests(graded):
    source_nb, student_nb = graded["source_nb"], graded["student_nb"]
    text = json.dumps(student_nb)
    for kind, markers in MARKERS.items():
        assert markers[0] not in text and markers[1] not in text, kind
        outside = "\n".join(re.sub(re.escape(markers[0]) + ".*?" + re.escape(markers[1]), "",
                                   c.source, flags=re.S) for c in source_nb.cells)
        for region in (r for c in source_nb.cells for r in _regions(c.source, markers)):
            for line in filter(None, (line.strip() for line in region.splitlines())):
                if line not in outside:  # a line only the withheld region has
                    assert line not in text, f"{kind} line left in the student edition: {line}"
    solutions = 0
    for source_cell, cell in zip(source_nb.cells, student_nb.cells, strict=True):
        meta = source_cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code":
            assert cell.outputs == []
        if meta.get("grade") and meta.get("solution") is False:  # grading cell: locked
            assert cell.metadata["editable"] is False and cell.metadata["deletable"] is False
        if meta.get("solution") and cell.cell_type == "markdown":  # written answer
            assert cell.source == "YOUR ANSWER HERE"
        if meta.get("grade_id", "").endswith("_answer"):
            assert "raise NotImplementedError()" in cell.source
        if meta.get("grade_id", "").endswith("_solution"):  # ungraded: replaced, not raising
            assert cell.source == course.UNGRADED_STUB[1]
            solutions += 1
    assert solutions == sum(c.metadata.get("nbgrader", {}).get("grade_id", "").endswith("_solution")
                            for c in source_nb.cells)
    readme = (graded["tmp"] / "student" / "README.md").read_text()
    points = sum(c.metadata.nbgrader["points"] for c in course._graded_cells(source_nb))
    assert f"| {graded['chapter'].stem} | {len(graded['graded_ids'])} | {points:g} |" in readme


def test_every_grading_cell_of_the_student_edition_fails(graded):
    """The feedback shows each grading cell's report, from the grader."""
    run = nbformat.read(graded["tmp"] / "autograded" / "untouched" / graded["chapter"].name, 4)
    errors = {c.metadata.nbgrader["grade_id"]: [o for o in c.outputs if o.output_type == "error"]
              for c in course._graded_cells(run)}
    assert list(errors) == graded["graded_ids"]
    for grade_id, outputs in errors.items():
        assert outputs and "NotImplementedError" in outputs[0].evalue, grade_id


def test_grades_untouched_zero_instructor_full_a_mistake_loses_its_exercise(graded):
    grades, ids, chapter = graded["grades"], graded["graded_ids"], graded["chapter"].stem
    assert not grades.failed
    points = {c.metadata.nbgrader["grade_id"]: float(c.metadata.nbgrader["points"])
              for c in course._graded_cells(graded["source_nb"])}
    full = {i: (points[i], points[i]) for i in ids}
    assert _points(grades, "instructor", chapter) == full
    assert _points(grades, "untouched", chapter) == {i: (0.0, full[i][1]) for i in ids}
    mistakes = [s for s in {r.student for r in grades.rows} if s.startswith("mistake-")]
    assert mistakes
    for student in mistakes:
        wrong = student.removeprefix("mistake-")
        assert _points(grades, student, chapter) == {**full, wrong: (0.0, full[wrong][1])}
    assert graded["leftover"] == set(), "processes left running after grading"


def test_an_edited_grading_cell_is_put_back_and_reported(graded):
    if graded["chapter"] != FIXTURE:
        pytest.skip("planted in the fixture only")
    grades = graded["grades"]
    assert _points(grades, "tampered") == {"ex1": (0.0, 4.0), "ex2": (0.0, 2.0)}
    tampered = [note for note in grades.notes if note.startswith("tampered/")]
    assert len(tampered) == 1 and "cell ex1 has changed" in tampered[0], grades.notes
    assert not [note for note in grades.notes if not note.startswith("tampered/")], grades.notes


def test_the_csv_has_a_row_per_exercise_and_a_total_per_student(graded, tmp_path):
    grades = graded["grades"]
    grades.write_csv(tmp_path / "grades.csv")
    lines = (tmp_path / "grades.csv").read_text().splitlines()
    assert lines[0] == "student,chapter,exercise,points,max_points,flags"
    students = sorted({r.student for r in grades.rows})
    assert len(lines) == 1 + len(grades.rows) + len(students)
    chapters = 2 if graded["chapter"] == FIXTURE else 1
    assert len(grades.rows) == len(students) * len(graded["graded_ids"]) * chapters \
        - (len(students) - 1) * (len(graded["graded_ids"]) - 1) * (chapters - 1)
    max_total = sum(r.max_points for r in grades.rows if r.student == "instructor")
    assert f"untouched,all,total,0,{max_total:g}," in lines
    assert any(line.startswith(f"instructor,all,total,{max_total / chapters:g},{max_total:g},")
               for line in lines)
    (tmp_path / "logs").mkdir()
    grades.write_logs(tmp_path / "logs")
    log = (tmp_path / "logs" / "untouched.log").read_text()
    assert log.startswith(f"{graded['chapter'].stem}: 0 of ") and " s\n" in log


def test_a_chapter_not_handed_in_counts_zero_of_its_points(graded):
    if graded["chapter"] != FIXTURE:
        pytest.skip("two chapters in the fixture's run only")
    grades = graded["grades"]
    assert grades.totals()["honest"] == (12.0, 12.0)
    assert grades.totals()["instructor"] == (6.0, 12.0)
    assert _points(grades, "instructor", SECOND.stem) == {"not handed in": (0.0, 6.0)}


def test_correct_work_scores_full_marks(graded):
    """Warnings and stderr in a correct answer, a deleted grading cell, and each style of issue
    34: float32 throughout, helpers, another formula, matplotlib, JupyterLab's and Colab's
    metadata (nbgrader's stripped), cells out of order."""
    if graded["chapter"] != FIXTURE:
        pytest.skip("planted in the fixture only")
    grades = graded["grades"]
    for student in ("honest", "chatty", *STYLES):
        assert _points(grades, student) == {"ex1": (4.0, 4.0), "ex2": (2.0, 2.0)}, student
        if student != "deleted":  # Colab's stripped metadata is no suspicion (issue 34)
            assert grades.flagged(student) == [], student
    assert grades.flagged("deleted", FIXTURE.stem) == [
        "missing, put back: given cell ex1_given; grading cell ex1"]
    feedback = (graded["tmp"] / "autograded" / "chatty" / FIXTURE.name).read_text()
    assert "warns UserWarning: a float64 constant" in feedback and "stderr: debug" in feedback


@pytest.mark.parametrize("student", list(CHEATS))
def test_every_cheat_scores_zero_and_is_flagged(graded, student):
    if graded["chapter"] != FIXTURE:
        pytest.skip("planted in the fixture only")
    ex1, ex2, flags = CHEATS[student]
    cheated = "ex1" if ex1 != HONEST["ex1"] else "ex2"
    points = _points(graded["grades"], student)
    assert points[cheated][0] == 0.0, points
    flagged = graded["grades"].flagged(student, FIXTURE.stem)
    assert set(flags) <= set(flagged), flagged


def test_the_book_s_own_chapter_is_flagged_and_feedback_hides_the_hidden_tests(graded):
    if graded["chapter"] != FIXTURE:
        pytest.skip("planted in the fixture only")
    assert graded["grades"].flagged("instructor", FIXTURE.stem) == [
        "the model answer of ex1, ex2, as published",
        "the book's own chapter (it holds the answer or hidden-test markers)"]
    for feedback in (graded["tmp"] / "autograded").glob("*/*.ipynb"):
        text = feedback.read_text()
        assert course.HIDDEN[0] not in text and 'hidden["large logits"] =' not in text, feedback


def test_the_instructor_edition_from_the_command_line(tmp_path, capsys):
    assert main(["edition", "instructor", str(tmp_path), "--source", str(FIXTURE.parent)]) == 0
    assert "instructor edition: 1 chapters" in capsys.readouterr().out
    assert (tmp_path / FIXTURE.name).read_bytes() == FIXTURE.read_bytes()
    assert (tmp_path / "RUBRIC.md").read_text() == course.rubric([FIXTURE])


def test_rubric_lists_points_checkers_hidden_tests_and_model_answers():
    text = course.rubric([FIXTURE])
    assert "In all: 2 graded exercises, 6 points." in text
    assert "| 1. Write this backward yourself: RMSNorm (`ex1`) | 4 | " \
           "`check_backward(rmsnorm_forward, rmsnorm_backward)` |" in text
    assert "| 2. Write this function yourself: softmax (`ex2`) | 2 | " \
           "`check_function(softmax, softmax_reference)` |" in text
    assert 'hidden["large logits"]' in text  # the hidden tests, as code
    assert "**3. Why no mean?**" in text and "> LayerNorm subtracts the row mean" in text


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="submissions folder"):
        autograde.grade(tmp_path / "missing", FIXTURE.parent)
    with pytest.raises(ValueError, match="no chapter '99'"):
        course.chapters(FIXTURE.parent, ["99"])
    (tmp_path / "ann").mkdir()
    (tmp_path / "ann" / "notes.ipynb").write_text("{}")
    with pytest.raises(ValueError, match="notes.ipynb is not a chapter"):
        autograde.grade(tmp_path, FIXTURE.parent)
    # the command line says the same, without a traceback
    assert main(["grade", str(tmp_path), "--source", str(FIXTURE.parent)]) == 2
    assert main(["grade", str(tmp_path), "--source", str(FIXTURE.parent), "--jobs", "0"]) == 2


def test_only_the_chosen_chapters_are_graded(tmp_path):
    (tmp_path / "book").mkdir()
    (tmp_path / "submitted" / "ann").mkdir(parents=True)
    chapters = [tmp_path / "book" / "01_a.ipynb", tmp_path / "book" / "02_b.ipynb"]
    for path in chapters:
        path.write_text("{}")
        (tmp_path / "submitted" / "ann" / path.name).write_text("{}")
    (tmp_path / "submitted" / "ann" / "notes.ipynb").write_text("{}")
    found, left_out = integrity.submissions(tmp_path / "submitted", chapters,
                                            course.chapters(tmp_path / "book", ["02"]))
    assert found == [integrity.Submission("ann", chapters[1],
                                          tmp_path / "submitted" / "ann" / "02_b.ipynb")]
    assert len(left_out) == 1 and "notes.ipynb is not a chapter" in left_out[0]


def test_nbgrader_rejects_broken_metadata_and_the_error_says_why(tmp_path):
    nb = nbformat.read(FIXTURE, as_version=4)
    _cell(nb, "ex3_written").metadata.nbgrader["grade"] = False  # as nbgrader forbids
    source = tmp_path / "source"
    source.mkdir()
    nbformat.write(nb, source / FIXTURE.name)
    with pytest.raises(course.CourseError, match="Markdown solution cell is not marked as a grade"):
        course.instructor_edition(tmp_path / "instructor", source)


def test_the_student_book_leaves_out_answers_and_grading_cells(tmp_path):
    shutil.copyfile(FIXTURE, tmp_path / FIXTURE.name)
    assert course.without_answers(tmp_path) == [tmp_path / FIXTURE.name]
    nb = nbformat.read(tmp_path / FIXTURE.name, as_version=4)
    ids = [c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells]
    assert [i for i in ids if i] == ["ex1_given"]
    text = json.dumps(nb)
    assert course.SOLUTION[0] not in text and course.HIDDEN[0] not in text
    assert "<details>" not in text and "**3. Why no mean?**" in text


# The capstone's loopholes (issue 24, section 2b), planted in its model answers and checked by its
# own grading cells (the visible checks, and Part 4 up to the training), in this process.
CAPSTONE = ROOT / "book" / "capstone.ipynb"
CAPSTONE_PLANTS = {
    "part 1 from gptlab.layers": ("ex1", "ex1", (
        "    mu = x.mean(-1, keepdims=True)\n",
        "    from gptlab.layers.layernorm import layernorm_forward\n"
        "    return layernorm_forward(x, w, b, eps=eps)[0], None\n"),
        "calls gptlab.layers.layernorm.layernorm_forward"),
    "part 2 reuses the last layer's cache": ("ex2", "ex2", (
        'c, p = cache["blocks"][layer], cache["blocks"][layer]["p"]',
        'c, p = cache["blocks"][-1], cache["blocks"][layer]["p"]'), "2 layers (2, 3) float64"),
    "part 2 with a float64 loss": ("ex1", "ex2", (
        "loss = -np.log(np.take_along_axis(probs, targets[..., None], -1)).mean()",
        "loss = -np.log(np.take_along_axis(probs, targets[..., None], -1)).mean()"
        ".astype(np.float64)"), "loss_forward returns float64 for float32 inputs"),
    "part 3 in place": ("ex3", "ex3", (
        "    m = b1 * m + (1 - b1) * g\n", "    m *= b1\n    m += (1 - b1) * g\n"),
        "adamw changed m in place"),
    "part 4 with a broken backward": ("ex2", "ex4", (
        "        dq, dk = ds @ c[\"k\"], ds.swapaxes(-1, -2) @ c[\"q\"]\n",
        "        dq, dk = 0 * ds @ c[\"k\"], 0 * ds.swapaxes(-1, -2) @ c[\"q\"]\n"),
        "Part 4 counts only when gpt_loss_backward is right"),
}


def _capstone_cells():
    nb = nbformat.read(CAPSTONE, as_version=4)
    by_id = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}
    imports = "\n".join(line for line in nb.cells[2].source.splitlines()
                        if not line.startswith("%"))
    return imports, by_id


@pytest.mark.parametrize("plant", list(CAPSTONE_PLANTS))
def test_the_capstone_s_loopholes_are_closed(plant):
    answer, grading, (right, wrong), message = CAPSTONE_PLANTS[plant]
    imports, cells = _capstone_cells()
    assert right in cells[f"{answer}_answer"], plant
    namespace = {"display": lambda report: None}
    exec(imports, namespace)
    for k in range(1, 5):
        source = cells[f"ex{k}_answer"]
        exec(source.replace(right, wrong) if f"ex{k}" == answer else source, namespace)
    last = int(grading[2:])
    for k in range(1, last + 1):
        source = cells[f"ex{k}"].split(course.HIDDEN[0])[0]
        if k == 4:
            source = source.split("# The data again")[0]  # the check of the backward, no training
        if k < last:  # an earlier part: its definitions only (loss_forward, model_inputs)
            exec(source.split("\ngrade = ")[0], namespace)
            continue
        with pytest.raises(AssertionError) as failure:
            exec(source, namespace)
        assert message in str(failure.value), str(failure.value)


def test_the_capstone_s_model_answers_pass_the_same_checks():
    imports, cells = _capstone_cells()
    namespace = {"display": lambda report: None}
    exec(imports, namespace)
    for k in range(1, 5):
        exec(cells[f"ex{k}_answer"], namespace)
    for k in range(1, 5):
        source = cells[f"ex{k}"].split(course.HIDDEN[0])[0]
        exec(source.split("# The data again")[0] if k == 4 else source, namespace)
    assert namespace["backward"].passed
