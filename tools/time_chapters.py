"""Execute every chapter once and record its wall time, with the machine it ran on.

    .venv/bin/python tools/time_chapters.py                       # every chapter
    .venv/bin/python tools/time_chapters.py book/03_attention_forward.ipynb [...]

Writes book/chapter_times.json, which the course guide (book/course_guide.ipynb) reads. Each
chapter runs in a fresh kernel with one thread (OMP_NUM_THREADS=1 and MKL_NUM_THREADS=1) from
a temporary copy of book/, next to links to gptlab/ and benchmarks/, so that nothing it writes
(runs/, checkpoints) lands in the repository and the stored notebooks stay as they are. The
machine is recorded as it was: CPU model, cores, and the load average before and after each
chapter, since a loaded machine runs a chapter slower. Timing a subset keeps the other
chapters' entries of an existing file.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from gptlab.course import editions as course

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from machine import cpu_model  # noqa: E402  (benchmarks/machine.py: what a run ran on)

OUT = ROOT / "book" / "chapter_times.json"
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def chapters() -> list[Path]:
    """The numbered chapters and the capstone project (gptlab.course.editions's list)."""
    return course.chapters(ROOT / "book")


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01."""
    return [round(load, 2) for load in os.getloadavg()]


class TimedClient(course.WithoutOutputWidgets, NotebookClient):
    """nbclient without its Output-widget copy, whose stalls would be timed as the chapter's."""


def time_chapter(notebook: Path) -> float:
    """Seconds to execute ``notebook`` in a fresh kernel, from the notebook's own folder; a cell
    that runs longer than the other runners allow (``CELL_TIMEOUT``, nbval's limit) fails it."""
    nb = nbformat.read(notebook, as_version=4)
    client = TimedClient(nb, timeout=course.CELL_TIMEOUT, startup_timeout=120, kernel_name="python3",
                         resources={"metadata": {"path": str(notebook.parent)}})
    start = time.perf_counter()
    client.execute()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    paths = [Path(name).resolve() for name in argv] or chapters()
    os.environ.update(THREADS)  # the kernels inherit them
    record = json.loads(OUT.read_text()) if OUT.is_file() else {"chapters": {}}
    record["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                         "system": f"{platform.system()} {platform.machine()}",
                         "python": platform.python_version(), "threads": 1}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "book", work / "book")
        for shared in ("gptlab", "benchmarks"):
            (work / shared).symlink_to(ROOT / shared)
        for path in paths:
            before = load_average()
            seconds = time_chapter(work / "book" / path.name)
            after = load_average()
            record["chapters"][path.stem] = {"seconds": round(seconds, 1), "load_before": before,
                                             "load_after": after}
            print(f"{path.name}: {seconds:.1f} s (load {before[0]} -> {after[0]})", flush=True)
            record["chapters"] = dict(sorted(record["chapters"].items()))
            OUT.write_text(json.dumps(record, indent=1) + "\n")  # after each: a partial run counts


if __name__ == "__main__":
    main(sys.argv[1:])
