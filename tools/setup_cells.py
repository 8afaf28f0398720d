"""Write the set-up cell (the first cell) of every chapter from `_config.yml`.

    .venv/bin/python tools/setup_cells.py           # rewrite the set-up cells that are stale
    .venv/bin/python tools/setup_cells.py --check   # exit 1, naming them, if any is stale

In a checkout the set-up cell does nothing (gptlab is installed). Outside one (Colab, Binder) it
installs gptlab, with the extras its chapter imports, from `repository.url` in `_config.yml` and
from nowhere else. While that address is empty (no repository is published yet) the cell installs
nothing and says how to install instead. To publish: set `repository.url`, run this tool,
re-execute nothing (the cell prints nothing in a checkout), commit. tests/test_project.py fails
when a set-up cell is stale or when any cell installs from another address.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent

# Extras of pyproject.toml, and the imports that make a chapter need them.
EXTRA_IMPORTS = {
    "notebooks": ("ipywidgets",),
    "hf": ("transformers", "tokenizers"),
}

TEMPLATE = '''\
# Set-up. In a checkout of gptlab (`make lab`) the package is installed and this cell does nothing.
# Elsewhere (Colab, Binder) it installs {requirement} from the book's repository.
import importlib.util, subprocess, sys
GPTLAB_REPOSITORY = {url}  # repository.url in _config.yml (tools/setup_cells.py writes it)
if importlib.util.find_spec("gptlab") is None:
    if not GPTLAB_REPOSITORY:
        raise ModuleNotFoundError(
            "This chapter needs the gptlab package. Clone the gptlab repository and run `make lab`"
            " in it, or install the package into this kernel: "
            "pip install '{requirement} @ git+<the gptlab repository address>'")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    f"{requirement} @ git+{{GPTLAB_REPOSITORY}}"], check=True)'''


def repository_url() -> str:
    """The one address the chapters may install from: `repository.url` of `_config.yml`."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return (config.get("repository") or {}).get("url") or ""


def chapters() -> list[Path]:
    """The numbered chapters, the course guide and the capstone project."""
    return sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb")) + sorted(
        (ROOT / "book").glob("c[ao][pu]*.ipynb"))


def extras(nb) -> list[str]:
    """The extras whose packages a chapter's code cells import."""
    code = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    return [extra for extra, modules in EXTRA_IMPORTS.items()
            if any(re.search(rf"^\s*(import|from)\s+{module}\b", code, re.M) for module in modules)]


def setup_source(nb, url: str) -> str:
    names = extras(nb)
    requirement = f"gptlab[{','.join(names)}]" if names else "gptlab"
    return TEMPLATE.format(url=json.dumps(url), requirement=requirement)


def stale(path: Path, url: str) -> bool:
    nb = nbformat.read(path, as_version=4)
    return nb.cells[0].source != setup_source(nb, url)


def write(path: Path, url: str) -> None:
    nb = nbformat.read(path, as_version=4)
    cell = nb.cells[0]
    cell.source = setup_source(nb, url)
    cell.metadata["tags"] = sorted(set(cell.metadata.get("tags", [])) - {"hide-input"} | {"remove-cell"})
    nbformat.write(nb, path)


def main(argv: list[str]) -> int:
    url = repository_url()
    outdated = [path for path in chapters() if stale(path, url)]
    if "--check" in argv:
        for path in outdated:
            print(f"{path.relative_to(ROOT)}: set-up cell is stale (run tools/setup_cells.py)")
        return 1 if outdated else 0
    for path in outdated:
        write(path, url)
        print(f"{path.relative_to(ROOT)}: set-up cell written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
