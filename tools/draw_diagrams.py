"""Draw the book's diagrams as SVG files in book/figures/ (matplotlib patches and arrows only).

    .venv/bin/python tools/draw_diagrams.py

Commit the SVGs with this script. The output is byte-for-byte deterministic (fixed hash salt, no
date), and the text is drawn as paths, so a page shows it without any font. Every figure is 8
inches (768 px) wide, about the book's column (760 px at 1280 px), with text of at least 11
points at that width.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Circle, FancyBboxPatch, Rectangle  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "book" / "figures"
WIDTH = 8.0   # inches
FONT = 12     # points: body text
SMALL = 11.5  # points: shapes on the arrows, notes (11.4 at the 760 px column)

STREAM = "#3b6ea8"   # the residual stream and its gradient
COLORS = {"norm": "#e6def3", "attn": "#fde3c4", "mlp": "#d8ebd2", "embed": "#d7e6f6",
          "loss": "#f6d5d5"}

plt.rcParams.update({"svg.hashsalt": "gptlab", "svg.fonttype": "path", "font.size": FONT,
                     "font.family": "DejaVu Sans", "mathtext.fontset": "dejavusans"})


def canvas(height: float):
    """A blank figure WIDTH x height inches whose data coordinates are inches from bottom left."""
    fig = plt.figure(figsize=(WIDTH, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


def box(ax, x, y, w, h, text, kind, size=FONT):
    """A rounded box centred at (x, y), w x h inches, filled by its kind, with centred text."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                boxstyle="round,pad=0,rounding_size=0.08",
                                facecolor=COLORS[kind], edgecolor="0.25", lw=1.1))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, linespacing=1.3)


def arrow(ax, *points, color="0.2", lw=1.4, label=None, side="right", dashed=False):
    """A polyline through points (x, y) with an arrow head at the last one; label at its middle
    segment's midpoint, to the right (or left, above, below) of it."""
    for start, end in zip(points[:-2], points[1:-1]):
        ax.plot(*zip(start, end), color=color, lw=lw, solid_capstyle="butt",
                linestyle="--" if dashed else "-")
    ax.annotate("", xy=points[-1], xytext=points[-2],
                arrowprops=dict(arrowstyle="-|>", color=color, lw=lw, shrinkA=0, shrinkB=0,
                                mutation_scale=14, linestyle="--" if dashed else "-"))
    if label is not None:
        middle = (len(points) - 1) // 2
        (x0, y0), (x1, y1) = points[middle], points[middle + 1]
        x, y = (x0 + x1) / 2, (y0 + y1) / 2
        offset = {"right": (0.1, 0, "left", "center"), "left": (-0.1, 0, "right", "center"),
                  "above": (0, 0.07, "center", "bottom"), "below": (0, -0.07, "center", "top")}
        dx, dy, ha, va = offset[side]
        ax.text(x + dx, y + dy, label, ha=ha, va=va, fontsize=SMALL, color="0.15")


def along(ax, x, y, text, side="right"):
    """Text written upwards beside a vertical line at x, centred at height y."""
    ax.text(x, y, text, rotation=90, ha="left" if side == "right" else "right", va="center",
            fontsize=SMALL, color="0.15")


def plus(ax, x, y, color=STREAM):
    """The circled plus where two arrows are summed."""
    ax.add_patch(Circle((x, y), 0.14, facecolor="white", edgecolor=color, lw=1.6, zorder=3))
    ax.text(x, y, "+", ha="center", va="center", fontsize=14, color=color, zorder=4,
            fontweight="bold")


def save(fig, name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / name, format="svg", metadata={"Date": None})
    plt.close(fig)


def branch(ax, x_split, x_add, y_stream, x_col, steps, width, return_label):
    """A residual branch drawn as a column of boxes above a horizontal stream: read the stream at
    x_split, go up through steps [(text, kind, shape of the output)], come back down into the
    add at x_add (the last step's shape is return_label)."""
    ys = [1.45 + 0.9 * i for i in range(len(steps))]
    arrow(ax, (x_split, y_stream), (x_split, y_stream + 0.3), (x_col, y_stream + 0.3),
          (x_col, ys[0] - 0.25), color=STREAM)
    for i, (text, kind, shape) in enumerate(steps):
        box(ax, x_col, ys[i], width, 0.5, text, kind)
        if i + 1 < len(steps):
            arrow(ax, (x_col, ys[i] + 0.25), (x_col, ys[i + 1] - 0.25), label=shape)
    top = ys[-1]
    arrow(ax, (x_col + width / 2, top), (x_add, top), (x_add, y_stream + 0.14),
          label=return_label)
    plus(ax, x_add, y_stream)


