"""Checkers for lab 09 (slaying OOMs).

* ``check_agreement(agreement)``: the one all-reduce that decides, on every rank, whether the
  batch is retried. ``agreement(oom, not_done)`` returns (someone ran out, every rank is done).
  Reference: a formula over all ranks' inputs (MAX of oom; done on all ranks = 1 - MAX of not
  done), worked in this process, and ``fsdp_lab.oom``'s own two-element MAX all-reduce run
  beside the answer on the same ranks.
* ``check_next_microbatch(next_microbatch)``: the step-down rule after an OOM. Reference:
  ``AutoMicrobatch._largest_divisor`` (this package's rule). The answer is classified over all its
  cases against ``WRONG_RULES`` (Composer's plain halving, ignoring min_size, min_size instead of
  None, starting one below half or rounding half up, ...), not from the first case it gets wrong.

An agreement that calls ``torch.distributed``'s collectives directly is counted too: the Timeline
records ``fsdp_lab.collectives``, and ``checking.collective_calls`` adds the rest.

The lab's tables and figures are drawn by the helpers at the end of this module; the notebook
computes what they show, with ``step_peak`` (the peak bytes of one training step on one process)
measuring for section 4's table and the checklist.
"""

from __future__ import annotations

import contextlib
import itertools
import time

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, AnswerTimedOut, checker, collective_calls, correct, mistake,
                                        not_waited, time_limit)

WORLD = 2
ANSWER_SECONDS = 10.0  # wall time for all of next_microbatch's cases (well under 0.1 s when it is right)
# every (oom, not_done) of each of the two ranks: 16 cases, run in one launch
CASES = [tuple(c) for c in itertools.product(itertools.product((0, 1), repeat=2), repeat=WORLD)]


def expected(case) -> tuple[int, int]:
    """(MAX of oom, 1 if every rank is done) for one case: rank r's inputs are ``case[r]``."""
    return max(oom for oom, _ in case), 1 - max(not_done for _, not_done in case)


def _run(answer):
    import torch.distributed as dist

    from fsdp_lab import oom

    rank, out = dist.get_rank(), []
    for case in CASES:
        mine = case[rank]
        with collective_calls() as calls:
            got = answer(*mine)
        n_collectives = len(calls)
        ours = oom._flags(*mine)  # fsdp_lab's own, on the same ranks
        out.append((tuple(int(v) for v in got) if isinstance(got, (tuple, list)) else got,
                    n_collectives, (ours[0], 1 - ours[1]), calls.unwaited))
    return out


@checker("agreement", hint="put [oom, not_done] in one int32 tensor, collectives.all_reduce(t, op='max'), "
                           "return (t[0], 1 - t[1])")
def check_agreement(agreement):
    """Run ``agreement(oom, not_done)`` on 2 ranks for all 16 combinations of both ranks' flags and
    compare each rank's (someone_oomed, all_done) with the MAX over ranks computed by hand; also
    count the collectives it used per call (one all-reduce is enough)."""
    per_rank = launch(_run, agreement, world_size=WORLD, timeout=CHECK_TIMEOUT)
    unwaited = not_waited([call[3] for calls in per_rank for call in calls])
    if unwaited:
        return unwaited
    wrong = []   # (case, rank, got, want) of every call that disagrees with the formula
    for i, case in enumerate(CASES):
        want = expected(case)
        for rank in range(WORLD):
            got, _, ours, _ = per_rank[rank][i]
            assert ours == want, "fsdp_lab's own agreement disagrees with the formula"
            if not isinstance(got, tuple) or len(got) != 2:
                return mistake("shape", f"agreement returned {got!r}; return two ints: (someone_oomed, all_done)")
            if got != want:
                wrong.append((case, rank, got, want))
    if wrong:
        return _classify_wrong(wrong)
    counts = {n for rows in per_rank for _, n, _, _ in rows}
    if max(counts) > 1:
        return mistake("two_all_reduces", f"right values, but {max(counts)} collectives per call: Composer pays "
                                          "two (MAX then MIN); one two-element MAX does both, since "
                                          "MIN(done) = 1 - MAX(not done)")
    return correct(f"all {len(CASES)} combinations of two ranks' flags agree with the formula and with "
                   "fsdp_lab.oom, in one all-reduce per call: a rank that ran out makes every rank retry, "
                   "and nobody leaves the agreement loop while a peer is still inside the batch")


