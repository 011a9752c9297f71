"""Checkers for lab 07 (prefetch and overlap).

Both take the learner's function and the lab's ``compare`` table (``fsdp_lab.compare``), whose
timelines and counts were recorded from fsdp_lab's own FSDP1 and FSDP2: that is the reference.

* ``check_backward_order(backward_order, table)``: the order of all-gathers, gradient computations
  and reduce-scatters of the blocks in backward, for each prefetch setting, from the forward order.
  Reference: the events of rank 0 recorded in the runs "fsdp2 block no-prefetch" / "fsdp1 block
  none" (none), "fsdp2 block" / "fsdp1 block pre" (pre) and "fsdp1 block post" (post).
* ``check_collectives_per_step(collectives_per_step, table)``: all-gathers, reduce-scatters and
  their bytes in one step for a wrapping, from the units' parameter bytes. Reference: the counts
  and bytes measured by the runs "fsdp2 block", "fsdp2 two_blocks", "fsdp2 model" and
  "fsdp2 block keep-gathered".
"""

from __future__ import annotations

import statistics

from fsdp_lab.workshop.checking import checker, correct, is_placeholder, mistake, placeholder_left
from fsdp_lab.workshop.repeats import spread

ORDER_RUNS = {"none": ["fsdp2 block no-prefetch", "fsdp1 block none"], "pre": ["fsdp2 block", "fsdp1 block pre"],
              "post": ["fsdp1 block post"]}
COUNT_RUNS = {"fsdp2 block": ("block", True), "fsdp2 two_blocks": ("two_blocks", True),
              "fsdp2 model": ("model", True), "fsdp2 block keep-gathered": ("block", False)}


def forward_order(timeline, rank: int = 0) -> list[str]:
    """The blocks ("layers.N") in the order their forward ran on ``rank``."""
    return [e.name.split()[0] for e in timeline.compute_events(rank)
            if e.args.get("phase") == "forward" and e.name.startswith("layers.")]


def recorded_backward(timeline, rank: int = 0) -> list[tuple[str, str]]:
    """The backward events of the blocks on ``rank``, in start order: ("AG", unit) for an
    all-gather, ("bwd", unit) for its gradient computation, ("RS", unit) for its reduce-scatter.
    A block's backward all-gather can be issued before the first backward compute event (the root's
    backward prefetches it), so the window starts right after the last forward event."""
    events = [e for e in timeline.events if e.rank == rank]
    last_forward = max(i for i, e in enumerate(events) if e.args.get("phase") == "forward")
    out = []
    for e in events[last_forward + 1:]:
        if e.kind == "comm" and str(e.args.get("module", "")).startswith("layers."):
            out.append(({"all_gather": "AG", "reduce_scatter": "RS"}[e.name], e.args["module"]))
        elif e.kind != "comm" and e.args.get("phase") == "backward" and e.name.startswith("layers."):
            out.append(("bwd", e.name.split()[0]))
    return out


def event_sequence(timeline, rank: int = 0, phase: str = "backward") -> str:
    """One rank's collectives and compute events of one phase ("forward" or "backward"), in start
    order, as text: "AG layers.3 -> layers.3 bwd -> RS layers.3 ...". The backward window starts
    one event before the first backward compute event: its first all-gather is issued just before."""
    short = {"all_gather": "AG", "reduce_scatter": "RS"}
    events = [e for e in timeline.events if e.rank == rank]
    first_backward = next(i for i, e in enumerate(events) if e.args.get("phase") == "backward")
    last_forward = max(i for i, e in enumerate(events) if e.args.get("phase") == "forward")
    window = events[first_backward - 1:] if phase == "backward" else events[:last_forward + 1]
    return " -> ".join(f"{short[e.name]} {e.args['module']}" if e.kind == "comm" else e.name.replace("backward", "bwd")
                       for e in window if e.kind == "comm" or e.args.get("phase") == phase)


