"""Timeline figures: a Gantt chart of compute and comm lanes per rank (pure matplotlib)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from fsdp_lab.viz.memory_plots import fitted, own_axes

# One colour per kind of work, so a reader sees at a glance what overlaps what.
_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "optimizer": "#CCB974",
    "compute": "#8C8C8C",
    "all_gather": "#DD8452",
    "reduce_scatter": "#C44E52",
    "all_reduce": "#8172B3",
    "broadcast": "#937860",
}


# Collectives named otherwise (a library's own flags, e.g. "oom_sync") take these in name order,
# so two of them in one figure never share a colour.
_SPARE_COLORS = ["#DA8BC3", "#64B5CD", "#8DA0CB", "#E5C494", "#A6D854", "#B3B3B3"]


def _legend_name(event) -> str:
    return event.name if event.kind == "comm" else event.args.get("phase", "compute")


def _colors_for(names) -> dict[str, str]:
    """A colour for every name in ``names``: the fixed one where it has one, else a spare."""
    spare = sorted(set(names) - set(_COLORS))
    return {name: _COLORS[name] for name in names if name in _COLORS} | \
        {name: _SPARE_COLORS[i % len(_SPARE_COLORS)] for i, name in enumerate(spare)}


def plot_timeline(timeline, ax=None, *, title: str | None = None, label_bytes: bool = False,
                  legend_outside: bool = False):
    """Draw ``timeline`` as a Gantt chart: one row per (rank, lane), time in ms from the start.

    Returns the matplotlib Axes. Comm events are coloured by collective, compute events by
    phase (forward / backward / other spans); a collective with a name of its own (``oom_sync``)
    gets a colour no other entry of the figure has. ``label_bytes`` writes each collective's size
    (MiB) at its start. ``legend_outside`` puts the legend right of the
    axes, where it cannot cover late events (the optimizer step). Raises ValueError for an
    empty timeline.
    """
    events = timeline.events
    if not events:
        raise ValueError("the timeline has no events: record inside `with Timeline():` first")
    if ax is None:
        ax = own_axes((10, 1.0 + 0.45 * len({(e.rank, e.lane) for e in events})))
    t0 = min(e.t_start for e in events)
    rows = sorted({(e.rank, e.lane) for e in events}, key=lambda r: (r[0], r[1] != "compute", r[1]))
    index = {row: i for i, row in enumerate(rows)}
    names = sorted({_legend_name(e) for e in events})
    colors = _colors_for(names)
    for e in events:
        y = index[(e.rank, e.lane)]
        ax.broken_barh([((e.t_start - t0) * 1e3, max(e.duration * 1e3, 1e-3))], (y - 0.38, 0.76),
                       facecolors=colors[_legend_name(e)], edgecolors="none")
        if label_bytes and e.kind == "comm" and e.bytes:
            ax.text((e.t_start - t0) * 1e3, y, f"{e.bytes / 2**20:.1f} MiB", fontsize=6, va="center")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    if legend_outside:
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    else:
        ax.legend(handles, names, loc="upper right", fontsize=7, ncol=min(4, len(names)))
    if title:
        ax.set_title(title)
    return fitted(ax)


_PHASES = ("forward", "backward", "optimizer", "other_compute", "exposed_comm", "idle")
_PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "optimizer": "#CCB974",
                 "other_compute": "#8C8C8C", "exposed_comm": "#C44E52", "idle": "#EEEEEE"}


def plot_phase_breakdown(runs: dict, ax=None, *, rank: int | None = None, title: str | None = None):
    """Stacked bars of time per phase, one bar per run (e.g. {"FSDP1": tl1, "FSDP2": tl2}).

    ``runs`` maps a label to a Timeline or to its ``phase_summary()``. Bars show the mean
    over ranks (or one ``rank``) in milliseconds. Returns the Axes; raises ValueError for
    no runs.
    """
    if not runs:
        raise ValueError("plot_phase_breakdown needs at least one run")
    if ax is None:
        ax = own_axes((9, 0.9 + 0.6 * len(runs)))
    labels = list(runs)
    for y, label in enumerate(labels):
        summary = runs[label]
        summary = summary.phase_summary() if hasattr(summary, "phase_summary") else summary
        rows = [summary[rank]] if rank is not None else list(summary.values())
        left = 0.0
        for phase in _PHASES:
            ms = 1e3 * sum(r[phase] for r in rows) / len(rows)
            ax.barh(y, ms, left=left, color=_PHASE_COLORS[phase], edgecolor="white",
                    label=phase if y == 0 else None)
            left += ms
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("time per rank (ms)")
    # beside the bars, not over them: the longest bar reaches the right edge
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if title:
        ax.set_title(title)
    return fitted(ax)
