"""Memory figures: stacked category bars, memory over one step, estimate vs measured.

All take ``ax=None`` (a new figure is made) and return the Axes; pure matplotlib, no display
needed. Inputs are plain ``{category: bytes}`` dicts, so measured (MemoryTracker) and estimated
(``estimate(...).bytes``) breakdowns plot the same way.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.memory.results import UNITS, MemoryResult, unit_scale  # noqa: F401  (UNITS: the units plots accept)
from fsdp_lab.memory.tags import CATEGORIES

# one fixed colour per category, the same in every figure
COLORS = {
    "params": "#4C72B0", "sharded_params": "#7A9CD0", "unsharded_params": "#2A4A80",
    "grads": "#55A868", "sharded_grads": "#8FCB9B", "unsharded_grads": "#2F7040",
    "optimizer_state": "#C44E52", "activations": "#DD8452", "temporaries": "#CCB974",
    "comm_buffers": "#8172B3", "quantized": "#937860", "other": "#8C8C8C",
}
# Beside a timeline, no category wears a colour the timeline draws (forward blue, all-gathers
# orange, reduce-scatters red, compute grey, ...), so each colour means one thing per figure.
COLORS_BESIDE_TIMELINE = COLORS | {
    "params": "#08519C", "grads": "#006D2C", "activations": "#FF9DA7", "optimizer_state": "#B07AA1", "temporaries": "#EDC948",
    "comm_buffers": "#76B7B2", "quantized": "#D37295", "other": "#BAB0AC",
}


def _values(breakdown) -> dict[str, int]:
    """{category: bytes} of a dict, an estimate's ``Breakdown`` or a tracker's ``MemoryResult`` (its peak)."""
    if isinstance(breakdown, MemoryResult):
        breakdown = breakdown.peak
    values = getattr(breakdown, "bytes", breakdown)
    if not isinstance(values, dict):
        raise TypeError(f"a memory breakdown is {{category: bytes}}, an estimate's Breakdown or a MemoryResult; "
                        f"got {type(breakdown).__name__}")
    unknown = set(values) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown memory categories {sorted(unknown)}; use names from fsdp_lab.memory.CATEGORIES")
    return values


def _used(dicts) -> list[str]:
    return [c for c in CATEGORIES if any(d.get(c, 0) for d in dicts)]


def plot_breakdown(breakdowns, ax=None, *, unit: str = "MiB", title: str | None = None, hatch=None):
    """Stacked bars, one per breakdown: ``breakdowns`` is {label: breakdown} (e.g. per rank or per
    strategy), a list of them (labelled 0, 1, ...) or one alone; a breakdown is {category: bytes},
    an estimate's ``Breakdown`` or a ``MemoryResult`` (its peak). Returns the Axes.

    Raises ValueError for an empty input, an unknown category or unit.
    """
    if not breakdowns:
        raise ValueError("plot_breakdown needs at least one breakdown")
    if isinstance(breakdowns, MemoryResult):  # one rank's result: one bar
        breakdowns = {f"rank {breakdowns.rank}": breakdowns}
    elif hasattr(breakdowns, "bytes") or (isinstance(breakdowns, dict) and set(breakdowns) <= set(CATEGORIES)):
        breakdowns = {"": breakdowns}  # one breakdown (mt.peak(), an estimate): one bar
    if not isinstance(breakdowns, dict):
        breakdowns = {str(i): b for i, b in enumerate(breakdowns)}
    scale = unit_scale(unit)
    values = {label: _values(b) for label, b in breakdowns.items()}
    if ax is None:
        ax = own_axes((max(4, 1.2 * len(values) + 3), 4))
    labels = list(values)
    bottoms = [0.0] * len(labels)
    for cat in _used(values.values()):
        heights = [values[l].get(cat, 0) / scale for l in labels]
        ax.bar(labels, heights, bottom=bottoms, color=COLORS[cat], label=cat, hatch=hatch, edgecolor="white")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title or "memory by category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fitted(ax)


def plot_memory_curve(timeline, ax=None, *, unit: str = "MiB", title: str | None = None, label_every: int = 0,
                      peak=None, peak_label: str | None = None):
    """Stacked area of categories over the phase boundaries of a MemoryTracker timeline
    (``[(label, {category: bytes})]``, e.g. ``mt.timeline()``), or of a ``MemoryResult``
    (``mt.result()``, what ``measure_step`` returns), whose own peak is then marked too.

    Each snapshot holds until the next one; the last is drawn one phase wide, so what the step
    ends with (e.g. gradients freed by ``zero_grad``) shows. ``peak`` (total bytes, or
    {category: bytes} such as ``mt.peak()``) draws the tracker's peak as a dashed line, labelled
    with ``peak_label`` (the phase it came after) when given: the tracker counts every
    allocation, so its peak can fall between two snapshots, above the curve.
    ``label_every`` > 0 writes every n-th phase label on the x axis. Returns the Axes.
    Raises ValueError for an empty timeline, an unknown category or unit.
    """
    if callable(getattr(timeline, "result", None)):  # the tracker itself: what it measured
        timeline = timeline.result()
    if hasattr(timeline, "timeline"):  # a MemoryResult: its peak unless one is given
        if peak is None:
            peak, peak_label = timeline.peak, peak_label or timeline.peak_label
        timeline = timeline.timeline
    if not timeline:
        raise ValueError("plot_memory_curve needs a non-empty timeline [(label, {category: bytes})]")
    scale = unit_scale(unit)
    if ax is None:
        ax = own_axes((9, 4))
    snaps = [_values(s) for _, s in timeline]
    # with step="post" a point holds until the next x: repeat the last one so it has a width too
    xs = list(range(len(snaps) + 1))
    cats = _used(snaps)
    ax.stackplot(xs, *[[s.get(c, 0) / scale for s in snaps + snaps[-1:]] for c in cats],
                 labels=cats, colors=[COLORS[c] for c in cats], step="post")
    ax.set_xlim(0, len(snaps))
    if peak is not None:
        total = sum(_values(peak).values()) if isinstance(peak, dict) else peak
        where = f" after '{peak_label}'" if peak_label else ""
        ax.axhline(total / scale, color="black", lw=1, ls="--",
                   label=f"tracker's peak, {total / scale:.3f} {unit}{where}")
    # shade the backward phase so the shape of a step reads at a glance
    back = [i for i, (label, _) in enumerate(timeline) if label.startswith("backward")]
    if back:
        ax.axvspan(back[0], back[-1], color="black", alpha=0.06, lw=0)
        # below the top, where a peak line may run
        ax.text(back[0], ax.get_ylim()[1] * 0.91, " backward", va="top", fontsize=8)
    if label_every:
        ticks = xs[:-1][::label_every]
        ax.set_xticks(ticks)
        ax.set_xticklabels([timeline[i][0] for i in ticks], rotation=60, ha="right", fontsize=7)
    else:
        ax.set_xlabel("phase boundary (forward/backward per module, optimizer step)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title or "memory over one step")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fitted(ax)


def plot_estimate_vs_measured(estimated, measured, ax=None, *, unit: str = "MiB", title: str | None = None):
    """Per category, side by side: estimated (solid) and measured (hatched) bytes.

    ``estimated``/``measured`` are {category: bytes} (or Breakdown); or dicts {label: ...} of
    them to compare several configurations (one group of two stacked bars per label).
    Returns the Axes. Raises ValueError for an unknown category or unit.
    """
    scale = unit_scale(unit)
    if isinstance(estimated, dict) and estimated and all(not isinstance(v, (int, float)) for v in estimated.values()) \
            and set(estimated) - set(CATEGORIES):
        labels = list(estimated)
    else:
        labels, estimated, measured = [""], {"": estimated}, {"": measured}
    if ax is None:
        ax = own_axes((max(5, 2.0 * len(labels) + 3), 4))
    est = {l: _values(estimated[l]) for l in labels}
    mea = {l: _values(measured[l]) for l in labels}
    cats = _used(list(est.values()) + list(mea.values()))
    width = 0.38
    for offset, source, hatch in ((-width / 2, est, None), (width / 2, mea, "//")):
        bottoms = [0.0] * len(labels)
        for cat in cats:
            heights = [source[l].get(cat, 0) / scale for l in labels]
            ax.bar([i + offset for i in range(len(labels))], heights, width, bottom=bottoms, color=COLORS[cat],
                   hatch=hatch, edgecolor="white", label=cat if hatch is None else None)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{l}\nestimate | measured" if l else "estimate | measured" for l in labels], fontsize=8)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(title or "estimated vs measured")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fitted(ax)


def own_axes(figsize: tuple[float, float]):
    """A new figure's Axes, marked as the plot's own: ``fitted`` fits such a figure around what
    is drawn on it."""
    _, ax = plt.subplots(figsize=figsize)
    ax.figure.fsdp_lab_fits = True
    return ax


def fitted(ax):
    """Fit the figure a plot made itself (``own_axes``) around everything drawn (a legend right
    of the axes, rotated tick labels), so a plain ``savefig`` keeps them whole as Jupyter's inline
    display does; a figure the caller passed an Axes of is left to the caller. Returns ``ax``."""
    if getattr(ax.figure, "fsdp_lab_fits", False):
        ax.figure.tight_layout()
    return ax
