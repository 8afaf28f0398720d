"""The autograder: ``python -m gptlab grade SUBMISSIONS_DIR`` (docs/COURSE.md, "Grading").

No verdict is computed where a student's code runs. Per chapter, the grader runs the chapter's
own cells (everything but the answer cells and the grading cells) once, in its own process:
that is where the grading cells will run, hidden tests and all. The names the answer cells
define are :class:`StudentFunction` objects there. Per submission, the student's notebook runs
in a sandbox (gptlab.course.sandbox, gptlab.course.runner) without its grading cells; then the
grader runs each grading cell in a fresh copy of the chapter's namespace, and a call of a
student's function goes through the narrow channel of gptlab.course.wire: inputs in, numbers and
arrays out, no pickle from the sandbox. A grading cell earns its points when it raises nothing
in the grader. What the student's kernel printed never counts; it is only shown back.
"""

from __future__ import annotations

import ast
import builtins
import csv
import io
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np

from . import integrity, runner, sandbox, wire
from .editions import (CELL_TIMEOUT, CHAPTER_DATA, HIDDEN, CourseError, _course, _graded_cells,
                       _read, chapters, nbgrader_of)
from .grading import guard_spec, open_guards

GIVEN = re.compile(r"ex\d+_given(_\d+)?")
ANSWER = re.compile(r"ex\d+_answer(_\d+)?")

__all__ = ["ExerciseGrade", "Grades", "StudentFunction", "grade"]


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
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["student", "chapter", "exercise", "points", "max_points", "flags"])
            for row in self.rows:
                writer.writerow([row.student, row.chapter, row.exercise, f"{row.points:g}",
                                 f"{row.max_points:g}",
                                 "; ".join(self.flagged(row.student, row.chapter))])
            for student, (points, max_points) in self.totals().items():
                writer.writerow([student, "all", "total", f"{points:g}", f"{max_points:g}",
                                 "; ".join(self.flagged(student))])
        os.replace(partial, path)  # whole or not at all

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


class StudentError(Exception):
    """What a student's function raised in its sandbox (``kind``: the type of its exception)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Submission:
    """One submission's runner in its sandbox, and the channel to it."""

    def __init__(self, home: Path, data: dict, sources: list[str], *, timeout: int, uid: int,
                 limits: sandbox.Limits, hide_torch: bool, unsafe: bool):
        (home / "cells.json").write_text(json.dumps(sources))
        cells = home / "cells.json" if unsafe else f"{sandbox.HOME}/cells.json"
        self.stderr = home.with_suffix(".stderr")
        request_read, self._requests = os.pipe()
        self._answers, answer_write = os.pipe()
        try:
            with open(self.stderr, "wb") as stderr:
                self.process = sandbox.start(
                    home, data, ["-m", "gptlab.course.runner", str(cells), str(timeout),
                                 str(request_read), str(answer_write)],
                    (request_read, answer_write), stderr, limits=limits, hide_torch=hide_torch,
                    uid=uid, unsafe=unsafe)
        except OSError:
            os.close(self._requests)
            os.close(self._answers)
            raise
        finally:
            os.close(request_read)
            os.close(answer_write)
        os.set_blocking(self._requests, False)
        self.deadline = time.monotonic() + limits.wall_seconds
        self.ended: str | None = None

    def end(self, reason: str) -> None:
        """End its processes, all of them; later calls fail with ``reason`` (and the last line
        the sandbox wrote on stderr)."""
        if self.ended is None:
            with open(self.stderr, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 2000))
                said = f.read().decode(errors="replace").strip()
            self.ended = reason + (f" ({said.splitlines()[-1]})" if said else "")
            sandbox.stop(self.process)
            os.close(self._requests)
            os.close(self._answers)

    def _exchange(self, request: bytes | None) -> dict:
        if self.ended is not None:
            raise wire.ChannelError(self.ended)
        try:
            if request is not None:
                wire.write_message(self._requests, request, self.deadline)
            answer = wire.decode(wire.read_message(self._answers, self.deadline))
        except wire.ChannelError as error:
            self.end(str(error))
            raise
        if not isinstance(answer, dict):
            raise wire.ChannelError("a malformed answer from the submission")
        return answer

    def outputs(self) -> list:
        """The outputs of its notebook's cells, once they have run."""
        cells = self._exchange(None).get("cells")
        if not isinstance(cells, list):
            raise wire.ChannelError("a malformed answer from the submission")
        return cells

    def call(self, name: str, args: tuple, kwargs: dict, spec, said: list):
        """``name(*args, **kwargs)`` in the sandbox under the guard ``spec`` (None: no guard, as
        a call outside gptlab.course.grading's checks and guards): its result; what it
        warned or printed on stderr goes to ``said``, what it wrote into ``args``' arrays is
        written into them here too."""
        answer = self._exchange(wire.dump_request(
            {"name": name, "args": args, "kwargs": kwargs, "spec": spec}))
        said.extend(line for line in answer.get("said", []) if isinstance(line, str))
        leaves = list(wire.array_leaves((args, kwargs)))
        for k, new in answer.get("changed", []):
            if type(k) is int and 0 <= k < len(leaves) and isinstance(new, np.ndarray) \
                    and new.shape == leaves[k].shape and leaves[k].flags.writeable:
                np.copyto(leaves[k], new, casting="unsafe")
        if "error" in answer:
            raise StudentError(str(answer["error"])[:100], str(answer.get("message", "")))
        return answer.get("value")


