"""The course's editions, a thin layer over nbgrader (docs/COURSE.md); grading is in
gptlab.course.autograde.

    python -m gptlab edition student build/student        # solutions and hidden tests removed
    python -m gptlab edition instructor build/instructor  # the chapters as they are + RUBRIC.md

The chapters are the instructor source: tools/grading_cells.py has written the nbgrader metadata
of their exercise cells. Every chapter is an nbgrader assignment of one notebook, both named
after the chapter's file. The student version comes from nbgrader's own converter
(GenerateAssignment) in a temporary nbgrader course directory (source/, release/, a sqlite
gradebook) with its configuration passed explicitly, so no nbgrader or Jupyter configuration of
the user takes part; the directory is removed when the command is done.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
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
CHECKERS = ("check_backward", "check_function")
SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")  # nbgrader's markers of an answer
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
STATEMENT = re.compile(r"^\*\*(\d+)\.\s*(.+?)\*\*", re.M)  # "**3. Title.**" starts an exercise

__all__ = ["CELL_TIMEOUT", "CourseError", "Edition", "chapters", "instructor_edition",
           "nbgrader_of", "rubric", "student_edition", "without_answers"]


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


class _Course:
    """A temporary nbgrader course directory: ``root/source/<chapter>/<chapter>.ipynb`` (with the
    data the chapter reads), ``release/``, ``gradebook.db``."""

    def __init__(self, root: Path):
        from nbgrader.coursedir import CourseDirectory
        from traitlets.config import Config

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.config = Config()
        self.config.CourseDirectory.root = str(root)
        self.config.CourseDirectory.course_id = COURSE_ID
        self.config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
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


def _require_nbgrader() -> None:
    if importlib.util.find_spec("nbgrader") is None:
        raise CourseError("the course commands need nbgrader: pip install nbgrader "
                          "(requirements.txt pins its version)")


@contextmanager
def _course():
    _require_nbgrader()
    with tempfile.TemporaryDirectory(prefix="gptlab-course-") as root:
        yield _Course(Path(root) / "course")  # beside it: the students' folders (grade)


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