def print_offload_verdict(repeats, table, names: list[str], whole_model: str) -> None:
    """Print which of the runs ``names`` had the shortest mean step window over ``repeats``
    (``fsdp_lab.workshop.repeats.Repeats``), each run's collectives, gathered MiB and exposed comm
    (ms), and whether the winner is beyond the run-to-run spread, with the reason that fits:
    ``whole_model`` names the run whose single unit is the root."""
    window = {n: statistics.mean(repeats.measured(n, "window")) for n in names}
    window_sd = {n: statistics.stdev(repeats.measured(n, "window")) for n in names}
    exposed = {n: statistics.mean(repeats.measured(n, "exposed_comm")) for n in names}
    count = {n: table.row(n)["all_gathers"] + table.row(n)["reduce_scatters"] for n in names}
    gathered = {n: table.row(n)["gathered_mib"] for n in names}
    fastest = min(window, key=window.get)
    others = [n for n in names if n != fastest]
    print(f"Shortest mean step window in these {len(repeats)} runs: {fastest} ({window[fastest]:.1f} ± "
          f"{window_sd[fastest]:.1f} ms); " + "; ".join(
              f"{n}: {count[n]} collectives, {gathered[n]:.3f} MiB gathered, {exposed[n]:.1f} ms of comm not hidden"
              for n in names) + ".")
    if not all(repeats.apart(fastest, n, "window") for n in others):
        print(f"{fastest}'s window is not shorter than every other wrapping's by more than one standard deviation "
              "of each: in this run the spread is as large as some of the differences, so no wrapping is a clear "
              "winner.")
    elif fastest == whole_model:
        print(f"The whole-model unit was faster beyond the spread. It issues fewer collectives ({count[fastest]} "
              f"against {min(count[n] for n in others)} or more) and gathers fewer bytes ({gathered[fastest]:.3f} "
              f"MiB against {min(gathered[n] for n in others):.3f} MiB: as the root it is not resharded after "
              "forward, so backward gathers nothing again); both beat the overlap per-block units could get "
              "here, where the host-to-device copies they could hide cost almost nothing.")
    else:
        print(f"{fastest} was faster beyond the spread: splitting the model let enough communication hide "
              "under compute to pay for its extra collectives and for gathering its units again in backward, "
              "which the whole-model unit (the root, kept gathered) skips.")


OPTIMIZERS = ("for_loop", "foreach", "fused")


# what a repeat of the same configuration must reproduce exactly (times may differ)
REPEATED_EXACTLY = ("all_gathers", "reduce_scatters", "gathered_bytes", "reduced_bytes", "loss")


def print_prefetch_peaks(table, names: list[str], root_bytes: int, block_bytes: int) -> None:
    """For each run of ``table`` (a ``compare`` table) in ``names``: its peak gathered parameters
    (MiB, and as the root plus a number of blocks of ``block_bytes``), peak comm buffers and peak
    total (MiB); then what FSDP2's prefetch adds against none, to each of the last two."""
    block_mib, root_mib = block_bytes / 2**20, root_bytes / 2**20
    print(f"{'run':28} {'peak unsharded MiB':>19} {'= root + blocks':>16} {'peak comm buffers MiB':>22} "
          f"{'peak total MiB':>15}")
    for name in names:
        row = table.row(name)
        mib = row["peak_unsharded_mib"]
        print(f"{name:28} {mib:19.3f} {(mib - root_mib) / block_mib:16.1f} {row['peak_comm_mib']:22.3f} "
              f"{row['peak_total_mib']:15.3f}")
    with_prefetch, without = table.row("fsdp2 block"), table.row("fsdp2 block no-prefetch")
    print(f"fsdp2's prefetch against none: comm-buffer maximum "
          f"{(with_prefetch['peak_comm_mib'] - without['peak_comm_mib']) / block_mib:+.1f} block(s), "
          f"peak total {with_prefetch['peak_total_mib'] - without['peak_total_mib']:+.3f} MiB")


def repeats_agree(repeats, table, names: list[str]) -> bool:
    """True when every run in ``repeats`` has, for each configuration in ``names``, the same
    ``REPEATED_EXACTLY`` fields (counts, bytes, loss) as ``table``."""
    return all(run.row(n)[k] == table.row(n)[k] for run in repeats for n in names for k in REPEATED_EXACTLY)


