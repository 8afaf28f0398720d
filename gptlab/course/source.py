"""Show the package's own code in a chapter: the function the prose is about, as it is now.

``show_source(layernorm_forward)`` returns a ``Source`` that Jupyter (JupyterLab, Colab) and the
HTML book render as a syntax-highlighted listing (a Markdown code block) under a caption that
names the file. Because the listing is the cell's output, ``pytest --nbval`` fails when the package
changes and the chapter was not re-executed, so the prose and the code it explains cannot drift
apart.

By default the input checks (``require_*`` calls and ``if ...: raise`` guards) are left out so the
mathematics stands alone; ``checks=True`` shows every line.

Book: every chapter, from chapter 0 on.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds gptlab/


@dataclass(frozen=True)
class Source:
    """A listing: ``code`` (the source text) under a one-line ``caption``."""

    code: str
    caption: str

    def _repr_markdown_(self) -> str:
        longest_backtick_run = max((len(run) for run in re.findall(r"`+", self.code)), default=0)
        fence = "`" * max(3, longest_backtick_run + 1)
        return f"{self.caption}\n\n{fence}python\n{self.code}\n{fence}\n"

    def __repr__(self) -> str:
        return f"{self.caption.replace('`', '')}\n\n{self.code}"


def _resolve(target):
    """An object, or a dotted name "gptlab.module.attribute[.attribute]", -> the object."""
    if not isinstance(target, str):
        return target
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ValueError(f"cannot import {target!r}: expected a dotted name such as "
                     "'gptlab.layers.linear.linear_forward'")


def _raises_input_error(statement: ast.stmt) -> bool:
    """True for ``raise ValueError(...)`` or ``raise TypeError(...)``, what bad input gets."""
    exc = statement.exc if isinstance(statement, ast.Raise) else None
    func = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(func, ast.Name) and func.id in ("ValueError", "TypeError")


def _is_check(statement: ast.stmt) -> bool:
    """True for an input check: ``require_*(...)``, ``if ...: raise ...`` (no else), and a loop
    whose body holds nothing but checks."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        func = statement.value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name.startswith("require_")
    if isinstance(statement, ast.If):
        return not statement.orelse and all(
            _raises_input_error(s) or _is_check(s) for s in statement.body)
    if isinstance(statement, ast.For):
        return not statement.orelse and all(_is_check(s) for s in statement.body)
    return False


def _check_lines(code: str) -> set[int]:
    """The 1-based line numbers of ``code`` that belong to input checks."""
    lines = set()
    for node in ast.walk(ast.parse(code)):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            for statement in block if isinstance(block, list) else []:
                if _is_check(statement):
                    lines.update(range(statement.lineno, statement.end_lineno + 1))
    return lines


def _cut(lines: list[str], start_at: str | None, end_before: str | None, name: str) -> range:
    """The indices from the first line containing ``start_at`` up to the first line after it
    containing ``end_before`` (each optional)."""
    def find(text: str, start: int) -> int:
        for i in range(start, len(lines)):
            if text in lines[i]:
                return i
        raise ValueError(f"no line of {name} contains {text!r}")

    first = find(start_at, 0) if start_at else 0
    return range(first, find(end_before, first + 1) if end_before else len(lines))


# The code formatter's directives: a whole-line "# fmt: off/on", a trailing "# fmt: skip" (the
# reader has no use for them; a "# noqa" stays, it says why a line looks unusual)
FORMATTER_LINE = re.compile(r"\s*# fmt: (off|on)\s*")
FORMATTER_TAIL = re.compile(r"\s*# fmt: skip\s*$")


def show_source(target, *, checks: bool = False, start_at: str | None = None,
                end_before: str | None = None) -> Source:
    """The current source of a function, method or class of the package, for display.

    ``target`` is the object or its dotted name ("gptlab.layers.linear.linear_forward").
    ``checks=False`` leaves out the input checks; ``start_at`` / ``end_before`` cut out a part
    (the first line containing each text)."""
    obj = _resolve(target)
    name = getattr(obj, "__qualname__", None)
    try:
        code = textwrap.dedent(inspect.getsource(obj))
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (TypeError, OSError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from None
    lines = code.splitlines()
    shown = _cut(lines, start_at, end_before, name)
    dropped = set() if checks else {i - 1 for i in _check_lines(code)} & set(shown)
    kept = [lines[i] for i in shown if i not in dropped and not FORMATTER_LINE.fullmatch(lines[i])]
    listing = "\n".join(FORMATTER_TAIL.sub("", line) for line in kept)
    try:
        where = path.relative_to(PACKAGE_ROOT).as_posix()
    except ValueError:
        where = path.name
    caption = f"`{name}` in `{where}`"
    if dropped:
        caption += " (input checks left out)"
    if start_at or end_before:
        caption += " (excerpt)"
    return Source(textwrap.dedent(listing).strip("\n"), caption)
