"""The autograder's speed: 30 submissions of one chapter graded, each in its own sandbox.

    python benchmarks/bench_grading.py [--chapter 08] [--students 30] [--jobs 2] [--note "..."]

The submissions are the chapter's student edition with the model answers written into the
answer cells, as an honest student would hand them in; ``python -m gptlab grade`` grades them
(``--jobs`` at once, each in a bubblewrap sandbox, its grading cells and hidden tests in the
grader). The goal of issue 34: 30 submissions of one chapter in at most 3 minutes on an idle
2-core machine, sandbox included. Reports the wall time of the whole command (the chapter's
preparation included), the seconds per submission, and that every submission got full marks.
Writes ``benchmarks/results/grading.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import nbformat

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.course import autograde, editions

ROOT = Path(__file__).resolve().parent.parent
GOAL_SECONDS = 180


def answered(student_nb, source_nb):
    """The student edition with the model answers written in (the markers left out)."""
    nb = nbformat.from_dict(json.loads(json.dumps(student_nb)))
    answers = {editions.nbgrader_of(c).get("grade_id"): c.source for c in source_nb.cells}
    for cell in nb.cells:
        grade_id = editions.nbgrader_of(cell).get("grade_id", "")
        if grade_id.endswith("_answer") and grade_id in answers:
            cell.source = "\n".join(line for line in answers[grade_id].splitlines()
                                    if "### BEGIN SOLUTION" not in line
                                    and "### END SOLUTION" not in line)
    return nb


def run(args) -> dict:
    machine = machine_info(args.note)
    (chapter,) = editions.chapters(ROOT / "book", [args.chapter])
    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        tmp = Path(tmp)
        edition = editions.student_edition(tmp / "student", ROOT / "book", [chapter.stem])
        nb = answered(nbformat.read(edition.notebooks[0], as_version=4),
                      nbformat.read(chapter, as_version=4))
        for k in range(args.students):
            (tmp / "submitted" / f"student{k:02d}").mkdir(parents=True)
            nbformat.write(nb, tmp / "submitted" / f"student{k:02d}" / chapter.name)
        start = time.perf_counter()
        grades = autograde.grade(tmp / "submitted", ROOT / "book", [chapter.stem],
                                 jobs=args.jobs)
        seconds = time.perf_counter() - start
    totals = grades.totals()
    return {"machine": machine, "chapter": chapter.stem, "students": args.students,
            "jobs": args.jobs, "seconds": round(seconds, 1),
            "per_submission": {"median": round(sorted(grades.seconds.values())[
                len(grades.seconds) // 2], 2), "max": round(max(grades.seconds.values()), 2)},
            "full_marks": sum(points == maximum for points, maximum in totals.values()),
            "not_graded": len(grades.failed), "goal_seconds": GOAL_SECONDS}


def markdown(res: dict) -> str:
    m = res["machine"]
    verdict = "met" if res["seconds"] <= res["goal_seconds"] else "NOT met"
    return (f"# Grading {res['students']} submissions of {res['chapter']}\n\n"
            f"`python benchmarks/bench_grading.py`, {m['date']}: {m['cpu']}, {m['cores']} cores, "
            f"load {m['load_average_1min_at_start']} at start, Python {m['python']}. "
            f"{m['note']}\n\n"
            "| students | jobs | wall time | per submission (median, max) | full marks | "
            "not graded | goal |\n|---|---|---|---|---|---|---|\n"
            f"| {res['students']} | {res['jobs']} | {res['seconds']:.0f} s | "
            f"{res['per_submission']['median']:.1f} s, {res['per_submission']['max']:.1f} s | "
            f"{res['full_marks']} | {res['not_graded']} | {res['goal_seconds']} s: {verdict} |\n\n"
            "Each submission: its notebook in its own bubblewrap sandbox (start, imports, the "
            "cells the answers need), then its grading cells, hidden tests included, in the "
            "grader, calling the student's functions in the sandbox. The wall time includes "
            "the chapter's preparation (nbgrader's student version, the chapter's cells run "
            "once in the grader, a probe of whether its imports need torch, matplotlib's font "
            "cache built once for all the sandboxes).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chapter", default="08")
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--note", default="", help="e.g. that the machine was shared")
    parser.add_argument("--markdown-only", action="store_true", help="reload results/grading.json")
    parser.add_argument("--no-write", action="store_true")
    report("grading", parser.parse_args(), run, markdown)


if __name__ == "__main__":
    main()