def _by_implementation(names: list[str]) -> list[tuple[str, list[str]]]:
    """The optimizer runs grouped per implementation: the first three ``names`` are FSDP2's, the
    rest FSDP1's, each in the order of ``OPTIMIZERS``."""
    return [("fsdp2", names[:len(OPTIMIZERS)]), ("fsdp1", names[len(OPTIMIZERS):])]


def draw_two_runs(table, run_a: str, run_b: str):
    """(Figure, text) of section 11's explorer: the timelines of two runs of the ``compare``
    ``table``, one above the other on one time scale (ms), their phase breakdown, and the phase
    table (ms per rank). Raises KeyError for a run the table lacks."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz import plot_phase_breakdown, plot_timeline

    fig, axes = plt.subplots(3, 1, figsize=(12.5, 8.5), gridspec_kw={"height_ratios": [2, 2, 1]})
    for ax, name in zip(axes, [run_a, run_b]):
        plot_timeline(table.timelines[name], ax=ax, title=f"{name} (overlap {table.row(name)['overlap']:.2f})",
                      legend_outside=True)
    right = max(ax.get_xlim()[1] for ax in axes[:2])  # one time scale: the shorter run looks shorter
    for ax in axes[:2]:
        ax.set_xlim(0, right)
    plot_phase_breakdown({run_a: table.timelines[run_a], run_b: table.timelines[run_b]}, ax=axes[2])
    fig.tight_layout()
    return fig, table.phase_table([run_a, run_b])


def print_optimizer_times(repeats, names: list[str], labels: dict[str, str]) -> None:
    """Print each run's optimizer-step time (ms, mean ± sd over ``repeats``) and, per
    implementation (the first three ``names`` FSDP2, the rest FSDP1: for_loop, foreach, fused),
    the three from fastest to slowest by mean and the for_loop / fused ratio. ``labels`` renames
    runs for display."""
    print(f"{'run':22} {'optimizer ms (mean ± sd of ' + str(len(repeats)) + ' runs)':>36}")
    for n in names:
        print(f"{labels.get(n, n):22} {spread(repeats.measured(n, 'optimizer')):>36}")
    for impl, group in _by_implementation(names):
        mean_ms = {kind: statistics.mean(repeats.measured(n, "optimizer")) for kind, n in zip(OPTIMIZERS, group)}
        order = sorted(mean_ms, key=mean_ms.get)
        print(f"{impl}: fastest to slowest in this run: {' < '.join(order)} "
              f"(for_loop / fused = {mean_ms['for_loop'] / mean_ms['fused']:.1f}x)")


def print_optimizer_peaks(repeats, names: list[str], labels: dict[str, str]) -> None:
    """Print each run's peak total (MiB) of the tracked second step in every repeat and the phase
    it falls after, whether the peaks repeat exactly, and per implementation (the first three
    ``names`` FSDP2, the rest FSDP1: for_loop, foreach, fused) whether each peak falls inside
    ``optimizer.step()``. ``labels`` renames runs for display."""
    first = repeats[0]
    print(f"{'run':22} {'peak total MiB, second step, each repeat':>41}   peak after (first repeat)")
    peaks = {n: [run.row(n)["peak_total_mib"] for run in repeats] for n in names}
    for n in names:
        print(f"{labels.get(n, n):22} {', '.join(f'{v:.2f}' for v in peaks[n]):>41}   {first.row(n)['peak_phase']}")
    print("every run's peak the same in all repeats:", all(len(set(v)) == 1 for v in peaks.values()))
    for impl, group in _by_implementation(names):
        print(f"{impl}: for_loop / foreach / fused peaks (first repeat): "
              + " / ".join(f"{peaks[n][0]:.2f}" for n in group) + " MiB; peak inside optimizer.step(): "
              + " / ".join(str(first.row(n)["peak_phase"] == "optimizer step start") for n in group))


def _show(events) -> str:
    return " -> ".join(f"{kind} {unit}" for kind, unit in events)


@checker("backward_order", hint="walk the blocks in reverse forward order; the all-gather of the last "
                                "block in forward (forward[-1]) comes first; 'pre' issues the next block's all-gather before this block's "
                                "bwd, 'post' right after it, 'none' only after this block's RS")
def check_backward_order(backward_order, table):
    """Compare ``backward_order(forward, prefetch)`` for prefetch "none", "pre" and "post" with the
    backward events recorded by fsdp_lab's FSDP1 and FSDP2 in ``table``."""
    forward = forward_order(table.timelines["fsdp2 block"])
    answers = {mode: backward_order(list(forward), mode) for mode in ORDER_RUNS}
    if any(is_placeholder(a) for a in answers.values()):
        return placeholder_left("backward_order")
    # every run of a setting (FSDP1's and FSDP2's) is a reference; the messages show the first
    every_recorded = {mode: [recorded_backward(table.timelines[name]) for name in names]
                      for mode, names in ORDER_RUNS.items()}
    recorded = {mode: runs[0] for mode, runs in every_recorded.items()}
    if not all(isinstance(a, (list, tuple)) for a in answers.values()):
        return mistake("not_a_list", "return a list of (kind, unit) pairs such as ('AG', 'layers.3')")
    if not all(isinstance(e, (list, tuple)) and len(e) == 2 for a in answers.values() for e in a):
        bad = next(e for a in answers.values() for e in a if not (isinstance(e, (list, tuple)) and len(e) == 2))
        return mistake("not_pairs", f"each event must be a (kind, unit) pair such as ('AG', 'layers.3'); "
                                    f"you gave {bad!r}")
    answers = {mode: [tuple(e) for e in a] for mode, a in answers.items()}
    if all(all(a == run for run in every_recorded[m]) for m, a in answers.items()):
        return correct(f"your order is the one fsdp_lab's FSDP recorded for all three settings; with 'pre' "
                       f"(FSDP1 BACKWARD_PRE, FSDP2's default) {_show(recorded['pre'][:3])}: two blocks are "
                       "gathered at once, which is the extra unit in the peak")
    first = answers["none"][:1]
    if first and first[0][1] == forward[0]:
        return mistake("forward_order", f"your backward starts with {forward[0]}: backward runs the blocks in "
                                        f"reverse, starting with {forward[-1]}", hint="iterate over forward[::-1]")
    if answers["pre"] == recorded["post"] and answers["post"] == recorded["pre"]:
        return mistake("pre_post_swapped", "your 'pre' is what FSDP records for BACKWARD_POST and vice versa",
                       hint="'pre' = before the current block's gradient computation")
    for mode in ORDER_RUNS:
        if answers[mode] != recorded[mode]:
            if mode == "post" and answers["post"] == recorded["none"]:
                return mistake("post_after_reduce_scatter",
                               "your 'post' issues the next block's all-gather after this block's reduce-scatter, "
                               f"which is the order of 'none' ({_show(recorded['none'][:4])} ...). 'post' is FSDP1's "
                               "BACKWARD_POST prefetch: in this block's post-backward, as soon as its gradients are "
                               "computed (right after its bwd), FSDP frees it and issues the next block's all-gather, "
                               f"then queues this block's reduce-scatter: {_show(recorded['post'][:4])} ...",
                               hint="with 'post', append the next block's ('AG', b) between this block's 'bwd' and "
                                    "its 'RS'")
            return mistake(f"wrong_{mode}", f"with prefetch '{mode}' you gave\n    {_show(answers[mode])}\n  "
                                            f"fsdp_lab's FSDP recorded\n    {_show(recorded[mode])}")
    return mistake("wrong_order", "the order differs from the recorded one")