_TRUSTED = threading.Lock()  # one submission's grading cells at a time: they share this process
_CURRENT: list[_Submission] = []  # the submission whose grading cells run now


class StudentFunction:
    """A name of the student's answer cells as the grading cells see it: a call runs the
    student's function in the sandbox of the submission being graded, under the guards open
    here (gptlab.course.grading.guard, check_backward, check_function)."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __repr__(self):
        return f"<the student's {self.__name__}>"

    def __call__(self, *args, **kwargs):
        guards = open_guards()
        return self._call(args, kwargs, None if guards is None else guard_spec(*guards), [])

    def call_guarded(self, args, kwargs, allow, forbid, said):
        return self._call(args, kwargs, guard_spec(allow, forbid), said)

    def _call(self, args, kwargs, spec, said):
        if not _CURRENT:
            raise wire.ChannelError(f"{self.__name__}: no submission is being graded")
        return _CURRENT[0].call(self.__name__, args, kwargs, spec, said)


# ---------------------------------------------------------------------------------------------
# A chapter, as the grader holds it.


def _is_grading(cell) -> bool:
    return cell.cell_type == "code" and bool(nbgrader_of(cell).get("grade")) \
        and not nbgrader_of(cell).get("solution")


def _python(source: str) -> str:
    """A cell's code with its IPython magics and shell lines blanked (the grader runs Python)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


