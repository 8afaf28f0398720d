"""The loss log of a run (``log.csv`` or ``log.jsonl`` in its directory): one row per evaluation,
written by the loop, read back and plotted. Book: chapter 11.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .checkpoint import naming

LOG_FIELDS = ("step", "lr", "train_loss", "val_loss")


def write_log(path: Path, fmt: str, rows: list[dict], append: bool) -> None:
    """Append ``rows`` to the loss log, or (append=False) rewrite it with exactly ``rows``;
    OSError naming ``path`` when it cannot be written (a full disk)."""
    with naming(path), open(path, "a" if append else "w", newline="", encoding="utf-8") as f:
        if fmt == "csv":
            writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
            if not append:
                writer.writeheader()
            writer.writerows(rows)
        else:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def read_log(path) -> list[dict]:
    """The rows of a loss log written by ``train`` (.csv or .jsonl), numbers as numbers."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".csv":
            return [{"step": int(r["step"]), **{k: float(r[k]) for k in LOG_FIELDS[1:]}}
                    for r in csv.DictReader(f)]
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(source, ax=None):
    """Train and validation loss against step, from a log file or a history list; returns ax."""
    import matplotlib.pyplot as plt

    rows = read_log(source) if isinstance(source, (str, Path)) else source
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["train_loss"] for row in rows], marker=".", label="train")
    ax.plot(steps, [row["val_loss"] for row in rows], marker=".", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.legend()
    return ax


__all__ = ["LOG_FIELDS", "write_log", "read_log", "plot_losses"]
