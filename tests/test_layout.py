"""The package's rooms and the arrows between them (docs/CONVENTIONS.md, "Rooms").

The allowed arrows are one table, in docs/CONVENTIONS.md; this test reads it there. Every import
of every module of ``gptlab/`` (parsed with ``ast``, imports inside functions too) must follow
an arrow of the table or stay inside its own room, the table itself must point one way (no
circle), and every room must be in it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gptlab

PACKAGE = Path(gptlab.__file__).parent
CONVENTIONS = PACKAGE.parent / "docs" / "CONVENTIONS.md"


def arrows() -> dict[str, set[str]]:
    """room -> the rooms it may import directly, from the table under "Allowed arrows"."""
    text = CONVENTIONS.read_text(encoding="utf-8").split("### Allowed arrows", 1)[1]
    rows = re.findall(r"^\| ([^|]+?) \|([^|]*)\|$", text, re.MULTILINE)
    table = {room.replace("\\", ""): {r.strip() for r in targets.split(",") if r.strip()}
             for room, targets in rows if room != "room"}
    assert table, "no table under 'Allowed arrows' in docs/CONVENTIONS.md"
    return table


def reachable(table: dict[str, set[str]], room: str) -> set[str]:
    """The rooms ``room`` may import: its row, and what those may import, all the way down."""
    seen, todo = set(), list(table[room])
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            todo.extend(table.get(r, ()))
    return seen


def room_of(module: str) -> str:
    """"gptlab.training.parallel.ddp" -> "training"; "gptlab.model" -> "model"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, gptlab module, the names imported from it) for every import of the package in
    ``source``; the names are [] for ``import gptlab.x``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            if node.module:
                found.append((node.lineno, f"{base}.{node.module}", [a.name for a in node.names]))
            else:  # from .. import backend, gradcheck: each name is a module
                found += [(node.lineno, f"{base}.{a.name}", []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return [(line, m, names) for line, m, names in found
            if m == "gptlab" or m.startswith("gptlab.")]


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, gptlab module) for every import of the package in ``source``."""
    return [(line, m) for line, m, _ in imports(source, module, is_package)]


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per name with a leading underscore that ``module`` imports from another room:
    what a room shares with the others has a public name."""
    here = room_of(module)
    return [f"{module}:{line} imports {name} from {target}"
            for line, target, names in imports(source, module, is_package)
            if room_of(target) != here
            for name in names if name.startswith("_") and not name.startswith("__")]


def wrong_arrows(source: str, module: str, is_package: bool = False) -> list[str]:
    """One line per import in ``source`` that runs up or sideways out of ``module``'s room."""
    table, here = arrows(), room_of(module)
    allowed = reachable(table, here) | {here}
    return [f"{module}:{line} imports {target} ({here} may not import {room_of(target)})"
            for line, target in imported_modules(source, module, is_package)
            if room_of(target) not in allowed]


def package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_room_is_in_the_table():
    rooms = {room_of(module_name(p)) for p in package_modules()}
    assert rooms - set(arrows()) == set()
    assert set(arrows()) - rooms == set(), "the table names a room the package does not have"


def test_the_arrows_point_one_way():
    table = arrows()
    for room in table:
        assert room not in reachable(table, room), f"{room} can reach itself: a circle"
        assert table[room] <= set(table), f"{room} names a room that is not in the table"


def over_the_package(check) -> list[str]:
    """The lines ``check(source, module, is_package)`` gives for every module of the package."""
    return [line for path in package_modules()
            for line in check(path.read_text(encoding="utf-8"), module_name(path),
                              path.name == "__init__.py")]


def test_no_import_runs_back_up():
    assert over_the_package(wrong_arrows) == []


def test_a_planted_upward_import_fails():
    # a layer that imports the training loop, once at the top and once inside a function
    planted = ("from ..backend import array_namespace\n"
               "from ..training.train import train\n"
               "def f():\n    import gptlab.training.optim\n")
    assert wrong_arrows(planted, "gptlab.layers.gelu") == [
        "gptlab.layers.gelu:2 imports gptlab.training.train (layers may not import training)",
        "gptlab.layers.gelu:4 imports gptlab.training.optim (layers may not import training)",
    ]
    # sideways is wrong too: quantization has no arrow to the tokenizers
    assert wrong_arrows("from ..tokenizers import char\n", "gptlab.quant.rtn") == [
        "gptlab.quant.rtn:1 imports gptlab.tokenizers (quant may not import tokenizers)"]
    # down, through any number of arrows, and inside the room, is fine
    assert wrong_arrows("from ...layers.gelu import gelu_forward\nfrom ..optim import AdamW\n"
                        "from . import mode_class\n", "gptlab.training.parallel.demo") == []
    assert wrong_arrows("from .. import backend, gradcheck\n", "gptlab.course.grading") == []


def test_no_private_name_crosses_a_room():
    assert over_the_package(private_imports) == []
    planted = "from ..layers.sdpa import attend, _private\nfrom .launch import _inside\n"
    assert private_imports(planted, "gptlab.kernels.flash_attention") == [
        "gptlab.kernels.flash_attention:1 imports _private from gptlab.layers.sdpa"]


def test_every_room_says_what_it_holds_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"{init.parent.name}/__init__.py: no 'May import' docstring"
