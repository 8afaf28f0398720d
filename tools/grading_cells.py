"""Write the nbgrader metadata of every chapter's exercise cells from the book's conventions.

    .venv/bin/python tools/grading_cells.py [CHAPTER ...]          # rewrite stale metadata
    .venv/bin/python tools/grading_cells.py --check [CHAPTER ...]  # exit 1, naming problems

The chapters are the instructor source of the course (docs/COURSE.md). Authors write cells by
the conventions below; this tool derives the nbgrader metadata from them, so that it is never
edited by hand and never drifts:

- answer cell: a code cell whose first line is ``# Exercise K: ...`` and which holds the model
  answer between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` -> an nbgrader solution cell
  ``exK_answer`` (the student edition keeps the rest and gets ``raise NotImplementedError()`` in
  place of the answer); tagged ``hide-input``, so the HTML book shows it behind a toggle;
- grading cell: a code cell whose first line is ``# Grading cell for exercise K (P points)``,
  with hidden tests between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` -> a locked
  nbgrader grade cell ``exK`` worth P points (it earns them when it raises nothing); tagged
  ``hide-input`` too: the HTML book shows its report, and its code behind a toggle. It imports
  the checkers it calls (``from gptlab.course.grading import ...``) itself, so no editable cell can
  redefine them;
- code solution: a code cell whose first line is ``# @title Solution to exercise K`` -> a
  solution cell ``exK_solution`` (replaced whole in the student edition);
- given code: a code cell whose first line is ``# Given for exercise K`` (the forward a
  backward exercise differentiates) -> a read-only cell ``exK_given``, put back as released when
  grading, so an edited forward cannot make a wrong backward pass;
- prose solution: a markdown cell that starts with ``<details>`` -> a solution cell
  ``exK_written`` holding the model answer to a written question (the student edition shows
  "YOUR ANSWER HERE"); nbgrader requires it to be a grade cell too, so it is one, graded by
  hand and worth 0 points.

K is the exercise's number; a second cell of the same kind for one exercise gets ``_2``. Any
other cell loses stale nbgrader metadata. ``--check`` also fails when a chapter has no grading
cell, a grading cell has no hidden tests or no answer cell before it, or solution markers sit
outside an answer cell. tests/test_project.py runs the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

from gptlab.course import editions as course

ROOT = Path(__file__).resolve().parent.parent

ANSWER = re.compile(r"# Exercise (\d+)\s*:")
GRADING = re.compile(r"# Grading cell for exercise (\d+) \((\d+) points?\)")
CODE_SOLUTION = re.compile(r"# @title Solution to exercise (\d+)\b")
GIVEN = re.compile(r"# Given for exercise (\d+)\b")
# A grading cell imports its checkers itself: a name defined in an editable cell could be redefined.
CHECKERS = ("cases", "check_backward", "check_function", "guard")
CHECKER_IMPORT = re.compile(r"^from gptlab\.course\.grading import (.+)$", re.M)
STATEMENT = re.compile(r"^\*\*(\d+)\.", re.M)  # an exercise statement: "**3. Title.**"
DOTTED = re.compile(r"^\*\*(Exercise )?\d+\.\d+|^# @title Solution to exercise \d+\.\d", re.M)


def chapters() -> list[Path]:
    """The numbered chapters and the capstone project (gptlab.course.editions's list)."""
    return course.chapters(ROOT / "book")


def _nbgrader(grade_id: str, *, solution: bool, grade: bool, points: int = 0) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": grade and not solution,
            "schema_version": 3, "solution": solution, "task": False}
    if grade:
        meta["points"] = points
    return meta


def _classify(nb) -> list[tuple[int, str, int, int]]:
    """(cell index, kind, exercise number, points) for every exercise cell of the chapter."""
    found, exercise = [], 0
    for index, cell in enumerate(nb.cells):
        first = cell.source.split("\n", 1)[0]
        if cell.cell_type == "markdown":
            if cell.source.lstrip().startswith("<details>"):
                found.append((index, "written", exercise, 0))
            elif statements := STATEMENT.findall(cell.source):
                exercise = int(statements[-1])
        elif match := GRADING.match(first):
            found.append((index, "grade", int(match.group(1)), int(match.group(2))))
        elif match := ANSWER.match(first):
            found.append((index, "answer", int(match.group(1)), 0))
        elif match := CODE_SOLUTION.match(first):
            found.append((index, "solution", int(match.group(1)), 0))
        elif match := GIVEN.match(first):
            found.append((index, "given", int(match.group(1)), 0))
    return found


