"""What a benchmark ran on, recorded beside its numbers."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import numpy as np


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform.processor() elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine_info(note: str, **versions: str) -> dict:
    """CPU, cores, load, Python and NumPy versions, ``versions`` (library -> version) and ``note``."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        **versions,
        "note": note,
    }


def report(name: str, args, run, markdown) -> None:
    """Run the benchmark (``run(args)`` -> results dict) or, with ``--markdown-only``, reload
    results/<name>.json; print ``markdown(results)`` and, unless ``--no-write``, write
    results/<name>.json and results/<name>.md."""
    results_dir = Path(__file__).resolve().parent / "results"
    json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
    res = json.loads(json_path.read_text()) if args.markdown_only else run(args)
    text = markdown(res)
    print(text)
    if not args.no_write:
        results_dir.mkdir(exist_ok=True)
        if not args.markdown_only:
            json_path.write_text(json.dumps(res, indent=1) + "\n")
        md_path.write_text(text)
