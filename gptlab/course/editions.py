"""The course: a student edition, an instructor edition and an autograder, a thin layer over
nbgrader (docs/COURSE.md).

    python -m gptlab edition student build/student        # solutions and hidden tests removed
    python -m gptlab edition instructor build/instructor  # the chapters as they are + RUBRIC.md
    python -m gptlab grade submissions/ --out grades.csv  # submissions/<student>/<chapter>.ipynb

The chapters are the instructor source: tools/grading_cells.py has written the nbgrader metadata
of their exercise cells. Every chapter is an nbgrader assignment of one notebook, both named
after the chapter's file. Each command runs nbgrader's own converters (GenerateAssignment,
Autograde) in a temporary nbgrader course directory (source/, release/, submitted/,
autograded/, a sqlite gradebook) with its configuration passed explicitly, so no nbgrader or
Jupyter configuration of the user takes part, and removes that directory when it is done.
"""

from __future__ import annotations

import ast
import copy
import csv
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

CHAPTER_PATTERNS = ("[0-9][0-9]_*.ipynb", "capstone.ipynb")
# What the chapters read besides themselves: folder beside the chapters -> folder in an edition.
CHAPTER_DATA = {"figures": "figures", "../benchmarks/results": "benchmarks/results"}
COURSE_ID = "gptlab"
CELL_TIMEOUT = 600  # seconds a cell may run when grading (nbval's limit for the chapters)
# nbgrader's stub for a code solution, and what an ungraded exercise's solution cell gets instead
UNGRADED_STUB = ("# YOUR CODE HERE\nraise NotImplementedError()",
                 "# YOUR CODE HERE (an exercise without points: no grading cell checks it)")
STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$")  # no glob characters: nbgrader globs
CHECKERS = ("check_backward", "check_function")
SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")  # nbgrader's markers of an answer
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
STATEMENT = re.compile(r"^\*\*(\d+)\.\s*(.+?)\*\*", re.M)  # "**3. Title.**" starts an exercise
# What the grader runs in a submission's kernel, unseen: before its first cell, and before each
# grading cell (gptlab.course.grading's private copies of NumPy and torch put back).
GRADING_IMPORT = "try:\n    __import__('gptlab.course.grading')\nexcept ImportError:\n    pass"
GRADING_RESTORE = "__import__('gptlab.course.grading', fromlist=['_restore'])._restore()"

__all__ = ["CELL_TIMEOUT", "CourseError", "Edition", "ExerciseGrade", "Grades", "chapters",
           "grade", "instructor_edition", "nbgrader_of", "rubric", "student_edition"]


class CourseError(RuntimeError):
    """nbgrader could not make an edition or grade a submission; the message quotes nbgrader."""


# ---------------------------------------------------------------------------------------------
# Chapters and their nbgrader cells.


def chapters(source="book", only: Iterable[str] = ()) -> list[Path]:
    """The chapters in ``source`` (``NN_*.ipynb`` and ``capstone.ipynb``); ``only``: chapter
    numbers (``"08"``) or file names without ``.ipynb``."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"chapter folder {source} does not exist")
    found = sorted({path for pattern in CHAPTER_PATTERNS for path in source.glob(pattern)})
    if not found:
        raise ValueError(f"no chapters in {source}: expected notebooks named NN_*.ipynb")
    only = list(only)
    if not only:
        return found
    chosen = set()
    for key in only:
        match = [path for path in found if key in (path.stem, path.stem.split("_", 1)[0])]
        if not match:
            raise ValueError(f"no chapter {key!r} in {source}; the chapters are "
                             f"{', '.join(path.stem for path in found)}")
        chosen.update(match)
    return sorted(chosen)


def nbgrader_of(cell) -> dict:
    """A cell's nbgrader metadata (``grade_id``, ``grade``, ``solution``, ``points``, ``locked``),
    {} for a cell that nbgrader leaves alone: the one reader of it (tools/grading_cells.py too)."""
    return cell.metadata.get("nbgrader", {})


def _graded_cells(nb) -> list:
    """The grading cells of a chapter: code cells that nbgrader grades."""
    return [cell for cell in nb.cells
            if cell.cell_type == "code" and nbgrader_of(cell).get("grade")]


def _read(path: Path):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat raises JSON, validation and version errors
        raise ValueError(f"{path} is not a readable notebook: {error}") from error


# ---------------------------------------------------------------------------------------------
# nbgrader in a temporary course directory.


class _Records(logging.Handler):
    """Collects what nbgrader logs at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _one_line(message: str) -> str:
    """A log message as one line; a logged traceback as the first line of its exception (the
    first line after the last frame that is not indented)."""
    lines = message.strip().splitlines() or [""]
    if lines[0].startswith("Traceback"):
        last = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=0)
        lines = [line for line in lines[last:] if not line.startswith(" ")] or [""]
    return lines[0]


def _said(records, level=logging.WARNING) -> list[str]:
    """nbgrader's messages at ``level`` or above, one line each."""
    return [_one_line(record.getMessage()) for record in records if record.levelno >= level]