def unit_bytes(model, wrapping: str) -> tuple[int, list[int]]:
    """(root bytes, [bytes of each non-root unit]) of a Llama wrapped per ``wrapping`` ("block",
    "two_blocks", "model"), float32 parameters, as ``fsdp_lab.compare`` wraps it."""
    def nbytes(modules):
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    blocks = list(model.layers)
    root = nbytes([model.tok_embeddings, model.norm, model.output])
    if wrapping == "model":
        return root + nbytes(blocks), []
    size = 2 if wrapping == "two_blocks" else 1
    return root, [nbytes(blocks[i:i + size]) for i in range(0, len(blocks), size)]


@checker("collectives_per_step", hint="the root is gathered once (kept for backward); every other unit "
                                      "twice when it reshards after forward (once otherwise); every unit "
                                      "reduce-scatters once; bytes follow the counts")
def check_collectives_per_step(collectives_per_step, table):
    """Compare ``collectives_per_step(root_bytes, unit_bytes, reshard_after_forward)`` with the counts
    and bytes fsdp_lab's FSDP2 recorded in ``table`` for four wrappings."""
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0)
    keys = ("all_gathers", "reduce_scatters", "gathered_bytes", "reduced_bytes")
    counts, sizes = keys[:2], keys[2:]
    lines = []
    for name, (wrapping, reshard) in COUNT_RUNS.items():
        root, units = unit_bytes(model, wrapping)
        answer = collectives_per_step(root, units, reshard)
        if is_placeholder(answer):
            return placeholder_left("collectives_per_step")
        if not isinstance(answer, dict) or set(keys) - set(answer):
            return mistake("not_a_dict", f"return a dict with the keys {', '.join(keys)}")
        measured = {k: table.row(name)[k] for k in keys}
        got = {k: answer[k] for k in keys}
        if got != measured:
            n = len(units)
            if got["all_gathers"] == 1 + n and reshard and n:
                return mistake("no_regather", f"{name}: you counted {got['all_gathers']} all-gathers, FSDP "
                                              f"recorded {measured['all_gathers']}: a unit that reshards after "
                                              "forward is gathered again for backward")
            if got["all_gathers"] == 2 + 2 * n and reshard:
                return mistake("root_regathered", f"{name}: you gather the root twice; the root is not resharded "
                                                  "after forward (backward needs it at once)")
            if not reshard and got["all_gathers"] == 1 + 2 * n:
                return mistake("reshard_ignored", f"{name}: with reshard_after_forward=False nothing is gathered "
                                                  "again for backward")
            world = len(table.timelines[name].ranks())
            if all(got[k] == measured[k] for k in counts) and all(got[k] * world == measured[k] for k in sizes):
                return mistake("bytes_per_rank", f"{name}: your counts are right, but every byte count is 1/{world} "
                                                 f"of the recorded ({got['gathered_bytes']:,} B gathered, FSDP "
                                                 f"recorded {measured['gathered_bytes']:,} B): an all-gather's bytes "
                                                 "count its whole output, the unit's full parameter bytes (as "
                                                 "nccl-tests counts the gathered size), and a reduce-scatter's its "
                                                 f"whole input, the unit's full gradient bytes, not one rank's "
                                                 f"1/{world} shard",
                               hint="gathered_bytes: the parameter bytes of every unit gathered, each time it is "
                                    "gathered; reduced_bytes: root_bytes + sum(unit_bytes), with no division by the world size")
            if (got["all_gathers"], got["gathered_bytes"]) == (measured["all_gathers"], measured["gathered_bytes"]) \
                    and got["reduce_scatters"] == measured["reduce_scatters"] - 1 \
                    and got["reduced_bytes"] == measured["reduced_bytes"] - root:
                return mistake("no_root_reduce_scatter", f"{name}: you counted {got['reduce_scatters']} "
                                                         f"reduce-scatters and {got['reduced_bytes']:,} B, FSDP "
                                                         f"recorded {measured['reduce_scatters']} and "
                                                         f"{measured['reduced_bytes']:,} B: the root's reduce-scatter "
                                                         f"({root:,} B) is missing. The root is a unit too: it is "
                                                         "not gathered again in backward, but its gradients "
                                                         "(embeddings, final norm, output) are reduce-scattered "
                                                         "once per step like every other unit's",
                               hint="reduce_scatters: 1 + len(unit_bytes); reduced_bytes: root_bytes + sum(unit_bytes)")
            return mistake("wrong_count", f"{name}: you gave {got}, FSDP recorded {measured}")
        lines.append(f"{name}: {got['all_gathers']} AG / {got['reduce_scatters']} RS")
    return correct("your formula gives the counts and bytes fsdp_lab's FSDP2 recorded for every wrapping ("
                   + "; ".join(lines) + "): they follow from the wrapping alone")


