"""The table of round-off bounds: what each comparison of the tests measured against its bound.

Run the tests marked ``roundoff`` with GPTLAB_BOUND_RECORD=FILE once per setting, then

    python tools/bound_table.py default=FILE1 "other CPU, 2 threads"=FILE2 > table.md

Each row is one comparison's label (tests/bounds.py): the derivation of its bound, and per setting
the largest difference seen as a fraction of the bound, with the margin (bound over the largest
difference, over every setting) last. docs/TOLERANCES.md holds the table of the last such run.
"""

from __future__ import annotations

import json
import sys


def worst_fractions(path: str) -> dict:
    """label -> (largest difference / bound, that record) over one record file."""
    worst = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            fraction = row["difference"] / row["bound"]
            if row["label"] not in worst or fraction > worst[row["label"]][0]:
                worst[row["label"]] = (fraction, row)
    return worst


def table(settings: dict) -> str:
    """Markdown: a row per label, a column per setting ({name: record file})."""
    per_setting = {name: worst_fractions(path) for name, path in settings.items()}
    derivations = {}
    for worst in per_setting.values():
        for label, (_, row) in worst.items():
            derivations.setdefault(label, row["derivation"])
    names = list(settings)
    lines = ["| comparison | bound (derivation) | "
             + " | ".join(f"largest / bound, {name}" for name in names) + " | margin |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for label in sorted(derivations):
        fractions = [per_setting[name].get(label, (None,))[0] for name in names]
        seen = [f for f in fractions if f is not None]
        worst = max(seen)
        margin = "exact" if worst == 0 else f"{1 / worst:,.0f}x"
        cells = ["-" if f is None else f"{f:.2g}" for f in fractions]
        derivation = derivations[label].replace("|", "\\|")  # |x| inside a table cell
        lines.append(f"| {label} | {derivation} | " + " | ".join(cells) + f" | {margin} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or any("=" not in arg for arg in argv):
        print(__doc__, file=sys.stderr)
        return 2
    settings = dict(arg.split("=", 1) for arg in argv)
    print(table(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
