"""Pictures of who holds what: each rank's buffer before and after a collective."""

from __future__ import annotations

import matplotlib.pyplot as plt
import torch

_RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _draw_buffers(ax, buffers: list[torch.Tensor], owners: list[list[int | None]], title: str) -> None:
    width = max(len(b) for b in buffers)
    for rank, (buf, owner_row) in enumerate(zip(buffers, owners)):
        for i, value in enumerate(buf.tolist()):
            owner = owner_row[i]
            color = _RANK_COLORS[owner % len(_RANK_COLORS)] if owner is not None else "#BBBBBB"
            ax.add_patch(plt.Rectangle((i, -rank - 0.9), 0.95, 0.8, color=color, alpha=0.85))
            ax.text(i + 0.47, -rank - 0.5, f"{value:g}", ha="center", va="center", fontsize=8, color="white")
    ax.set_xlim(-0.1, width)
    ax.set_ylim(-len(buffers) - 0.1, 0.1)
    ax.set_yticks([-r - 0.5 for r in range(len(buffers))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(buffers))])
    ax.set_xticks([])
    ax.set_title(title, fontsize=10)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def plot_collective(op: str, before: list[torch.Tensor], after: list[torch.Tensor], axes=None):
    """Draw every rank's buffer before and after ``op`` (two panels); returns the two Axes.

    Cells are coloured by the rank whose data they hold: after an all-gather, chunk j is
    rank j's colour; after a reduction every cell mixes all ranks and is grey.
    ``before``/``after``: one 1-D tensor per rank, as returned by ``fsdp_lab.launch``.
    Raises ValueError when the number of ranks differs between the two lists.
    """
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} ranks but after has {len(after)}")
    n = len(before)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 0.6 + 0.55 * n),
                               gridspec_kw={"width_ratios": [max(len(b) for b in before), max(len(a) for a in after)]})
    owners_before = [[r] * len(b) for r, b in enumerate(before)]
    if op == "all_gather":
        chunk = len(before[0])
        owners_after = [[i // chunk for i in range(len(a))] for a in after]
    elif op == "broadcast":
        owners_after = [[0] * len(a) for a in after]
    else:  # reductions: every value is a combination of all ranks
        owners_after = [[None] * len(a) for a in after]
    _draw_buffers(axes[0], before, owners_before, "before")
    _draw_buffers(axes[1], after, owners_after, f"after {op}")
    return axes
