"""The public API that docs/API.md declares (issue 33): the names ``from gptlab import ...``
gives, the module paths that stay, and the old paths that still import, with a warning.

The README, the docs and the chapters import only from the declared API; every module of the
package is declared or named not public; each old module path imports, warns with a
DeprecationWarning that names the new path, and gives the same objects; ``import gptlab`` and
``python -m gptlab --help`` load no torch.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_layout import PACKAGE, imports, module_name, package_modules

import gptlab

ROOT = PACKAGE.parent
API = (ROOT / "docs" / "API.md").read_text(encoding="utf-8")

# every module path that git history shows gone from the package (git log --diff-filter=R -M)
OLD_PATHS = ["gptlab.bpe", "gptlab.tokenizer", "gptlab.tokenizer_base", "gptlab.checkpoint",
             "gptlab.data", "gptlab.metrics", "gptlab.optim", "gptlab.sample", "gptlab.scaling",
             "gptlab.schedule", "gptlab.train", "gptlab.gptq", "gptlab.quant_model",
             "gptlab.distill", "gptlab.rlhf", "gptlab.errata", "gptlab.grading", "gptlab.source",
             "gptlab.parallel", *(f"gptlab.parallel.{name}" for name in
                                  ("base", "checkpoint", "ddp", "demo", "launch", "pipeline",
                                   "tensor", "zero"))]  # fmt: skip


def section(title: str) -> str:
    """The text of API.md under the heading ``## title``, up to the next heading."""
    return API.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def table(title: str) -> dict[str, list[str]]:
    """The table under ``## title``: each row's first cell -> the backticked names of its second
    (a first cell may hold several names: each gets the row)."""
    rows = re.findall(r"^\| (.+?) \| (.+?) \|$", section(title), re.MULTILINE)
    return {key: re.findall(r"`([^`]+)`", cells) for keys, cells in rows
            for key in re.findall(r"`([^`]+)`", keys)}


@functools.cache
def public_modules() -> set[str]:
    """Every module path API.md declares public: the packages and their modules."""
    return {"gptlab", *table("Module paths that stay"),
            *(f"{package}.{name}" for package, names in table("Module paths that stay").items()
              for name in names)}


def not_public() -> set[str]:
    """The modules API.md names in the sentence that starts "Not public:"."""
    sentence = section("Module paths that stay").split("Not public:")[1].split(". ")[0]
    return set(re.findall(r"`([^`]+)`", sentence))


def moved() -> dict[str, list[str]]:
    """Old module path -> its new path(s); a moved package's modules follow it."""
    paths = table("Moved modules")
    for old in OLD_PATHS:
        package, _, name = old.rpartition(".")
        if old not in paths and package in paths:
            paths[old] = [f"{new}.{name}" for new in paths[package]]
    return paths


def test_the_top_level_names_are_the_declared_ones():
    declared = table("`from gptlab import …`")
    assert sorted(declared) == sorted(gptlab.__all__)
    for name, (home,) in declared.items():
        assert getattr(importlib.import_module(home), name) is getattr(gptlab, name)


def test_every_module_is_declared_or_named_not_public():
    on_disk = {module_name(path) for path in package_modules()} | {"gptlab"}
    declared = public_modules() | not_public()
    assert on_disk - declared == set(), "modules docs/API.md does not name"
    assert declared - on_disk == set(), "docs/API.md names modules the package does not have"
    assert not_public() == {"gptlab.cli", "gptlab.__main__"}


def snippets() -> list[tuple[str, str]]:
    """(where, Python source) for the README, docs/*.md, book/*.md (their fenced code blocks and
    inline code) and the chapters (code cells; markdown cells as markdown)."""
    def markdown(where: str, text: str) -> list[tuple[str, str]]:
        blocks = re.findall(r"^\s*(?:```|~~~)[^\n]*\n(.*?)^\s*(?:```|~~~)", text, re.M | re.S)
        inline = re.findall(r"`((?:from|import) gptlab[^`]*)`", text)
        return [(where, block) for block in blocks + inline]

    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "book").glob("*.md"))]:
        found += markdown(path.name, path.read_text(encoding="utf-8"))
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            source, where = "".join(cell["source"]), f"{path.name} cell {i}"
            found += [(where, source)] if cell["cell_type"] == "code" else markdown(where, source)
    return found