class WithoutOutputWidgets:
    """Mixin for an nbclient NotebookClient (or nbgrader's Execute): no copy of ipywidgets'
    Output widget.

    To keep an Output widget's state, nbclient sends comm messages on the kernel's shell channel
    while it waits on that channel for the cell's reply; now and then the reply is missed and the
    cell waits out its whole timeout (nbclient issue #312: here about one chapter in ten whose
    explorer uses `interactive_output`). Where no one sees the widget (the autograder, a timing
    run) its outputs stay with the cell, as they would without ipywidgets."""

    def on_comm_open_jupyter_widget(self, msg):
        return None


def _grading_autograde():
    """nbgrader's Autograde, executing cells with :class:`_GradingExecute`."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    class GradingExecute(WithoutOutputWidgets, Execute):
        """Executes a submission for grading. Before the first cell, gptlab.course.grading is
        imported, so its private copies of NumPy and torch (grading._restore) are taken before any
        student code runs. Before a grading cell ``exK``, what the student's code changed in
        them is put back and the given cells of exercise K run again, so the forward it checks
        is the course's own whatever the answer cell named so. After it, what the cell wrote on
        stderr (a student's warning or debug print) is kept as stdout: nbgrader gives 0 to a
        grading cell with stderr output, and a cell fails only on a failed check."""

        def _run_quietly(self, source, index):
            import nbformat

            self.execute_cell(nbformat.v4.new_code_cell(source), index, store_history=False)

        def preprocess_cell(self, cell, resources, index):
            grade_id = nbgrader_of(cell).get("grade_id", "")
            if index == 0:
                self._run_quietly(GRADING_IMPORT, index)
            if cell.cell_type == "code" and nbgrader_of(cell).get("grade") \
                    and not nbgrader_of(cell).get("solution"):
                self._run_quietly(GRADING_RESTORE, index)
                for given in self.nb.cells:
                    if re.fullmatch(rf"{grade_id}_given(_\d+)?",
                                    nbgrader_of(given).get("grade_id", "")):
                        self._run_quietly(given.source, index)
            cell, resources = super().preprocess_cell(cell, resources, index)
            if nbgrader_of(cell).get("grade"):
                for output in cell.get("outputs", []):
                    if output.output_type == "stream" and output.name == "stderr":
                        output.name = "stdout"
                        output.text = "".join(f"[stderr] {line}"
                                              for line in output.text.splitlines(True))
            return cell, resources

    class GradingAutograde(Autograde):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.autograde_preprocessors = [GradingExecute if step is Execute else step
                                            for step in self.autograde_preprocessors]

    return GradingAutograde


class _Course:
    """A temporary nbgrader course directory: ``root/source/<chapter>/<chapter>.ipynb`` (with the
    data the chapter reads), ``release/``, ``submitted/``, ``autograded/``, ``gradebook.db``."""

    def __init__(self, root: Path, timeout: int):
        from nbgrader.coursedir import CourseDirectory
        from traitlets.config import Config

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.config = Config()
        self.config.CourseDirectory.root = str(root)
        self.config.CourseDirectory.course_id = COURSE_ID
        self.config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
        self.config.Execute.timeout = timeout  # per cell; the kernel is interrupted after it
        # the kernels' own log: errors only (not ipykernel's notice, per kernel, that it talks
        # to nbgrader over TCP on localhost)
        self.config.Execute.extra_arguments = ["--IPKernelApp.log_level=ERROR"]
        self.coursedir = CourseDirectory(config=self.config)
        self.log = logging.getLogger(f"{__name__}.nbgrader")
        self.log.propagate = False  # what nbgrader says is reported through _run's records

    def path(self, step: str, student: str, chapter: str) -> Path:
        return Path(self.coursedir.format_path(step, student, chapter)) / f"{chapter}.ipynb"

    def add_source(self, chapter: Path) -> None:
        """The chapter as an nbgrader assignment, with the data it reads beside it."""
        target = self.path(self.coursedir.source_directory, ".", chapter.stem)
        target.parent.mkdir(parents=True)
        shutil.copyfile(chapter, target)
        _copy_data(chapter.parent, target.parent)

    def _run(self, converter_class, chapter: str, student: str = ".") -> list:
        """Run an nbgrader converter on one chapter (and student); return nbgrader's log records.
        Raise CourseError, quoting nbgrader, when it fails."""
        from nbgrader.utils import temp_attrs

        records = _Records()
        self.log.addHandler(records)
        # nbgrader stamps a new gradebook with the `alembic` script beside this Python
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        try:
            with temp_attrs(self.coursedir, assignment_id=chapter, student_id=student), \
                    mock.patch.dict(os.environ, {"PATH": path, "GPTLAB_GRADING": "1"}), \
                    warnings.catch_warnings():
                # nbgrader's gradebook makes SQLAlchemy warn about its own session handling
                warnings.filterwarnings("ignore", module="nbgrader")
                converter = converter_class(coursedir=self.coursedir, config=self.config,
                                            log=self.log)
                converter.force = True
                converter.start()
        except Exception as error:
            said = [line for line in _said(records.records, logging.ERROR)
                    if not line.startswith(("There was an error processing assignment",
                                            "Please see the"))]
            raise CourseError("; ".join(dict.fromkeys(said)) or str(error)) from error
        finally:
            self.log.removeHandler(records)
        return records.records

    def generate(self, chapter: str) -> Path:
        """``nbgrader generate_assignment``: the student version of a chapter."""
        from nbgrader.converters import GenerateAssignment

        try:
            self._run(GenerateAssignment, chapter)
        except CourseError as error:
            raise CourseError(f"nbgrader could not make the student version of {chapter}: "
                              f"{error}") from error
        return self.path(self.coursedir.release_directory, ".", chapter)

    def autograde(self, chapter: str, student: str) -> list[str]:
        """``nbgrader autograde`` of one submission (already under submitted/); return what
        nbgrader reported about it, less the expected notice that grading cells with hidden
        tests differ from the student version."""
        records = self._run(_grading_autograde(), chapter, student)
        released = {nbgrader_of(cell).get("grade_id"): nbgrader_of(cell).get("checksum") for cell in
                    _read(self.path(self.coursedir.release_directory, ".", chapter)).cells}
        notes = []
        for line in _said(records):
            changed = re.match(r"Attribute 'checksum' for cell (\S+) has changed! "
                               r"\(should be: \w+, got: (\w+)\)", line)
            if changed and released.get(changed.group(1)) == changed.group(2):
                continue  # the student's copy of a grading cell, hidden tests put back
            notes.append(f"{student}/{chapter}: nbgrader: {line}")
        return notes


def _require_nbgrader() -> None:
    if importlib.util.find_spec("nbgrader") is None:
        raise CourseError("the course commands need nbgrader: pip install nbgrader "
                          "(requirements.txt pins its version)")


@contextmanager
def _course(timeout: int = CELL_TIMEOUT):
    _require_nbgrader()
    with tempfile.TemporaryDirectory(prefix="gptlab-course-") as root:
        yield _Course(Path(root) / "course", timeout)  # beside it: workers' copies (grade)


def _copy_data(source: Path, target: Path) -> None:
    """The data of the chapters in ``source`` (CHAPTER_DATA) into ``target``, what exists."""
    for origin, destination in CHAPTER_DATA.items():
        if (source / origin).is_dir():
            shutil.copytree(source / origin, target / destination, dirs_exist_ok=True)


# ---------------------------------------------------------------------------------------------
# The editions.


@dataclass(frozen=True)
class Edition:
    """The notebooks an edition was given, and the chapters left out with the reason."""

    notebooks: list[Path]
    left_out: list[str] = field(default_factory=list)


STUDENT_README = """\
# gptlab, the student edition

These notebooks are the chapters of the gptlab book with the exercises left to you. In each
graded exercise an answer cell (`# Exercise K: ...`) has `raise NotImplementedError()` where
your code goes, and a locked grading cell checks your answer on one small case you can see.
When your work is graded, the grading cells run again with hidden tests: other shapes, one
token, float32 and float64. Written questions have a cell that says YOUR ANSWER HERE.

Run every chapter from its first cell. Do not edit or delete the grading cells (they are put
back as they were when grading) and keep the file names: hand in `<chapter>.ipynb` as it is.

## On your computer

    python -m venv .venv
    .venv/bin/pip install "gptlab[notebooks] @ git+<the gptlab repository address>" jupyterlab
    .venv/bin/jupyter lab

(`gptlab[notebooks,hf]` for chapters 9 and 13.) Keep `figures/` and `benchmarks/` beside the
notebooks: some chapters read them.

## On Colab

Upload a notebook (File > Upload notebook) and run it: its first cell installs gptlab when the
book's repository address is set, and otherwise says how to install it. Upload `figures/` and
`benchmarks/` to the session's files too for the chapters that read them.

## Graded work

| Chapter | Graded exercises | Points |
|---|---|---|
"""


def student_edition(out_dir, source="book", only: Iterable[str] = ()) -> Edition:
    """nbgrader's student version of every chapter with graded work, as ``out_dir/<chapter>.ipynb``
    (solutions replaced by stubs, hidden tests removed, outputs cleared, grading cells locked),
    the data the chapters read, and a README for students. A chapter without grading cells is
    left out (it would show its solutions)."""
    out_dir = Path(out_dir)
    notebooks, left_out, table = [], [], []
    with _course() as course:
        for chapter in chapters(source, only):
            graded = _graded_cells(_read(chapter))
            if not graded:
                left_out.append(f"{chapter.stem}: no grading cells yet (tools/grading_cells.py)")
                continue
            course.add_source(chapter)
            released = course.generate(chapter.stem)
            out_dir.mkdir(parents=True, exist_ok=True)
            notebooks.append(_without_raising_stubs(released, out_dir / chapter.name))
            points = sum(nbgrader_of(cell)["points"] for cell in graded)
            table.append(f"| {chapter.stem} | {len(graded)} | {points:g} |\n")
    if not notebooks:
        raise ValueError(f"no chapter in {source} has grading cells yet: no student edition")
    _copy_data(Path(source), out_dir)
    (out_dir / "README.md").write_text(STUDENT_README + "".join(table))
    return Edition(notebooks, left_out)


def _without_raising_stubs(released: Path, target: Path) -> Path:
    """Copy a released notebook, with the stub of each ungraded code solution (``exK_solution``)
    made harmless: nothing grades those cells, so running every cell should not stop there.
    The cells the student writes in open unfolded (the book folds its model answers)."""
    import nbformat

    nb = _read(released)
    for cell in nb.cells:
        meta = nbgrader_of(cell)
        if meta.get("solution") and cell.cell_type == "code":
            cell.metadata.pop("jupyter", None)  # source_hidden, outputs_hidden
            cell.metadata.pop("collapsed", None)
        if meta.get("solution") and not meta.get("grade") and cell.cell_type == "code" \
                and re.fullmatch(r"ex\d+_solution(_\d+)?", meta.get("grade_id", "")):
            cell.source = cell.source.replace(UNGRADED_STUB[0], UNGRADED_STUB[1])
    nbformat.write(nb, target)
    return target


def instructor_edition(out_dir, source="book", only: Iterable[str] = ()) -> Edition:
    """The chapters as they are (solutions, hidden tests, outputs), the data they read and
    ``RUBRIC.md`` (:func:`rubric`), in ``out_dir``. The nbgrader metadata of every chapter is
    validated first, by nbgrader."""
    _require_nbgrader()
    from nbgrader.nbgraderformat import MetadataValidator, ValidationError

    selected = chapters(source, only)
    for chapter in selected:
        try:
            MetadataValidator().validate_nb(_read(chapter))
        except ValidationError as error:
            raise CourseError(f"nbgrader: the metadata of {chapter} is not valid: "
                              f"{error.message.splitlines()[0]}") from error
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notebooks = [Path(shutil.copyfile(chapter, out_dir / chapter.name)) for chapter in selected]
    _copy_data(Path(source), out_dir)
    (out_dir / "RUBRIC.md").write_text(rubric(selected))
    return Edition(notebooks)


def without_answers(folder) -> list[Path]:
    """Remove, in place, from every chapter in ``folder`` the cells a student must not see: the
    answer cells, code solutions, grading cells (with their hidden tests) and written model
    answers (``make book-student``: the HTML book for credit-bearing use). Given cells stay.
    Return the chapters changed."""
    import nbformat

    changed = []
    for chapter in chapters(folder):
        nb = _read(chapter)
        kept = [cell for cell in nb.cells if not _withheld(cell)]
        if len(kept) != len(nb.cells):
            nb.cells = kept
            nbformat.write(nb, chapter)
            changed.append(chapter)
    return changed


def _withheld(cell) -> bool:
    """An answer, code solution, grading cell or written model answer (not a given cell)."""
    return bool(nbgrader_of(cell).get("solution") or nbgrader_of(cell).get("grade"))


# ---------------------------------------------------------------------------------------------
# The rubric.


def _statements(nb) -> dict[int, str]:
    """exercise number -> its statement (markdown, from ``**K. Title**`` to the next one)."""
    found = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            starts = list(STATEMENT.finditer(cell.source))
            for start, end in zip(starts, starts[1:] + [None]):
                found[int(start.group(1))] = cell.source[start.start():end.start() if end else None]
    return found


def _title(statement: str) -> str:
    match = STATEMENT.match(statement)
    return f"{match.group(1)}. {match.group(2).rstrip('.')}" if match else ""


def _checker(source: str) -> str:
    """``check_backward(forward, backward)``: the first checker call of a grading cell."""
    code = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))  # IPython magics
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "its own asserts"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in CHECKERS:
            return f"`{node.func.id}({', '.join(ast.unparse(arg) for arg in node.args[:2])})`"
    return "its own asserts"


def _hidden_tests(source: str) -> str:
    start, end = source.find(HIDDEN[0]), source.find(HIDDEN[1])
    return source[start + len(HIDDEN[0]):end].strip("\n") if 0 <= start < end else ""


def _model_answer(source: str) -> str:
    """A ``<details>`` solution without its wrapper."""
    text = re.sub(r"</?details>|<summary>.*?</summary>", "", source, flags=re.S).strip()
    return "\n".join(f"> {line}".rstrip() for line in text.splitlines())


def _chapter_title(nb, chapter: Path) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.splitlines()[0][2:].strip()
    return chapter.stem


def _exercise(statements: dict[int, str], grade_id: str) -> str:
    """The statement of the exercise a cell ``exK...`` belongs to ("" if none)."""
    number = re.match(r"ex(\d+)", grade_id)
    return statements.get(int(number.group(1)), "") if number else ""


def _chapter_rubric(nb, chapter: Path) -> str:
    statements = _statements(nb)
    graded = _graded_cells(nb)
    parts = [f"\n## {chapter.stem}: {_chapter_title(nb, chapter)}\n\n"]
    if not graded:
        parts.append("No graded work yet.\n")
    else:
        points = sum(nbgrader_of(cell)["points"] for cell in graded)
        exercises = f"{len(graded)} graded exercise" + "s" * (len(graded) != 1)
        parts.append(f"{exercises}, {points:g} points.\n\n"
                     "| Exercise | Points | Graded by |\n|---|---|---|\n")
        for cell in graded:
            meta = nbgrader_of(cell)
            title = _title(_exercise(statements, meta["grade_id"])) or meta["grade_id"]
            parts.append(f"| {title} (`{meta['grade_id']}`) | {meta['points']:g} | "
                         f"{_checker(cell.source)} |\n")
        for cell in graded:
            if hidden := _hidden_tests(cell.source):
                parts.append(f"\nHidden tests of `{nbgrader_of(cell)['grade_id']}`:\n\n"
                             f"```python\n{hidden}\n```\n")
    written = [cell for cell in nb.cells
               if cell.cell_type == "markdown" and nbgrader_of(cell).get("solution")]
    if written:
        parts.append("\n### Written answers\n")
    for cell in written:
        statement = _exercise(statements, nbgrader_of(cell)["grade_id"]).strip()
        parts.append(f"\n{statement or nbgrader_of(cell)['grade_id']}\n\nModel answer:\n\n"
                     f"{_model_answer(cell.source)}\n")
    return "".join(parts)


def rubric(chapter_paths: Iterable[Path]) -> str:
    """RUBRIC.md: per chapter, each graded exercise with its points, its checker and its hidden
    tests, and each written question with its model answer, from the nbgrader metadata."""
    notebooks = {chapter: _read(chapter) for chapter in chapter_paths}
    graded = [cell for nb in notebooks.values() for cell in _graded_cells(nb)]
    total = sum(nbgrader_of(cell)["points"] for cell in graded)
    header = ("# Rubric\n\nGenerated by `python -m gptlab edition instructor` from the nbgrader "
              "metadata of the chapters (docs/COURSE.md). A grading cell earns its points when "
              "its checks pass, hidden tests included: when it raises nothing (what the student's "
              "code warns or prints on stderr does not count against it). Flags "
              "(`grades.csv`, docs/COURSE.md) are for a person to look at. "
              f"In all: {len(graded)} graded exercises, {total:g} points.\n")
    return header + "".join(_chapter_rubric(nb, chapter) for chapter, nb in notebooks.items())


# ---------------------------------------------------------------------------------------------
# Grading.


@dataclass(frozen=True)
class ExerciseGrade:
    """The points one student earned on one graded exercise (an nbgrader grade cell), or on a
    chapter not handed in or not graded (exercise ``not handed in`` / ``not graded``: 0 of the
    chapter's points)."""

    student: str
    chapter: str
    exercise: str
    points: float
    max_points: float


@dataclass
class Grades:
    """One row per student x chapter x graded exercise; ``notes``: what nbgrader reported about
    submissions (edited grading cells, cells interrupted at the time limit); ``failed``:
    submissions nbgrader could not grade, with its reason; ``flags``: (student, chapter) -> what a
    person should look at (docs/COURSE.md, "What is flagged"); ``seconds``: (student, chapter)
    -> how long grading it took."""

    rows: list[ExerciseGrade] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    flags: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)

    def totals(self) -> dict[str, tuple[float, float]]:
        """student -> (points, max_points) over every graded chapter (one not handed in counts
        0 of its points)."""
        result: dict[str, tuple[float, float]] = {}
        for row in self.rows:
            points, max_points = result.get(row.student, (0.0, 0.0))
            result[row.student] = (points + row.points, max_points + row.max_points)
        return result

    def flagged(self, student: str, chapter: str | None = None) -> list[str]:
        """The flags of one submission, or (``chapter`` None) of all of a student's, each
        prefixed by its chapter."""
        if chapter is not None:
            return self.flags.get((student, chapter), [])
        return [f"{c}: {flag}" for (s, c), flags in sorted(self.flags.items()) if s == student
                for flag in flags]

    def write_csv(self, path) -> None:
        """student, chapter, exercise, points, max_points, flags; then a row per student with
        chapter ``all`` and exercise ``total``."""
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["student", "chapter", "exercise", "points", "max_points", "flags"])
            for row in self.rows:
                writer.writerow([row.student, row.chapter, row.exercise, f"{row.points:g}",
                                 f"{row.max_points:g}",
                                 "; ".join(self.flagged(row.student, row.chapter))])
            for student, (points, max_points) in self.totals().items():
                writer.writerow([student, "all", "total", f"{points:g}", f"{max_points:g}",
                                 "; ".join(self.flagged(student))])

    def write_logs(self, folder) -> None:
        """``folder/<student>.log``: per chapter, the points of each exercise, the time taken,
        and what nbgrader noted and gptlab flagged."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for student in self.totals():
            lines = []
            for chapter in dict.fromkeys(r.chapter for r in self.rows if r.student == student):
                rows = [r for r in self.rows if (r.student, r.chapter) == (student, chapter)]
                seconds = self.seconds.get((student, chapter))
                lines.append(f"{chapter}: {sum(r.points for r in rows):g} of "
                             f"{sum(r.max_points for r in rows):g} points"
                             + (f" in {seconds:.1f} s" if seconds is not None else ""))
                lines += [f"  {r.exercise}: {r.points:g} of {r.max_points:g}" for r in rows]
                prefix = f"{student}/{chapter}:"
                lines += [f"  note: {n.removeprefix(prefix).strip()}" for n in self.notes
                          if n.startswith(prefix)]
                lines += [f"  not graded: {n.removeprefix(prefix).strip()}" for n in self.failed
                          if n.startswith(prefix)]
                lines += [f"  flag: {flag}" for flag in self.flagged(student, chapter)]
            (folder / f"{student}.log").write_text("\n".join(lines) + "\n")


def _submissions(folder: Path, known: list[Path], selected: list[Path]) -> list[tuple]:
    """(student, chapter, submitted notebook) for every ``folder/<student>/<chapter>.ipynb``
    whose chapter is ``selected``; a notebook named after none of the ``known`` chapters is an
    error."""
    if not folder.is_dir():
        raise FileNotFoundError(f"submissions folder {folder} does not exist")
    known_stems = [chapter.stem for chapter in known]
    selected = {chapter.stem: chapter for chapter in selected}
    found = []
    for student_dir in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        if not student_dir.is_dir():
            if student_dir.suffix == ".ipynb":
                raise ValueError(f"{student_dir}: put each student's notebooks in "
                                 f"{folder}/<student>/<chapter>.ipynb")
            continue
        if not STUDENT_ID.match(student_dir.name):
            raise ValueError(f"{student_dir}: a student's folder name may hold letters, digits "
                             "and _.@+- only")
        for notebook in sorted(student_dir.glob("*.ipynb")):
            if notebook.stem not in known_stems:
                raise ValueError(f"{notebook} is not a chapter: a submission is named after its "
                                 f"chapter ({', '.join(known_stems)})")
            if notebook.stem in selected:
                found.append((student_dir.name, selected[notebook.stem], notebook))
    return found


# What a grader cannot decide, in a cell the student wrote or changed: pattern -> flag.
SUSPECT = {
    r"\b(setprofile|settrace|getprofile|gettrace)\b|sys\.monitoring": "profile/trace hooks",
    r"\bthreading\b|\bThread\(|concurrent\.futures|\w*PoolExecutor|multiprocessing": "threads",
    r"_execution_engine|run_backward|\bautograd\b|\.backward\(|torch\.func\b|functorch"
    r"|requires_grad": "the autograd engine",
    r"\bexec\(|\beval\(|\bcompile\(|getsource|__code__|FunctionType|\bco_\w+=|__import__"
    r"|sys\.modules": "exec/getsource/__code__",
    r"gptlab\.course\.grading|from gptlab\.course import .*\bgrading\b":
        "imports gptlab.course.grading",
}


def _code_of(source: str):
    """A cell's syntax tree, IPython magics left out (None if it does not parse)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _root_name(node) -> str | None:
    """``np`` for ``np.linalg.norm`` (an attribute chain on a name)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _assigned_modules(trees, modules: set[str]) -> list[str]:
    """``np.linalg.norm`` for every assignment to (or deletion of, or setattr on) an attribute
    of a name bound by an import."""
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" \
                    and node.args:
                targets = [node.args[0]]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets += target.elts
                elif _root_name(target) in modules and (isinstance(node, ast.Call) or not
                                                        isinstance(target, ast.Name)):
                    found.append(ast.unparse(target))
    return found


def _top_level_names(tree) -> set[str]:
    """The names a cell binds at its top level (def, class, assignment, import)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        else:
            names |= {part.id for part in ast.walk(node)
                      if isinstance(part, ast.Name) and isinstance(part.ctx, ast.Store)}
    return names


