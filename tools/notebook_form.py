"""Store notebooks in the form JupyterLab 4 saves them, so that opening one marks nothing modified.

    .venv/bin/python tools/notebook_form.py book/*.ipynb           # rewrite in place, no execution
    .venv/bin/python tools/notebook_form.py --check book/*.ipynb   # exit 1, naming those not in form

Opening a chapter in JupyterLab starts its kernel, and JupyterLab then changes the notebook in
memory (so it shows as modified, and closing it asks "save changes?") and saves it as:

- ``metadata.kernelspec``: the kernel's own spec, display name "Python 3 (ipykernel)" (ipykernel's
  default kernel spec, the one ``make lab`` and Colab run);
- ``"collapsed": true`` in the metadata of a cell whose outputs are hidden
  (``jupyter.outputs_hidden``): JupyterLab keeps the two in step;
- numbers as JavaScript writes them: a float with an integral value (``2.0`` in a widget's stored
  state) comes back as the integer ``2``.

Everything else (key order, indent, line splitting, cell ids, nbformat 4.5) is nbformat's, which
both this tool and the Jupyter server write with. ``language_info`` is what the kernel reports;
it matches where the chapters were executed with the same Python.

This tool also folds the graded answers in JupyterLab and Colab, as the HTML book does
(tag ``hide-input``): every answer cell (``### BEGIN SOLUTION``) and grading cell gets
``metadata.jupyter.source_hidden``, and the tag ``exercise-answer`` or ``grading-cell``, by which
_vendor/book.css labels their toggles "Solution" and "Grading cell". tools/execute_notebooks.py applies :func:`in_form` to every
notebook it writes; tests/test_notebook_form.py checks that the chapters are stored this way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
ANSWER_MARK = "### BEGIN SOLUTION"  # nbgrader's marker of a graded answer
GRADING_CELL = "# Grading cell for exercise "  # first line of a grading cell (tools/grading_cells.py)
LARGEST_JS_INTEGER_TEXT = 1e21  # from here on JavaScript writes a number in exponent form


def graded_tag(cell) -> str | None:
    """``exercise-answer`` for a graded answer cell, ``grading-cell`` for its grading cell (code
    cells; tools/grading_cells.py's conventions), None for any other cell."""
    if cell.cell_type != "code":
        return None
    if cell.source.startswith(GRADING_CELL):
        return "grading-cell"
    return "exercise-answer" if ANSWER_MARK in cell.source else None


def is_graded(cell) -> bool:
    return graded_tag(cell) is not None


def _as_javascript_writes(value):
    """``value`` with every integral float made an int, as a round trip through JSON.parse and
    JSON.stringify leaves it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < LARGEST_JS_INTEGER_TEXT:
        return int(value)
    if isinstance(value, dict):
        return {key: _as_javascript_writes(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_javascript_writes(item) for item in value]
    return value


def in_form(nb):
    """The notebook ``nb`` (an nbformat NotebookNode) as JupyterLab saves it, graded answers folded."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    for cell in nb.cells:
        if tag := graded_tag(cell):
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
            cell.metadata["tags"] = sorted(set(cell.metadata.get("tags", [])) | {tag})
        if cell.cell_type == "code" and cell.metadata.get("jupyter", {}).get("outputs_hidden"):
            cell.metadata["collapsed"] = True
    return nbformat.from_dict(_as_javascript_writes(nb))


def form_text(text: str) -> str:
    """The text of a stored notebook, as :func:`in_form` would write it."""
    return nbformat.writes(in_form(nbformat.reads(text, as_version=4))) + "\n"


def main(argv: list[str]) -> int:
    check = argv[:1] == ["--check"]
    paths = [Path(name) for name in argv[1 if check else 0:]]
    if not paths:
        print("usage: notebook_form.py [--check] NOTEBOOK.ipynb [...]", file=sys.stderr)
        return 2
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        print(f"notebook_form.py: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    stale = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        formed = form_text(text)
        if formed != text:
            stale.append(str(path))
            if not check:
                path.write_text(formed, encoding="utf-8")
    if check and stale:
        print(f"not in JupyterLab's form (run tools/notebook_form.py on them): {' '.join(stale)}")
        return 1
    print(f"{len(stale)} of {len(paths)} notebooks {'to rewrite' if check else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