def _classify_wrong(wrong):
    """Name the mistake that explains every wrong call; quote the first one."""
    case, rank, got, want = wrong[0]
    where = f"for rank inputs {case} (rank r passes case[r] as (oom, not_done)) rank {rank} got {got}"
    if any(v > 1 or v < 0 for _, _, g, _ in wrong for v in g):
        return mistake("sum", f"{where}: a SUM counts ranks; the flags need MAX (want {want})")
    # an answer that never all-reduces returns its own flags: (oom, 1 - not_done)
    if all(g == (c[r][0], 1 - c[r][1]) for c, r, g, _ in wrong):
        return mistake("local", f"{where}: those are this rank's own flags; all-reduce them so that "
                                f"every rank sees all ranks' flags (want {want})")
    if all(g == (w[0], 1 - c[r][1]) for c, r, g, w in wrong):
        return mistake("local_done", f"{where}: the first value is right, the second is this rank's own "
                                     f"'done'; all-reduce not_done too, in the same tensor (want {want})")
    if all(g == (c[r][0], w[1]) for c, r, g, w in wrong):
        return mistake("local_oom", f"{where}: the second value is right, the first is this rank's own "
                                    f"'oom'; all-reduce oom too, in the same tensor (want {want})")
    # MAX(not_done) returned as it is differs from the formula on every call, not only on some
    if len(wrong) == WORLD * len(CASES) and all(g == (w[0], 1 - w[1]) for _, _, g, w in wrong):
        return mistake("not_done", f"{where}: the second value is MAX of 'not done'; every rank is done "
                                   f"when that is 0, so return 1 minus it (want {want})")
    if all(g == (w[0], max(1 - not_done for _, not_done in c)) for c, _, g, w in wrong):
        return mistake("any_done", f"{where}: the second value is 1 as soon as any rank is done (MAX of "
                                   "'done'); a rank may leave only when every rank is done: MIN(done), "
                                   f"which is 1 - MAX(not done) (want {want})")
    # MIN, or an AVG of 0/1 flags read back as ints, is 1 only where every rank has the flag
    if all(g == (min(oom for oom, _ in c), 1 - min(not_done for _, not_done in c)) for c, _, g, _ in wrong):
        return mistake("min", f"{where}: a MIN (or an average rounded down) of the flags is 1 only when "
                              "every rank's flag is set, so the batch is retried only if every rank ran "
                              "out, and a rank leaves the loop while a peer is still inside the batch; "
                              f"reduce with op='max' (want {want})")
    return mistake("wrong", f"{where}, want {want}")