def expected_metadata(nb) -> dict[int, dict]:
    """cell index -> the nbgrader metadata that cell must carry (cells not listed carry none)."""
    expected, seen = {}, {}
    for index, kind, exercise, points in _classify(nb):
        base = f"ex{exercise}" if kind == "grade" else f"ex{exercise}_{kind}"
        seen[base] = seen.get(base, 0) + 1
        grade_id = base if seen[base] == 1 else f"{base}_{seen[base]}"
        # nbgrader wants a markdown solution cell to be a grade cell too: a written answer,
        # graded by hand, worth 0 points unless an instructor gives it some
        expected[index] = _nbgrader(grade_id, solution=kind not in ("grade", "given"),
                                    grade=kind in ("grade", "written"), points=points)
        if kind == "given":  # read-only: put back as released when grading
            expected[index]["locked"] = True
    return expected


def problems(nb) -> list[str]:
    """What is wrong with a chapter's exercise cells, beyond stale metadata."""
    found = _classify(nb)
    kinds = {(kind, exercise) for _, kind, exercise, _ in found}
    result = []
    if not any(kind == "grade" for _, kind, _, _ in found):
        result.append("no grading cell (every chapter has graded work)")
    for index, kind, exercise, points in found:
        source = nb.cells[index].source
        if kind == "grade":
            if not all(marker in source for marker in course.HIDDEN):
                result.append(f"cell {index}: grading cell for exercise {exercise} has no hidden tests")
            if ("answer", exercise) not in kinds:
                result.append(f"cell {index}: grading cell for exercise {exercise} has no answer cell")
            imported = {name.strip() for line in CHECKER_IMPORT.findall(source)
                        for name in line.split(",")}
            used = {name for name in CHECKERS if re.search(rf"\b{name}\(", source)}
            if used - imported:
                result.append(f"cell {index}: grading cell for exercise {exercise} does not import "
                              f"{', '.join(sorted(used - imported))} from gptlab.course.grading itself")
            if points <= 0:
                result.append(f"cell {index}: grading cell for exercise {exercise} gives no points")
        if kind == "answer" and not all(marker in source for marker in course.SOLUTION):
            result.append(f"cell {index}: answer cell for exercise {exercise} has no solution markers")
    for index, cell in enumerate(nb.cells):
        if DOTTED.search(cell.source.split("\n", 1)[0] if cell.cell_type == "code" else cell.source):
            result.append(f"cell {index}: an exercise numbered like 5.3: number them 1, 2, ...")
    answers = {index for index, kind, _, _ in found if kind == "answer"}
    for index, cell in enumerate(nb.cells):
        if index not in answers and course.SOLUTION[0] in cell.source:
            result.append(f"cell {index}: solution markers outside an answer cell")
    return result


def _input_hidden(meta: dict | None) -> bool:
    """Answer and grading cells show their code behind a toggle in the HTML book."""
    return bool(meta) and (meta["grade_id"].endswith("answer") or (meta["grade"] and not meta["solution"]))


def stale(nb) -> bool:
    expected = expected_metadata(nb)
    for index, cell in enumerate(nb.cells):
        if course.nbgrader_of(cell) != expected.get(index, {}):
            return True
        if _input_hidden(expected.get(index)) and "hide-input" not in cell.metadata.get("tags", []):
            return True
    return False


def write(nb) -> None:
    expected = expected_metadata(nb)
    for index, cell in enumerate(nb.cells):
        if index in expected:
            cell.metadata["nbgrader"] = expected[index]
            if _input_hidden(expected[index]):
                cell.metadata["tags"] = sorted(set(cell.metadata.get("tags", [])) | {"hide-input"})
        else:
            cell.metadata.pop("nbgrader", None)


def main(argv: list[str]) -> int:
    failed = False
    paths = [Path(arg).resolve() for arg in argv if not arg.startswith("--")] or chapters()
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        name = path.relative_to(ROOT)
        if "--check" in argv:
            for problem in problems(nb) + (["stale nbgrader metadata (run tools/grading_cells.py)"]
                                           if stale(nb) else []):
                print(f"{name}: {problem}")
                failed = True
        elif stale(nb):
            write(nb)
            nbformat.write(nb, path)
            print(f"{name}: nbgrader metadata written")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
