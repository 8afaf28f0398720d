"""Re-execute book chapters in place and store their outputs, as nbval expects them.

    .venv/bin/python tools/execute_notebooks.py book/03_attention_forward.ipynb [...]
    make notebooks                      # every chapter

Each notebook runs in a fresh kernel from its own folder. Afterwards the stream pieces that one
``print`` produced are merged into one output, and nbclient's per-cell execution timestamps are
dropped, so a re-run changes only what the code printed. The notebook is stored in the form
JupyterLab saves it (tools/notebook_form.py), so opening it there marks nothing modified.
Stops at the first notebook with an error or with text on stderr, naming the cell, and at one
that runs past WHOLE_NOTEBOOK_S (a kernel that never answers, at start-up or later).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from notebook_form import in_form  # tools/ is on the path: this file runs as a script


def merge_streams(outputs: list) -> list:
    """Consecutive stream outputs of the same stream (stdout/stderr) as one output."""
    merged = []
    for out in outputs:
        last = merged[-1] if merged else None
        if last is not None and out.output_type == last.output_type == "stream" \
                and out.name == last.name:
            last.text += out.text
        else:
            merged.append(out)
    return merged


WHOLE_NOTEBOOK_S = 1800  # a chapter runs in a couple of minutes; a kernel that hangs ends here


def _out_of_time(signum, frame):
    raise TimeoutError(f"the notebook ran past {WHOLE_NOTEBOOK_S} s (a kernel that never answered?)")


def execute(path: Path) -> float:
    """Run ``path`` in place; returns the seconds it took. Raises on an error, on stderr output,
    and when the whole notebook, kernel start included, takes longer than WHOLE_NOTEBOOK_S."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(WHOLE_NOTEBOOK_S)
    try:  # the client shuts its kernel down when the TimeoutError passes through it
        NotebookClient(nb, timeout=600, startup_timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        cell.outputs = merge_streams(cell.outputs)
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stderr":
                raise RuntimeError(f"{path}: cell {index} wrote to stderr:\n{out.text[:2000]}")
    nbformat.write(in_form(nb), path)
    return seconds


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit("usage: execute_notebooks.py NOTEBOOK.ipynb [...]")
    for name in paths:
        print(f"{name}: executed in {execute(Path(name)):.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