def _reference(batch_size: int, failed: int, min_size: int):
    from fsdp_lab.automicrobatch import AutoMicrobatch
    return AutoMicrobatch._largest_divisor(batch_size, failed // 2, min_size)


def _largest_divisor(batch_size: int, at_most: int, at_least: int):
    from fsdp_lab.automicrobatch import AutoMicrobatch
    return AutoMicrobatch._largest_divisor(batch_size, at_most, at_least)


# The wrong rules learners write, each (batch, failed, min_size) -> size. An answer that gives a rule's
# size on every case where that rule differs from the reference makes that rule's mistake.

def _no_step_down(b, f, m):
    return f


def _divides_failed(b, f, m):      # the step-down over the divisors of the failed size
    return _reference(f, f, m)


def _halving(b, f, m):             # Composer's halving wherever min_size allows it: need not divide the batch
    return f // 2 if f // 2 >= m else _reference(b, f, m)


def _ignores_min(b, f, m):         # counts down to 1
    return _reference(b, f, 1)


def _min_instead_of_none(b, f, m):
    right = _reference(b, f, m)
    return m if right is None else right


def _one_below_half(b, f, m):      # range(failed // 2 - 1, ...)
    return _largest_divisor(b, f // 2 - 1, m)


def _rounds_half_up(b, f, m):      # range((failed + 1) // 2, ...)
    return _largest_divisor(b, (f + 1) // 2, m)


WRONG_RULES = {"no_step_down": _no_step_down, "divides_failed": _divides_failed, "plain_halving": _halving,
               "ignores_min_size": _ignores_min, "min_instead_of_none": _min_instead_of_none,
               "one_below_half": _one_below_half, "rounds_half_up": _rounds_half_up}


@checker("next_microbatch", hint="count down from failed // 2 to min_size; return the first size that "
                                 "divides batch_size, or None")
def check_next_microbatch(next_microbatch):
    """Compare ``next_microbatch(batch_size, failed, min_size)`` with ``AutoMicrobatch``'s rule (the
    largest divisor of the batch at most half the failed size and at least ``min_size``, else
    None) for every batch 1-24, failed size 1 to the batch and minimum 1-3; name the wrong rule
    that explains every case (``WRONG_RULES``), else what the wrong sizes have in common."""
    cases = [(b, f, m) for b in range(1, 25) for f in range(1, b + 1) for m in (1, 2, 3)]
    cases.sort(key=lambda c: c[1] == 1)  # failed = 1 last: there every rule's answer looks alike
    answers, case = {}, cases[0]
    try:
        with time_limit(ANSWER_SECONDS):
            for case in cases:
                answers[case] = next_microbatch(*case)
    except AnswerTimedOut:
        b, f, m = case
        return mistake("never_returns", f"batch {b}, failed microbatch {f}, min {m}: no answer within "
                                        f"{ANSWER_SECONDS:g} s; a loop whose size never changes runs forever "
                                        "(lower the size on every pass)")
    wants = {case: _reference(*case) for case in cases}
    wrong = [(case, answers[case], wants[case]) for case in cases if answers[case] != wants[case]]
    if wrong:
        for name, rule in WRONG_RULES.items():
            differs = [case for case in cases if rule(*case) != wants[case]]
            if differs and all(answers[case] == rule(*case) for case in differs):
                return _rule_mistake(name, [(case, answers[case], wants[case]) for case in differs], wrong)
        return _microbatch_mistake(wrong)
    return correct(f"{len(cases)} cases (batch sizes 1-{max(b for b, _, _ in cases)}, every failed size, "
                   f"min_size 1-3) agree with AutoMicrobatch's rule: every microbatch divides the batch, "
                   "so each step still sums the same samples with the same weights")


def _where(case, got) -> str:
    b, f, m = case
    return f"batch {b}, failed microbatch {f}, min {m}: got {got}"


def _divides(b: int, size) -> bool:
    return isinstance(size, int) and size >= 1 and b % size == 0


def _rule_mistake(name: str, differs: list, wrong: list):
    """The verdict for an answer that follows the wrong rule ``name`` on every case where that rule
    differs from the reference (``differs``: (case, got, want)); ``wrong``: every wrong case."""
    (b, f, m), got, want = differs[0]
    where = _where((b, f, m), got)
    if name == "no_step_down":
        return mistake(name, f"returns the size that just failed: {where}; want {want}")
    if name == "divides_failed":
        return mistake(name, f"{where}, a divisor of the failed size {f}; a microbatch must divide the batch "
                             f"{b} (want {want})")
    if name == "plain_halving":
        also = []
        below = next(((c, g) for c, g, _ in wrong if isinstance(g, int) and g < c[2]), None)
        if below:
            also.append(f"sizes below min_size ({_where(*below)}, below min_size {below[0][2]})")
        to_min = next(((c, g) for c, g, w in wrong if g == c[2] and w is None), None)
        if to_min:
            also.append(f"min_size where no size fits ({_where(*to_min)}; want None)")
        stuck = next(((c, g) for c, g, w in wrong
                      if isinstance(g, int) and g >= c[1] and not (g == c[2] and w is None)), None)
        if stuck:
            also.append(f"sizes no smaller than the one that failed ({_where(*stuck)}, where nothing is "
                        "left to try: None)")
        return mistake(name, f"returns sizes that do not divide the batch (Composer's halving): {where}, "
                             f"which does not divide the batch {b}; want {want}. Plain halving is Composer's "
                             "rule; here each microbatch's loss is weighted by its share, so every microbatch "
                             "must divide the batch" + (f". It also returns {' and '.join(also)}" if also else ""))
    if name == "ignores_min_size":
        return mistake(name, f"ignores min_size: {where}, below min_size {m}; want {want}: count down to "
                             "min_size, not to 1, and return None when none of those sizes divides the batch",
                       hint="for size in range(failed // 2, min_size - 1, -1)")
    if name == "min_instead_of_none":
        if f // 2 >= m:
            none_fits = f"no size from {f // 2} (half of {f}) down to min_size {m} divides the batch {b}"
        else:
            none_fits = f"no size is both at least min_size {m} and at most half of {f} ({f // 2})"
        return mistake(name, f"returns min_size where no size fits: {where}, but {none_fits}: return None "
                             "(the caller then gives up), not min_size")
    if name == "one_below_half":
        return mistake(name, f"starts one below half of failed: {where}, want {want}; {f // 2} (half of {f}) "
                             "is itself allowed: count down from failed // 2, not failed // 2 - 1")
    return mistake(name, f"rounds half of failed up: {where}, above half of {f} ({f / 2:g}); want {want}: "
                         "failed // 2 rounds down, so the next size is at most half the one that failed")


def _microbatch_mistake(wrong: list):
    """Name what the wrong sizes ``wrong`` ((case, got, want), in case order) have in common when
    no single wrong rule explains them; quote the first of them."""
    def first(test):
        return next(((c, g, w) for c, g, w in wrong if test(c, g)), None)

    found = first(lambda c, g: g is not None and not isinstance(g, int))
    if found:
        return mistake("not_an_int", f"{_where(*found[:2])} ({type(found[1]).__name__}); a microbatch size is an "
                                     f"int (or None when no size fits); want {found[2]}",
                       hint="count down with range(failed // 2, min_size - 1, -1): its sizes are ints")
    found = first(lambda c, g: g is not None and not _divides(c[0], g))
    if found:
        (b, _, _), got, want = found
        return mistake("not_a_divisor", f"{_where(*found[:2])}, which does not divide the batch {b}; want {want}")
    found = first(lambda c, g: g is not None and g > c[1] // 2)
    if found:
        (_, f, _), _, want = found
        return mistake("above_half", f"{_where(*found[:2])}, above half of the failed size {f}; want {want}")
    found = first(lambda c, g: g is not None and g < c[2])
    if found:
        (_, _, m), _, want = found
        return mistake("below_min", f"{_where(*found[:2])}, below min_size {m}; want {want}")
    found = first(lambda c, g: g is None)
    if found:
        (_, f, m), _, want = found
        return mistake("none_when_one_fits", f"{_where(*found[:2])}, but {want} divides the batch and lies "
                                             f"between min_size {m} and half of {f}; want {want}")
    (case, got, want) = wrong[0]
    return mistake("wrong", f"{_where(case, got)}, want {want}")


# ----------------------------------------------------------------------------- the lab's measurements

def step_peak(batch: int, n_layers: int, seq: int, microbatch: int, checkpoint: bool = False,
              lora: str | None = None, first_step: bool = False) -> tuple[int, dict]:
    """Peak memory of one AdamW training step (lr 1e-3) on one process, in bytes: the "cpu"
    Llama of ``n_layers`` layers (seed 0), ``batch`` sequences of ``seq`` tokens
    (``global_batch`` at step 1; at step 0 with ``first_step``) run ``microbatch`` sequences at a
    time, each microbatch's loss weighted by its share of the batch. ``checkpoint`` applies
    activation checkpointing; ``lora`` applies rank-8 LoRA adapters ("lora") or adapters on an NF4
    base ("qlora"), and the optimizer takes the trainable parameters only.

    Without ``first_step`` one step (step 0) runs first, creating AdamW's state, and the next is
    measured: the step that repeats for the rest of training. Returns ``(peak_total, peak)``:
    ``MemoryTracker.peak_total()`` and ``MemoryTracker.peak()`` ({category: bytes at that peak}).
    Raises ValueError if ``microbatch`` does not divide ``batch`` or ``lora`` is not None,
    "lora" or "qlora".
    """
    import torch

    from fsdp_lab.automicrobatch import split_batch
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing

    if microbatch < 1 or batch % microbatch:
        raise ValueError(f"microbatch {microbatch} does not divide the batch {batch}")
    if lora not in (None, "lora", "qlora"):
        raise ValueError(f"lora={lora!r}: None, 'lora' or 'qlora'")
    config = LlamaConfig.from_name("cpu", n_layers=n_layers)
    model = Llama(config, seed=0)
    if checkpoint:
        apply_activation_checkpointing(model)
    if lora is not None:
        from fsdp_lab.qlora.lora import apply_lora
        apply_lora(model, rank=8, quantize_base=lora == "qlora")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def train_step(step):
        data = global_batch(config.vocab_size, batch, seq, step=step)
        for begin in range(0, batch, microbatch):
            (model(split_batch(data, begin, begin + microbatch)).loss * (microbatch / batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if not first_step:
        train_step(0)  # creates AdamW's state
    with MemoryTracker(model, opt) as tracker:
        train_step(0 if first_step else 1)
    return tracker.peak_total(), tracker.peak()


# ----------------------------------------------------------------------------- the lab's figures and tables
# Drawing and printing that the notebook calls; what they show is computed in the notebook.

MiB = 2**20


def print_recovery_table(rows_rank0: list, rows_rank1: list) -> None:
    """One line per injected OOM: where, each rank's final microbatch, the retries and each
    rank's leaked bytes. A row is (where, microbatch size, retries, leaked bytes)."""
    print(f"{'OOM on rank 1 at':<26}{'microbatch r0':>14}{'microbatch r1':>14}{'retries':>8}{'leaked bytes r0/r1':>20}")
    for row0, row1 in zip(rows_rank0, rows_rank1):
        print(f"{row0[0]:<26}{row0[1]:>14}{row1[1]:>14}{row0[2]:>8}{f'{row0[3]}/{row1[3]}':>20}")


@contextlib.contextmanager
def clock_marks(amb, point: str, skip: int, marks: dict):
    """Within the block, record in ``marks`` the ``time.perf_counter()`` seconds at which rank 1
    reached sync point ``point`` for the ``skip``-th time (``"oom"``: where the injected OOM fires;
    None if it never did) and at which ``amb`` first recovered (``"retry"``)."""
    import torch.distributed as dist

    from fsdp_lab import sync_points

    seen = []
    clock = sync_points.register(lambda p, m: seen.append(time.perf_counter())
                                 if p == point and dist.get_rank() == 1 else None, first=True)
    recover = amb._recover
    amb._recover = lambda: (recover(), marks.setdefault("retry", time.perf_counter()))
    try:
        yield
    finally:
        clock.remove()
        amb._recover = recover
        marks["oom"] = seen[skip] if seen[skip:] else None


def plot_agreement_timeline(merged, oom_time: float, retry_time: float):
    """Both ranks' timeline of the step where rank 1 ran out at ``pre_backward``, with a red line
    at the OOM and a green one where the retry starts (``time.perf_counter()`` values)."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz import plot_timeline

    fig, ax = plt.subplots(figsize=(11, 3.5))
    plot_timeline(merged, ax=ax, title="rank 1 runs out of memory at pre_backward; both agree, step down, retry")
    t0 = min(e.t_start for e in merged.events)
    ax.axvline((oom_time - t0) * 1e3, color="red", linewidth=2, label="OOM on rank 1")
    ax.axvline((retry_time - t0) * 1e3, color="green", linewidth=2, label="retry starts (rank 0)")
    # one legend: the timeline's lanes, then the two lines
    old = ax.get_legend()
    handles, labels = list(old.legend_handles), [t.get_text() for t in old.get_texts()]
    old.remove()
    extra, extra_labels = ax.get_legend_handles_labels()
    ax.legend(handles + extra, labels + extra_labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return fig


def print_step_peaks(grid: dict, batch: int) -> None:
    """The table of ``grid[n_layers, seq, microbatch]`` (peak bytes of a step), in MiB."""
    layers, seqs, sizes = (sorted({key[i] for key in grid}) for i in range(3))
    print(f"peak MiB of a step after the first (batch {batch}), rows: layers x seq, "
          f"columns: microbatch {' '.join(map(str, sizes))}")
    for n in layers:
        for s in seqs:
            print(f"  {n} layers, seq {s:>3}: " + " ".join(f"{grid[n, s, m] / MiB:6.2f}" for m in sizes))


def plot_microbatch_search(grid: dict, batch: int, budget_mib: float, n_layers: int, seq_len: int, chosen):
    """The measured peak of a step against the microbatch size, the budget, and the size
    ``chosen`` (None: nothing fits). ``grid[n_layers, seq_len, size]`` holds bytes. Returns
    (figure, one line of text)."""
    import matplotlib.pyplot as plt

    sizes = (1, 2, 4, 8)
    peaks = [grid[n_layers, seq_len, m] / MiB for m in sizes]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(sizes, peaks, "o-", label="measured peak of a step")
    ax.axhline(budget_mib, color="red", linestyle="--", label="budget")
    if chosen:
        ax.plot([chosen], [grid[n_layers, seq_len, chosen] / MiB], "g*", markersize=16, label=f"chosen: {chosen}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(m) for m in sizes])
    ax.set_xlabel("microbatch size")
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    ax.set_title(f"{n_layers} layers, seq {seq_len}, batch {batch}")
    text = f"chosen microbatch: {chosen}" if chosen else "nothing fits: even microbatch 1 runs out of memory"
    return fig, text


def device_part(run: dict, host: tuple[str, ...]) -> int:
    """Device bytes at the step's peak: the total less the ``host`` categories at that moment.
    ``run``: {"total": peak bytes, "peak": {category: bytes at the peak}}."""
    return run["total"] - sum(run["peak"][c] for c in host)


def print_offload_breakdown(runs: dict, host: tuple[str, ...]) -> None:
    """Rank 0's bytes by category at the peak of the offloaded step, FSDP2 beside FSDP1, and
    where each category lives with offload; then each implementation's device peak without
    and with offload. ``runs[impl, offload]``: {"total": bytes, "peak": {category: bytes}}."""
    print(f"{'category at the peak (rank 0)':<30}{'FSDP2 MiB':>10}{'FSDP1 MiB':>10}  lives on, with offload")
    for category, nbytes in runs["fsdp2", True]["peak"].items():
        other = runs["fsdp1", True]["peak"][category]
        if nbytes or other:
            print(f"{category:<30}{nbytes / MiB:10.2f}{other / MiB:10.2f}  {'host' if category in host else 'device'}")
    for impl in ("fsdp2", "fsdp1"):
        offloaded = runs[impl, True]
        on_host = sum(offloaded["peak"][c] for c in host)
        print(f"{impl}: device peak without offload {runs[impl, False]['total'] / MiB:.2f} MiB, "
              f"with offload {device_part(offloaded, host) / MiB:.2f} MiB "
              f"({on_host / MiB:.2f} MiB of states on the host at that moment)")


def plot_checklist(groups: dict):
    """Print and draw each checklist group: ``{title: (baseline bytes, [(item, peak bytes)])}``."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(11, 3))
    for ax, (title, (base, rows)) in zip(axes, groups.items()):
        print(title)
        for name, peak in rows:
            print(f"  {name:<38}{peak / MiB:8.2f} MiB  {peak / base:6.1%} of its baseline")
        ax.barh([r[0] for r in rows][::-1], [r[1] / MiB for r in rows][::-1], color="tab:blue")
        ax.set_xlabel("peak MiB of a step (per rank)")
        ax.set_title(title, fontsize=9)
    fig.suptitle("the slaying-OOMs checklist, measured")
    fig.tight_layout()
    return fig