def gpt_block() -> None:
    """The pre-LN block: the residual stream as a horizontal spine, two branches above it."""
    fig, ax = canvas(5.6)
    y = 0.55
    ax.plot([0.2, 7.8], [y, y], color=STREAM, lw=4, solid_capstyle="butt", zorder=1)
    ax.text(0.2, y - 0.2, "x  (B, T, C)", ha="left", va="top", color=STREAM)
    ax.text(7.8, y - 0.2, "out  (B, T, C)", ha="right", va="top", color=STREAM)
    ax.text(4.0, y - 0.2, "residual stream (B, T, C)", ha="center", va="top", color=STREAM,
            fontsize=SMALL, style="italic")
    branch(ax, 0.55, 3.75, y, 2.0, [
        ("LN$_1$ (ln_1)", "norm", "(B, T, C)"),
        ("c_attn:  x W + b,  W (C, 3C)", "attn", "(B, T, 3C)"),
        ("split into q, k, v, then into heads", "attn", "q, k, v: (B, nh, T, hs)"),
        ("causal attention, each head:\nsoftmax(q k$^T$/$\\sqrt{hs}$ + mask) v", "attn",
         "(B, nh, T, hs)"),
        ("merge heads, c_proj:  W (C, C)", "attn", None)], width=2.8,
        return_label="(B, T, C)")
    branch(ax, 4.65, 7.15, y, 5.75, [
        ("LN$_2$ (ln_2)", "norm", "(B, T, C)"),
        ("c_fc:  W (C, 4C)", "mlp", "(B, T, 4C)"),
        ("GELU", "mlp", "(B, T, 4C)"),
        ("c_proj:  W (4C, C)", "mlp", None)], width=2.0, return_label="(B, T, C)")
    ax.text(2.0, 5.4, "attention branch: positions talk", ha="center", fontsize=SMALL,
            style="italic")
    ax.text(5.75, 4.65, "MLP branch: each position alone", ha="center", fontsize=SMALL,
            style="italic")
    save(fig, "gpt_block.svg")


def residual_stream() -> None:
    """The whole model, bottom to top, with the stream as a vertical spine."""
    fig, ax = canvas(6.1)
    x = 3.2
    ax.plot([x, x], [0.95, 4.55], color=STREAM, lw=4, solid_capstyle="butt", zorder=1)
    box(ax, 1.3, 0.45, 2.3, 0.6, "wte[idx]: token rows\nidx (B, T) → (B, T, C)", "embed")
    box(ax, 5.1, 0.45, 2.3, 0.6, "wpe[0:T]: positions\n(T, C), same for every b", "embed")
    arrow(ax, (2.45, 0.45), (x, 0.45), (x, 0.81), color=STREAM)
    arrow(ax, (3.95, 0.45), (x, 0.45), (x, 0.81), color=STREAM)
    plus(ax, x, 0.95)
    ax.text(x - 0.2, 1.25, "x$_0$ (B, T, C)", ha="right", color=STREAM, fontsize=SMALL)
    for name, y in [("block 1", 1.75), ("block 2", 2.65), ("block L", 3.85)]:
        box(ax, 5.4, y + 0.2, 1.9, 0.55, name, "attn")
        arrow(ax, (x, y), (4.45, y), color=STREAM)
        arrow(ax, (6.35, y + 0.2), (6.7, y + 0.2), (6.7, y + 0.6), (x + 0.14, y + 0.6),
              color=STREAM, label="adds (B, T, C)" if name == "block 1" else None)
        plus(ax, x, y + 0.6)
    ax.text(5.4, 3.55, "⋮", ha="center", va="center", fontsize=16)
    ax.text(x - 0.2, 3.3, "residual\nstream\n(B, T, C)", ha="right", va="center",
            color=STREAM, fontsize=SMALL, style="italic")
    ax.text(1.85, 2.2, "each block reads\nthe stream and adds\nits output to it",
            ha="center", va="center", fontsize=SMALL)
    box(ax, x, 4.85, 2.2, 0.5, "LN$_f$ (ln_f)", "norm")
    arrow(ax, (x, 5.1), (x, 5.45), label="x$_f$ (B, T, C)")
    box(ax, x, 5.7, 3.3, 0.5, "logits = x$_f$ wte$^T$   (B, T, V)", "embed")
    arrow(ax, (x + 1.65, 5.7), (5.75, 5.7))
    box(ax, 6.85, 5.7, 2.2, 0.5, "loss: cross-entropy\nwith targets (B, T)", "loss", size=SMALL)
    arrow(ax, (0.45, 0.75), (0.45, 5.7), (x - 1.65, 5.7), dashed=True, color="0.35")
    along(ax, 0.6, 3.2, "the same wte, transposed (tied)")
    save(fig, "residual_stream.svg")