@checker("overlap_fraction", hint="merge the comm intervals and the compute intervals into unions; sum the "
                                  "lengths of their intersections; divide by the comm union's length (0.0 if none)")
def check_overlap_fraction(overlap_fraction, table):
    """Compare ``overlap_fraction(comm, compute)`` with ``Timeline.overlap()`` on every rank of every
    timeline in ``table``, and on four hand-made cases (nested compute; concurrent collectives;
    intervals out of start order; no comm)."""
    # 0.75, not 0.5: the exposed fraction (0.25) and hidden / compute time (0.6) differ from it
    nested = overlap_fraction([(0.0, 4.0)], [(1.0, 6.0), (3.0, 5.0)])
    if is_placeholder(nested):
        return placeholder_left("overlap_fraction")
    concurrent = overlap_fraction([(0.0, 4.0), (1.0, 3.0)], [(2.5, 4.0)])
    if abs(nested - 0.75) > 1e-12:
        if abs(nested - 1.0) < 1e-12:
            return mistake("nested_counted_twice", "comm (0, 4) under compute (1, 6) and (3, 5) gave 1.0: the "
                                                   "nested span (3, 5) was counted on top of (1, 6)",
                           hint="merge the compute intervals into a union first")
        return mistake("wrong_fraction", f"comm (0, 4) under compute (1, 6) and (3, 5) is 3 of 4 s hidden, 0.75; "
                                         f"you gave {nested:.3f}")
    if abs(concurrent - 0.375) > 1e-12:
        message = (f"collectives (0, 4) and (1, 3) at once under compute (2.5, 4) are 1.5 of 4 s hidden, "
                   f"0.375; you gave {concurrent:.3f}")
        if abs(concurrent - 2 / 6) < 1e-12:  # 2 s hidden of 6 s: (1, 3) counted on top of (0, 4)
            return mistake("concurrent_comm_counted_twice", message + ": (1, 3) was counted on top of (0, 4)",
                           hint="merge the comm intervals into a union first")
        return mistake("wrong_fraction", message)
    # each side in end order, not start order (every timeline gives its spans sorted by start)
    unsorted = overlap_fraction([(1.0, 2.0), (0.0, 4.0)], [(2.5, 5.0), (1.0, 6.0)])
    if abs(unsorted - 0.75) > 1e-12:
        message = ("comm (1, 2), (0, 4) under compute (2.5, 5), (1, 6), each side listed out of start order, "
                   f"is 3 of 4 s hidden, 0.75; you gave {unsorted:.3f}")
        # merging each list in the order given: comm (1, 4) and/or compute (2.5, 6)
        if any(abs(unsorted - v) < 1e-12 for v in (0.5, 1.0, 0.375)):
            return mistake("unsorted_intervals", message + ", what merging each list in the order given makes "
                                                           "of it: (1, 2) then (0, 4) become (1, 4), (2.5, 5) then "
                                                           "(1, 6) become (2.5, 6), losing (0, 1) and (1, 2.5); a "
                                                           "one-pass merge needs the intervals sorted by start",
                           hint="sort each list by start before merging: for a, b in sorted(intervals)")
        return mistake("wrong_fraction", message)
    try:
        without_comm = overlap_fraction([], [(0.0, 1.0)])
    except ZeroDivisionError:
        return mistake("no_comm", "with no comm your code divided by a total comm time of 0",
                       hint="return 0.0 when there is no comm")
    if without_comm != 0.0:
        return mistake("no_comm", "without comm the fraction is 0.0")
    checked = 0
    for name, tl in table.timelines.items():
        for rank, expected in tl.overlap().items():
            comm = [(e.t_start, e.t_end) for e in tl.comm_events(rank)]
            compute = [(e.t_start, e.t_end) for e in tl.compute_events(rank)]
            got = overlap_fraction(comm, compute)
            if abs(got - expected) > 1e-9:
                return mistake("differs_from_timeline", f"{name}, rank {rank}: you gave {got:.4f}, "
                                                        f"Timeline.overlap() says {expected:.4f}")
            checked += 1
    return correct(f"your metric equals Timeline.overlap() on all {checked} (run, rank) pairs and on the "
                   "hand-made cases (nested compute, concurrent collectives, intervals out of order, no comm)")