def _same_code(a: str, b: str) -> bool:
    """Whether two cells hold the same code, comments and layout aside."""
    tree_a, tree_b = _code_of(a), _code_of(b)
    if tree_a is None or tree_b is None:
        return a.strip() == b.strip()
    return ast.dump(tree_a) == ast.dump(tree_b)


def _flags(nb, source_nb, release_nb) -> list[str]:
    """What a person should look at in a submission (docs/COURSE.md, "What is flagged"): the
    suspect code (SUSPECT) in the cells the student wrote or changed, assignments to attributes of
    imported modules (np., torch.), redefinitions of given functions, answers identical to the
    model answer, and a handed-in chapter of the book itself."""
    released = {cell.source for cell in release_nb.cells} | {cell.source for cell in source_nb.cells}
    own = [cell for cell in nb.cells if cell.cell_type == "code"
           and not nbgrader_of(cell).get("locked") and cell.source not in released]
    trees = [tree for tree in map(_code_of, (cell.source for cell in own)) if tree is not None]
    flags = [flag for pattern, flag in SUSPECT.items()
             if any(re.search(pattern, cell.source) for cell in own)]
    modules = {"np", "numpy", "torch"}
    for cell in nb.cells:
        if cell.cell_type == "code" and (tree := _code_of(cell.source)) is not None:
            modules |= {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                        if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    if assigned := _assigned_modules(trees, modules):
        flags.append(f"assigns {', '.join(dict.fromkeys(assigned))}")
    given = set()
    for cell in source_nb.cells:
        if re.fullmatch(r"ex\d+_given(_\d+)?", nbgrader_of(cell).get("grade_id", "")):
            given |= _top_level_names(_code_of(cell.source) or ast.Module([], []))
    redefined = sorted(given & {name for tree in trees for name in _top_level_names(tree)})
    if redefined:
        flags.append(f"redefines the given {', '.join(redefined)}")
    answers = {nbgrader_of(cell)["grade_id"]: cell.source for cell in source_nb.cells
               if nbgrader_of(cell).get("grade_id", "").endswith("_answer")}
    verbatim = [grade_id.removesuffix("_answer") for cell in nb.cells
                if (grade_id := nbgrader_of(cell).get("grade_id", "")) in answers
                and _same_code(cell.source, answers[grade_id])]
    if verbatim:
        flags.append(f"the model answer of {', '.join(verbatim)}, as published")
    if any(HIDDEN[0] in cell.source or SOLUTION[0] in cell.source for cell in nb.cells):
        flags.append("the book's own chapter (it holds the answer or hidden-test markers)")
    return flags


def _put_back(nb, release_nb) -> list[str]:
    """Put back, in place, what nbgrader needs to grade a submission: the nbgrader metadata of
    an exercise cell that lost it (found by its first line), and every grading and given cell
    the submission lacks (after the exercise cell before it). Return what was put back."""
    held = {nbgrader_of(cell).get("grade_id") for cell in nb.cells} - {None}
    metadata, put_back = [], []
    released = [cell for cell in release_nb.cells
                if cell.cell_type == "code" and nbgrader_of(cell).get("grade_id")]
    first_lines = {cell.source.split("\n", 1)[0]: cell for cell in released}
    for cell in nb.cells:
        match = first_lines.get(cell.source.split("\n", 1)[0])
        if cell.cell_type == "code" and not nbgrader_of(cell) and match is not None \
                and nbgrader_of(match)["grade_id"] not in held:
            cell.metadata["nbgrader"] = copy.deepcopy(nbgrader_of(match))
            held.add(nbgrader_of(match)["grade_id"])
            metadata.append(nbgrader_of(match)["grade_id"])
    for k, cell in enumerate(released):
        grade_id = nbgrader_of(cell)["grade_id"]
        if grade_id in held or not nbgrader_of(cell).get("locked"):
            continue
        before = {nbgrader_of(c)["grade_id"] for c in released[:k]}
        at = max((i + 1 for i, c in enumerate(nb.cells)
                  if nbgrader_of(c).get("grade_id") in before), default=0)
        nb.cells.insert(at, copy.deepcopy(cell))
        held.add(grade_id)
        kind = "grading" if nbgrader_of(cell).get("grade") else "given"
        put_back.append(f"{kind} cell {grade_id}")
    if metadata:
        put_back.insert(0, f"the nbgrader metadata of {', '.join(metadata)}")
    return [f"missing, put back: {'; '.join(put_back)}"] if put_back else []


def _feedback(autograded: Path, target: Path) -> None:
    """The executed submission for its student: grading cells without their hidden tests, and
    their errors without the traceback (which quotes the code that failed)."""
    import nbformat

    nb = _read(autograded)
    hidden = re.escape(HIDDEN[0]) + ".*?" + re.escape(HIDDEN[1])
    for cell in _graded_cells(nb):
        cell.source = re.sub(hidden, "# (hidden tests: run when grading)", cell.source, flags=re.S)
        for output in cell.outputs:
            if output.output_type == "error":
                output.traceback = [f"{output.ename}: {output.evalue}"]
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


@dataclass
class _Outcome:
    """What grading one submission gave."""

    rows: list[ExerciseGrade]
    notes: list[str]
    failed: str | None
    seconds: float


def _grade_one(course: _Course, student: str, chapter: Path, notebook: Path,
               autograded) -> _Outcome:
    """nbgrader autograde of one (prepared) submission in ``course``."""
    start = time.perf_counter()
    target = course.path(course.coursedir.submitted_directory, student, chapter.stem)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(notebook, target)
    try:
        notes = course.autograde(chapter.stem, student)
    except CourseError as error:
        return _Outcome([], [], f"{student}/{chapter.stem}: nbgrader: {error}",
                        time.perf_counter() - start)
    if autograded is not None:
        _feedback(course.path(course.coursedir.autograded_directory, student, chapter.stem),
                  Path(autograded) / student / chapter.name)
    return _Outcome(_scores(course, chapter, student), notes, None, time.perf_counter() - start)


_WORKER: dict = {}  # the course directory of a worker process


def _start_worker(template: str, timeout: int) -> None:
    root = Path(template).parent / f"worker-{os.getpid()}"
    shutil.copytree(template, root)
    _WORKER["course"] = _Course(root, timeout)


def _grade_in_worker(student, chapter, notebook, autograded) -> _Outcome:
    return _grade_one(_WORKER["course"], student, chapter, notebook, autograded)


def grade(submissions, source="book", only: Iterable[str] = (), *,
          timeout: int = CELL_TIMEOUT, autograded=None, jobs: int = 1,
          progress: bool = False) -> Grades:
    """Autograde ``submissions/<student>/<chapter>.ipynb`` with nbgrader against the chapters in
    ``source`` (only the chapters ``only``, if given): gptlab puts back grading and given cells a
    submission lacks and flags what a person should look at (:func:`_flags`); nbgrader puts the
    grading cells back as they are in the source, hidden tests included, runs each submission in
    a fresh kernel (``timeout`` seconds per cell) and scores every grading cell. ``jobs``:
    submissions graded at once, each in its own process and course directory; ``progress``: a
    progress bar on stderr. ``autograded``: a folder for the executed submissions to return to
    students (``<student>/<chapter>.ipynb``, hidden tests left out). A chapter that some student
    handed in and another did not counts 0 of its points for the latter."""
    import nbformat
    from tqdm.auto import tqdm

    selected = chapters(source, only)
    work = _submissions(Path(submissions), chapters(source), selected)
    if not work:
        raise ValueError(f"no submissions of {', '.join(c.stem for c in selected)} in "
                         f"{submissions}: expected {submissions}/<student>/<chapter>.ipynb")
    result = Grades()
    graded_chapters = sorted({chapter for _, chapter, _ in work})
    with _course(timeout) as course:
        maximum = {}
        for chapter in graded_chapters:
            source_nb = _read(chapter)
            if not _graded_cells(source_nb):
                raise ValueError(f"{chapter} has no grading cells: nothing to grade")
            maximum[chapter.stem] = sum(nbgrader_of(c)["points"] for c in _graded_cells(source_nb))
            course.add_source(chapter)
            course.generate(chapter.stem)
        prepared = course.root.parent / "prepared"
        tasks = []
        for student, chapter, notebook in work:
            target = prepared / student / chapter.name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                nb = _read(notebook)
            except ValueError:  # nbgrader says why it cannot grade it
                shutil.copyfile(notebook, target)
            else:
                release_nb = _read(course.path(course.coursedir.release_directory, ".",
                                               chapter.stem))
                put_back = _put_back(nb, release_nb)
                flags = put_back + _flags(nb, _read(chapter), release_nb)
                if flags:
                    result.flags[student, chapter.stem] = flags
                nbformat.write(nb, target)
            tasks.append((student, chapter, target, autograded))
        bar = tqdm(total=len(tasks), desc="grading", unit="notebook", disable=not progress)
        if jobs <= 1:
            outcomes = []
            for task in tasks:
                outcomes.append(_grade_one(course, *task))
                bar.update()
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(jobs, multiprocessing.get_context("spawn"),
                                     initializer=_start_worker,
                                     initargs=(str(course.root), timeout)) as pool:
                futures = [pool.submit(_grade_in_worker, *task) for task in tasks]
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
                outcomes = [future.result() for future in futures]
        bar.close()
        handed_in = set()
        for (student, chapter, _, _), outcome in zip(tasks, outcomes):
            result.notes += outcome.notes
            result.seconds[student, chapter.stem] = outcome.seconds
            if outcome.failed:
                result.failed.append(outcome.failed)
                result.rows.append(ExerciseGrade(student, chapter.stem, "not graded", 0.0,
                                                 float(maximum[chapter.stem])))
            result.rows += outcome.rows
            handed_in.add((student, chapter.stem))
        for student in dict.fromkeys(student for student, _, _ in work):
            for chapter in graded_chapters:
                if (student, chapter.stem) not in handed_in:
                    result.rows.append(ExerciseGrade(student, chapter.stem, "not handed in",
                                                     0.0, float(maximum[chapter.stem])))
    return result


def _scores(course: _Course, chapter: Path, student: str) -> list[ExerciseGrade]:
    """The gradebook's score of every grading cell of a graded submission, in chapter order."""
    from nbgrader.api import Gradebook

    order = [nbgrader_of(cell)["grade_id"] for cell in _graded_cells(_read(chapter))]
    with Gradebook(course.coursedir.db_url, COURSE_ID) as gradebook:
        grades = {g.name: g for g in gradebook.find_submission_notebook(
            chapter.stem, chapter.stem, student).grades}
        return [ExerciseGrade(student, chapter.stem, name, float(grades[name].score),
                              float(grades[name].max_score)) for name in order]