def imported(source: str) -> list[tuple[str, list[str]]]:
    """(gptlab module, names) for every import of the package in ``source``; a line magic or shell
    line counts as blank, and a snippet that is no Python (a shell block, prose) is searched for
    import statements."""
    source = re.sub(r"^\s*[%!].*$", "", source, flags=re.M)
    try:
        return [(module, names) for _, module, names in imports(source, "snippet", False)]
    except SyntaxError:
        text = " ".join(source.split())
        return [*((module, []) for module in re.findall(r"\bimport (gptlab[\w.]*)", text)),
                *((module, [name.split()[0] for name in names.split(",") if name.strip()])
                  for module, names in re.findall(r"\bfrom (gptlab[\w.]*) import \(?([\w, ]+)",
                                                  text))]


def public_name(module: str, name: str) -> bool:
    """Whether ``module`` (declared public) offers ``name``: a public module of its own, a name in
    its ``__all__``, or (no ``__all__``) a name without a leading underscore that is no module."""
    if f"{module}.{name}" in public_modules():
        return True
    home = importlib.import_module(module)
    if hasattr(home, "__all__"):
        return name in home.__all__
    if name.startswith("_") or not hasattr(home, name):
        return False
    return not isinstance(getattr(home, name), types.ModuleType)


def test_docs_and_chapters_import_only_the_public_api():
    found = [(where, module, names) for where, source in snippets()
             for module, names in imported(source)]
    assert len(found) > 200  # the parser saw the chapters' imports
    assert [f"{where}: {module}" for where, module, _ in found
            if module not in public_modules()] == []
    assert [f"{where}: {name} from {module}" for where, module, names in found
            for name in names if not public_name(module, name)] == []


def test_a_planted_import_outside_the_api_is_found():
    assert imported("%matplotlib inline\nfrom gptlab.optim import (AdamW,\n    SGD)\n") == [
        ("gptlab.optim", ["AdamW", "SGD"])]
    assert imported("$ python -c 'import gptlab.bpe'\n") == [("gptlab.bpe", [])]
    assert imported("it imports (from gptlab.optim import\n  AdamW, SGD on its line)") == [
        ("gptlab.optim", ["AdamW", "SGD"])]
    assert "gptlab.optim" not in public_modules() and "gptlab.cli" not in public_modules()
    assert not public_name("gptlab.layers.gelu", "math") and public_name("gptlab", "autograd")
    assert not public_name("gptlab.training.data", "np")  # not in its __all__


def test_every_old_path_is_in_the_table_and_the_hook():
    assert sorted(table("Moved modules")) == sorted(f"gptlab.{old}" for old in gptlab._MOVED)
    for old, new in table("Moved modules").items():
        assert new == [f"gptlab.{home}" for home in gptlab._MOVED[old.removeprefix("gptlab.")]]
    assert set(moved()) >= set(OLD_PATHS)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_warns_and_gives_the_same_objects(old):
    new = moved()[old]
    sys.modules.pop(old, None)  # imported by an earlier test: import it afresh
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {' and '.join(new)}")):
        module = importlib.import_module(old)
    homes = [importlib.import_module(path) for path in new]
    if len(homes) == 1:
        assert module is homes[0]
    for home in homes:
        for name in getattr(home, "__all__", [n for n in vars(home) if not n.startswith("_")]):
            assert getattr(module, name) is getattr(home, name), f"{old}.{name}"


def test_an_old_import_statement_warns_at_the_line_that_wrote_it():
    """The warning points at the importing line, not at the import machinery: Python's default
    filters then show it in a script (``__main__``)."""
    sys.modules.pop("gptlab.optim", None)
    with pytest.warns(DeprecationWarning, match="gptlab.training.optim") as record:
        from gptlab.optim import AdamW
    from gptlab.training.optim import AdamW as new

    assert AdamW is new
    assert record[0].filename == __file__
    with pytest.raises(ModuleNotFoundError, match="gptlab.no_such_module"):
        importlib.import_module("gptlab.no_such_module")


@pytest.mark.parametrize("argv", [["-c", "import gptlab, gptlab.bpe"], ["-m", "gptlab", "--help"]],
                         ids=["import", "help"])
def test_import_gptlab_loads_no_torch(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "gptlab" in loaded and not {"torch", "triton"} & loaded


def test_the_old_quant_module_names_resolve_on_the_package_with_a_warning():
    """The old gptlab.quant (now gptlab.quant.rtn) became a package of the same name."""
    from gptlab.quant import rtn

    with pytest.warns(DeprecationWarning, match=r"gptlab\.quant\.rtn\.quantize"):
        from gptlab.quant import quantize
    assert quantize is rtn.quantize
    with pytest.raises(ImportError, match="nothing_here"):
        from gptlab.quant import nothing_here  # noqa: F401