def backward_graph() -> None:
    """The backward from dloss = 1 down: gradients flow down the stream, each labelled with its
    shape; dwte gets a share from the head and one from the embedding."""
    fig, ax = canvas(8.6)
    x, left = 3.6, 0.9
    box(ax, x, 8.25, 1.8, 0.45, "dloss = 1", "loss")
    arrow(ax, (x, 8.02), (x, 7.72))
    box(ax, x, 7.5, 3.8, 0.45, "cross-entropy backward: (P − Y) / N", "loss")
    arrow(ax, (x, 7.27), (x, 6.97), label="dlogits (B, T, V)")
    box(ax, x, 6.75, 3.8, 0.45, "head backward (logits = x$_f$ wte$^T$)", "embed")
    arrow(ax, (x - 1.9, 6.75), (left, 6.75), (left, 0.89), color="0.2")
    along(ax, left - 0.15, 3.8, "head share of dwte: dlogits$^T$ x$_f$  (V, C)", side="left")
    arrow(ax, (x, 6.52), (x, 6.22), color=STREAM, label="dx$_f$ = dlogits wte  (B, T, C)")
    box(ax, x, 6.0, 3.0, 0.45, "LN$_f$ backward", "norm")
    ax.text(x + 1.6, 6.0, "grads: ln_f (C,)", ha="left", va="center", fontsize=SMALL)
    # block L: dx splits into the skip (down the stream) and the branch, and the two sum
    ax.add_patch(Rectangle((1.6, 2.4), 6.2, 3.2, facecolor="none", edgecolor="0.5",
                           linestyle="--", lw=1))
    ax.text(7.7, 5.45, "block L backward", ha="right", va="center", fontsize=SMALL,
            style="italic")
    top = 5.77
    ax.plot([x, x], [top, 2.3], color=STREAM, lw=4, solid_capstyle="butt", zorder=1)
    ax.text(x - 0.15, 5.5, "dx$_L$ (B, T, C)", ha="right", va="center", color=STREAM,
            fontsize=SMALL)
    for y, text, kind, params in [
            (4.6, "MLP branch backward:\nc_proj, GELU, c_fc, LN$_2$", "mlp",
             "grads: c_fc (C, 4C), c_proj (4C, C)"),
            (3.15, "attention branch backward:\nc_proj, attention, c_attn, LN$_1$", "attn",
             "grads: c_attn (C, 3C), c_proj (C, C)")]:
        arrow(ax, (x, y + 0.6), (5.6, y + 0.6), (5.6, y + 0.4), color=STREAM)
        box(ax, 5.6, y, 3.3, 0.8, f"{text}\n{params}", kind, size=SMALL)
        arrow(ax, (5.6, y - 0.4), (5.6, y - 0.6), (x + 0.14, y - 0.6), color=STREAM,
              label="(B, T, C)", side="above")
        plus(ax, x, y - 0.6)
        ax.text(x - 0.15, y + 0.6, "skip", ha="right", va="center", fontsize=SMALL,
                style="italic", color=STREAM)
    ax.text(x + 0.15, 2.25, "dx$_{L-1}$ (B, T, C)", ha="left", va="center", color=STREAM,
            fontsize=SMALL)
    ax.text(x, 1.98, "⋮  blocks L−1, …, 1 the same", ha="center", va="center")
    arrow(ax, (x, 1.85), (x, 1.55), color=STREAM, label="dx$_0$ (B, T, C)")
    box(ax, x, 1.35, 3.0, 0.45, "embeddings backward", "embed")
    arrow(ax, (x - 1.5, 1.35), (1.9, 1.35), (1.9, 0.75), (left + 0.14, 0.75))
    ax.text(2.0, 0.88, "embedding share (V, C):\nscatter-add into rows idx", ha="left",
            va="center", fontsize=SMALL)
    arrow(ax, (x + 1.5, 1.35), (6.5, 1.35), (6.5, 0.95))
    ax.text(6.5, 0.7, "dwpe[0:T] = Σ$_b$ dx$_0$  (T, C)", ha="center", va="center")
    plus(ax, left, 0.75, color="0.2")
    ax.text(left, 0.4, "dwte (V, C): head share + embedding share (tied weights)",
            ha="left", va="center")
    save(fig, "backward_graph.svg")