@contextmanager
def _in_grader(folder: Path):
    """What the chapter's cells see in the grader: the chapter's folder as the working directory,
    ``GPTLAB_GRADING=1`` and a matplotlib that draws nowhere."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        with mock.patch.dict(os.environ, {"GPTLAB_GRADING": "1", "MPLBACKEND": "Agg"}):
            yield
    finally:
        os.chdir(here)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")


def _answer_names(source_nb) -> set[str]:
    """The names the answer cells of a chapter define (the student's functions)."""
    return {name for cell in source_nb.cells
            if ANSWER.fullmatch(nbgrader_of(cell).get("grade_id", ""))
            and (tree := integrity.code_of(cell.source)) is not None
            for name in integrity.top_level_names(tree)}


def _chapter_namespace(source_nb, stem: str) -> dict:
    """The chapter's cells but its answer and grading cells, run in the grader: what its grading
    cells see, the answers' names being StudentFunctions. A cell that fails (one that uses an
    answer) is passed over."""
    names = _answer_names(source_nb)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    quiet = io.StringIO()
    for i, cell in enumerate(source_nb.cells):
        if cell.cell_type != "code" or _is_grading(cell) \
                or ANSWER.fullmatch(nbgrader_of(cell).get("grade_id", "")):
            continue
        namespace.update({name: StudentFunction(name) for name in names})
        try:
            with redirect_stdout(quiet), redirect_stderr(quiet):
                exec(compile(_python(cell.source), f"<{stem} cell {i}>", "exec"), namespace)
        except Exception:  # noqa: BLE001 - a chapter's cell may raise anything
            continue
    namespace.update({name: StudentFunction(name) for name in names})
    return namespace


TORCH_PROBE = """import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
print("torch" in sys.modules)"""


def _needs_torch(source_nb) -> bool:
    """Whether the modules the chapter's cells import (its grading cells aside) load torch,
    directly or through gptlab: tried in a fresh interpreter."""
    modules = set()
    for cell in source_nb.cells:
        if cell.cell_type == "code" and not _is_grading(cell) \
                and (tree := integrity.code_of(cell.source)) is not None:
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules.add(node.module)
    done = subprocess.run([sys.executable, "-c", TORCH_PROBE, *sorted(modules)],
                          capture_output=True, text=True, timeout=600)
    return done.stdout.strip().endswith("True")


@dataclass
class _Chapter:
    """A chapter to grade: its source and released versions, the namespace its grading cells
    run in, the data its cells read (name -> folder), whether torch stays importable."""

    path: Path
    source_nb: object
    release_nb: object
    namespace: dict
    data: dict
    needs_torch: bool

    @property
    def maximum(self) -> float:
        return float(sum(nbgrader_of(cell)["points"] for cell in _graded_cells(self.source_nb)))


def _prepare(course, chapter: Path) -> _Chapter:
    source_nb = _read(chapter)
    if not _graded_cells(source_nb):
        raise ValueError(f"{chapter} has no grading cells: nothing to grade")
    course.add_source(chapter)
    release_nb = _read(course.generate(chapter.stem))
    with _in_grader(chapter.parent):
        namespace = _chapter_namespace(source_nb, chapter.stem)
    data = {inside: chapter.parent / origin for origin, inside in CHAPTER_DATA.items()
            if (chapter.parent / origin).is_dir()}
    return _Chapter(chapter, source_nb, release_nb, namespace, data, _needs_torch(source_nb))


# ---------------------------------------------------------------------------------------------
# One submission.


def _sandbox_cells(nb, release_nb) -> list[tuple[int, str]]:
    """(index, source) of the cells that run in the sandbox, the grading cells never: the
    exercise cells (the given ones as released) and every cell the student wrote or changed,
    and the chapter's own cells that define a name one of those uses, directly or not (the
    chapter's explorations and figures are not run again per student)."""
    given = {nbgrader_of(cell)["grade_id"]: cell.source for cell in release_nb.cells
             if GIVEN.fullmatch(nbgrader_of(cell).get("grade_id", ""))}
    released = {cell.source for cell in release_nb.cells}
    cells = {i: given.get(nbgrader_of(cell).get("grade_id"), cell.source)
             for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and not _is_grading(cell)}
    trees = {i: integrity.code_of(source) for i, source in cells.items()}
    kept = {i for i, source in cells.items() if source not in released or trees[i] is None
            or nbgrader_of(nb.cells[i]).get("grade_id")}
    needed: set[str] = set()
    while True:
        needed |= {name for i in kept if trees[i] is not None
                   for name in integrity.used_names(trees[i])}
        more = {i for i in cells.keys() - kept
                if integrity.top_level_names(trees[i]) & needed}
        if not more:
            return [(i, cells[i]) for i in sorted(kept)]
        kept |= more


def _grading_cells(chapter: _Chapter) -> dict[str, tuple[bool, list]]:
    """Run the chapter's grading cells, hidden tests and all, in a copy of its namespace:
    grade_id -> (whether it raised nothing, its outputs)."""
    from nbformat.v4 import new_output

    namespace = dict(chapter.namespace)
    verdicts = {}
    for cell in filter(_is_grading, chapter.source_nb.cells):
        outputs, text = [], io.StringIO()

        def flush():
            if text.getvalue():
                outputs.append(new_output("stream", name="stdout", text=text.getvalue()))
                text.seek(0)
                text.truncate()

        def display(*objects, **_):
            flush()
            for obj in objects:
                data = {"text/plain": str(obj)}
                if hasattr(obj, "_repr_html_"):
                    data["text/html"] = obj._repr_html_()
                outputs.append(new_output("display_data", data=data))

        namespace["display"] = display
        grade_id = nbgrader_of(cell)["grade_id"]
        error = None
        try:
            with redirect_stdout(text), redirect_stderr(text):
                exec(compile(_python(cell.source), f"<grading cell {grade_id}>", "exec"),
                     namespace)
        except Exception as raised:  # noqa: BLE001 - a failed check, or the student's error
            error = raised
        flush()
        if error is not None:
            kind = getattr(error, "kind", type(error).__name__)
            outputs.append(new_output("error", ename=kind, evalue=str(error),
                                      traceback=[f"{kind}: {str(error).splitlines()[0]}"
                                                 if str(error) else kind]))
        verdicts[grade_id] = error is None, outputs
    return verdicts


def _checked_outputs(outputs) -> list:
    """The outputs the sandbox sent for one cell, as nbformat outputs; anything else dropped."""
    from nbformat.v4 import new_output

    kept = []
    for output in outputs if isinstance(outputs, list) else []:
        try:
            kind = output["output_type"]
            if kind == "stream":
                name = "stderr" if output["name"] == "stderr" else "stdout"
                kept.append(new_output("stream", name=name, text=str(output["text"])))
            elif kind in ("display_data", "execute_result"):
                kept.append(new_output("display_data", data={
                    k: str(v) for k, v in output["data"].items() if k in runner.MIME_TYPES}))
            elif kind == "error":
                kept.append(new_output("error", ename=str(output["ename"]),
                                       evalue=str(output["evalue"]), traceback=[]))
        except (KeyError, TypeError, AttributeError):
            continue
    return kept


def _feedback(nb, ran: list[int], outputs: list, chapter: _Chapter, verdicts: dict,
              target: Path) -> None:
    """The submission for its student: the outputs of the cells its sandbox ran, and each
    grading cell as released with the grader's report (the hidden tests are not in it)."""
    import nbformat

    hidden = re.escape(HIDDEN[0]) + ".*?" + re.escape(HIDDEN[1])
    source = {nbgrader_of(cell)["grade_id"]: cell.source for cell in filter(
        _is_grading, chapter.source_nb.cells)}
    for cell in nb.cells:
        if cell.cell_type == "code":  # a cell the sandbox did not run shows nothing
            cell.outputs, cell.execution_count = [], None
    for index, cell_outputs in zip(ran, outputs):
        nb.cells[index].outputs = _checked_outputs(cell_outputs)
    for cell in filter(_is_grading, nb.cells):
        grade_id = nbgrader_of(cell)["grade_id"]
        if grade_id in verdicts:
            cell.source = re.sub(hidden, "# (hidden tests: run when grading)", source[grade_id],
                                 flags=re.S)
            cell.outputs = verdicts[grade_id][1]
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


@dataclass
class _Outcome:
    """What grading one submission gave."""

    rows: list[ExerciseGrade]
    notes: list[str]
    failed: str | None
    seconds: float


@dataclass(frozen=True)
class _Settings:
    timeout: int
    limits: sandbox.Limits
    unsafe: bool
    workspace: Path
    autograded: Path | None


def _grade_one(chapter: _Chapter, student: str, nb, settings: _Settings, uid: int) -> _Outcome:
    """Run one (prepared) submission in its sandbox (as ``uid``), then its chapter's grading
    cells here."""
    start = time.perf_counter()
    stem = chapter.path.stem
    released = {(nbgrader_of(cell).get("grade_id"), cell.source)
                for cell in chapter.release_nb.cells + chapter.source_nb.cells}
    notes = [f"{student}/{stem}: grading cell {nbgrader_of(cell)['grade_id']} has changed: "
             "graded as released" for cell in filter(_is_grading, nb.cells)
             if (nbgrader_of(cell)["grade_id"], cell.source) not in released]
    ran = _sandbox_cells(nb, chapter.release_nb)
    home = Path(tempfile.mkdtemp(prefix="student-", dir=settings.workspace))
    sandbox.copy_warm(settings.workspace / "warm", home)
    try:
        submission = _Submission(home, chapter.data, [source for _, source in ran],
                                 timeout=settings.timeout, uid=uid, limits=settings.limits,
                                 hide_torch=not chapter.needs_torch, unsafe=settings.unsafe)
    except OSError as error:
        return _Outcome([], notes, f"{student}/{stem}: the sandbox did not start: {error}",
                        time.perf_counter() - start)
    try:
        outputs = submission.outputs()
        with _TRUSTED, _in_grader(chapter.path.parent):
            _CURRENT.append(submission)
            try:
                verdicts = _grading_cells(chapter)
            finally:
                _CURRENT.clear()
        failed = submission.ended
    except wire.ChannelError:
        failed = f"its notebook did not run to the end: {submission.ended}"
    finally:
        submission.end("graded")
        shutil.rmtree(home, ignore_errors=True)
    if failed is not None:
        return _Outcome([], notes, f"{student}/{stem}: {failed}", time.perf_counter() - start)
    if settings.autograded is not None:
        _feedback(nb, [i for i, _ in ran], outputs, chapter, verdicts,
                  settings.autograded / student / chapter.path.name)
    rows = [ExerciseGrade(student, stem, grade_id, float(nbgrader_of(cell)["points"]) * passed,
                          float(nbgrader_of(cell)["points"]))
            for cell in filter(_is_grading, chapter.source_nb.cells)
            for grade_id in [nbgrader_of(cell)["grade_id"]]
            for passed in [verdicts[grade_id][0]]]
    return _Outcome(rows, notes, None, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# All of them.


def grade(submissions, source="book", only: Iterable[str] = (), *,
          timeout: int = CELL_TIMEOUT, autograded=None, jobs: int = 1, progress: bool = False,
          limits: sandbox.Limits = sandbox.Limits(), unsafe: bool = False) -> Grades:
    """Grade ``submissions/<student>/<chapter>.ipynb`` against the chapters in ``source`` (only
    the chapters ``only``, if given): each submission runs in its own sandbox (``limits``;
    ``timeout`` seconds per cell), its grading cells, hidden tests included, in this process.
    ``jobs``: submissions graded at once; ``progress``: a progress bar on stderr;
    ``autograded``: a folder for the feedback (``<student>/<chapter>.ipynb``). A chapter that
    some student handed in and another did not counts 0 of its points for the latter.
    ``unsafe``: run the submissions without the sandbox (CourseError if it cannot start and
    this is not given)."""
    from tqdm.auto import tqdm

    selected = chapters(source, only)
    work, left_out = integrity.submissions(Path(submissions), chapters(source), selected)
    if not work:
        raise ValueError("; ".join(left_out) or
                         f"no submissions of {', '.join(c.stem for c in selected)} in "
                         f"{submissions}: expected {submissions}/<student>/<chapter>.ipynb")
    if not unsafe:
        try:
            sandbox.check()
        except sandbox.SandboxError as error:
            raise CourseError(f"{error}; grading for credit needs the sandbox "
                              "(--unsafe-no-sandbox grades without it)") from None
    result = Grades(notes=[f"left out: {line}" for line in left_out])
    with _course() as course:
        prepared = {chapter.stem: _prepare(course, chapter)
                    for chapter in sorted({s.chapter for s in work})}
        settings = _Settings(timeout, limits, unsafe, course.root.parent,
                             Path(autograded) if autograded is not None else None)
        sandbox.warm(settings.workspace / "warm", limits=limits, unsafe=unsafe)
        tasks, own = [], {}
        for submission in work:
            chapter = prepared[submission.chapter.stem]
            key = (submission.student, chapter.path.stem)
            problem, nb = submission.problem, None
            if problem is None:
                try:
                    nb = integrity.read_notebook(submission.path)
                except ValueError as error:
                    problem = str(error)
            if nb is not None:
                found = integrity.put_back(nb, chapter.release_nb) \
                    + integrity.flags(nb, chapter.source_nb, chapter.release_nb)
                result.flags.setdefault(key, []).extend(found)
                own.setdefault(key[1], {})[key[0]] = [
                    cell.source for cell in integrity.own_cells(nb, chapter.source_nb,
                                                                chapter.release_nb)]
            tasks.append((submission.student, chapter, nb, problem))
        for stem, sources in own.items():
            for student, flag in integrity.same_code_flags(sources).items():
                result.flags[student, stem].append(flag)
        for key, flag in integrity.same_file_flags(work).items():
            result.flags.setdefault(key, []).append(flag)
        bar = tqdm(total=len(tasks), desc="grading", unit="notebook", disable=not progress,
                   file=sys.stderr)

        users = queue.SimpleQueue()  # a user per sandbox running at once
        for k in range(max(1, jobs)):
            users.put(sandbox.NOBODY - k)

        def run(task) -> _Outcome:
            student, chapter, nb, problem = task
            uid = users.get()
            try:
                if problem is not None:
                    return _Outcome([], [], f"{student}/{chapter.path.stem}: {problem}", 0.0)
                return _grade_one(chapter, student, nb, settings, uid)
            except Exception as error:  # noqa: BLE001 - one bad submission: its own row only
                return _Outcome([], [], f"{student}/{chapter.path.stem}: the grader could not "
                                f"grade it: {type(error).__name__}: {error}", 0.0)
            finally:
                users.put(uid)
                bar.update()

        with ThreadPoolExecutor(max(1, jobs)) as pool:
            outcomes = list(pool.map(run, tasks))
        bar.close()
    result.flags = {key: flags for key, flags in result.flags.items() if flags}
    handed_in = set()
    for (student, chapter, _, _), outcome in zip(tasks, outcomes):
        stem = chapter.path.stem
        result.notes += outcome.notes
        result.seconds[student, stem] = outcome.seconds
        if outcome.failed:
            result.failed.append(outcome.failed)
            result.rows.append(ExerciseGrade(student, stem, "not graded", 0.0, chapter.maximum))
        result.rows += outcome.rows
        handed_in.add((student, stem))
    for student in dict.fromkeys(student for student, _, _, _ in tasks):
        for chapter in prepared.values():
            if (student, chapter.path.stem) not in handed_in:
                result.rows.append(ExerciseGrade(student, chapter.path.stem, "not handed in",
                                                 0.0, chapter.maximum))
    return result