def matrix(ax, x, y, rows, cols, cell, highlight_row=None, highlight_col=None, color="#d7e6f6"):
    """A rows x cols grid of cells of `cell` inches, top left at (x, y); one row or column
    shaded darker (a token)."""
    for r in range(rows):
        for c in range(cols):
            token = r == highlight_row or c == highlight_col
            ax.add_patch(Rectangle((x + c * cell, y - (r + 1) * cell), cell, cell,
                                   facecolor="#7fa9d6" if token else color,
                                   edgecolor="white", lw=1))
    ax.add_patch(Rectangle((x, y - rows * cell), cols * cell, rows * cell, facecolor="none",
                           edgecolor="0.25", lw=1.2))


def product(ax, x, y, cell, factors, token):
    """Draw `factors` [(name, rows, cols, shape text, holds tokens)] as `A · B = C`, left to
    right from x, top edges at y. token: ("row" or "col", index) of the shaded token in the
    factors that hold tokens. Returns the x where the product ends."""
    axis, index = token
    for i, (name, rows, cols, shape, holds_tokens) in enumerate(factors):
        matrix(ax, x, y, rows, cols, cell,
               highlight_row=index if holds_tokens and axis == "row" else None,
               highlight_col=index if holds_tokens and axis == "col" else None)
        ax.text(x + cols * cell / 2, y + 0.08, name, ha="center", va="bottom")
        ax.text(x + cols * cell / 2, y - rows * cell - 0.08, shape, ha="center", va="top",
                fontsize=SMALL)
        x += cols * cell
        if i < len(factors) - 1:
            ax.text(x + 0.2, y - 0.35, "·" if i == 0 else "=", ha="center", va="center",
                    fontsize=16)
            x += 0.4
    return x


def row_column() -> None:
    """The column convention of the derivations beside the row convention of the code."""
    fig, ax = canvas(4.1)
    cell, top = 0.18, 2.6
    end = product(ax, 0.25, top, cell, [("A", 3, 4, "h × d", False),
                                        ("X", 4, 6, "d × T", True),
                                        ("Q", 3, 6, "h × T", True)], token=("col", 2))
    x_row = end + 1.1
    end_row = product(ax, x_row, top, cell, [("x", 6, 4, "T × C", True),
                                             ("W", 4, 3, "C × h", False),
                                             ("y", 6, 3, "T × h", True)], token=("row", 2))
    for centre, title, source in [
            ((0.25 + end) / 2, "column convention: derivations",
             "Q = A X: a token is a column\n(the blog post the book follows)"),
            ((x_row + end_row) / 2, "row convention: code",
             "y = x W: a token is a row\n(PyTorch, GPT-2's checkpoints)")]:
        ax.text(centre, 3.85, title, ha="center", va="center", fontweight="bold")
        ax.text(centre, 3.3, source, ha="center", va="center", fontsize=SMALL)
    ax.annotate("", xy=(x_row - 0.15, 2.0), xytext=(end + 0.15, 2.0),
                arrowprops=dict(arrowstyle="<|-|>", color="0.2", lw=1.4, mutation_scale=14))
    ax.text((end + x_row) / 2, 2.15, "transpose", ha="center", va="bottom", fontsize=SMALL)
    ax.text(4.0, 0.75, "x = X$^T$,  W = A$^T$,  y = Q$^T$  (C = d: the same numbers, "
            "one token shaded)", ha="center", va="center")
    ax.text(4.0, 0.3, "In attention the code's W$_q$ = B$^T$ and W$_k$ = A$^T$: query and key "
            "swap roles (chapter 0).", ha="center", va="center", fontsize=SMALL)
    save(fig, "row_column.svg")


if __name__ == "__main__":
    gpt_block()
    residual_stream()
    backward_graph()
    row_column()
