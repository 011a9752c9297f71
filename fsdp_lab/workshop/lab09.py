"""Checkers for lab 09 (slaying OOMs).

* ``check_agreement(agreement)``: the one all-reduce that decides, on every rank, whether the
  batch is retried. ``agreement(oom, not_done)`` returns (someone ran out, every rank is done).
  Reference: a formula over all ranks' inputs (MAX of oom; done on all ranks = 1 - MAX of not
  done), worked in this process, and ``fsdp_lab.oom``'s own two-element MAX all-reduce run
  beside the answer on the same ranks.
* ``check_next_microbatch(next_microbatch)``: the step-down rule after an OOM. Reference:
  ``AutoMicrobatch._largest_divisor`` (this package's rule), and Composer's plain halving to
  name that mistake.
"""

from __future__ import annotations

import itertools

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import CHECK_TIMEOUT, checker, correct, mistake

WORLD = 2
# every (oom, not_done) of each of the two ranks: 16 cases, run in one launch
CASES = [tuple(c) for c in itertools.product(itertools.product((0, 1), repeat=2), repeat=WORLD)]


def expected(case) -> tuple[int, int]:
    """(MAX of oom, 1 if every rank is done) for one case: rank r's inputs are ``case[r]``."""
    return max(oom for oom, _ in case), 1 - max(not_done for _, not_done in case)


def _run(answer):
    import torch.distributed as dist

    from fsdp_lab import oom
    from fsdp_lab.timeline import Timeline

    rank, out = dist.get_rank(), []
    for case in CASES:
        mine = case[rank]
        with Timeline() as tl:
            got = answer(*mine)
        n_collectives = len(tl.comm_events())
        ours = oom._flags(*mine)  # fsdp_lab's own, on the same ranks
        out.append((tuple(int(v) for v in got) if isinstance(got, (tuple, list)) else got,
                    n_collectives, (ours[0], 1 - ours[1])))
    return out


@checker("agreement", hint="put [oom, not_done] in one int32 tensor, collectives.all_reduce(t, op='max'), "
                           "return (t[0], 1 - t[1])")
def check_agreement(agreement):
    per_rank = launch(_run, agreement, world_size=WORLD, timeout=CHECK_TIMEOUT)
    for i, case in enumerate(CASES):
        want = expected(case)
        for rank in range(WORLD):
            got, n, ours = per_rank[rank][i]
            assert ours == want, "fsdp_lab's own agreement disagrees with the formula"
            if not isinstance(got, tuple) or len(got) != 2:
                return mistake("shape", f"agreement returned {got!r}; return two ints: (someone_oomed, all_done)")
            if got == want:
                continue
            someone = f"rank inputs {case} (rank r passes case[r] as (oom, not_done))"
            if got[0] > 1 or got[1] > 1 or got[1] < 0:
                return mistake("sum", f"for {someone} rank {rank} got {got}: a SUM counts ranks; "
                                      f"the flags need MAX (want {want})")
            if got == (want[0], 1 - want[1]):
                return mistake("not_done", f"for {someone} rank {rank} got {got}: the second value is MAX of "
                                           f"'not done'; every rank is done when that is 0 (want {want})")
            if got[0] == case[rank][0] or got[1] == 1 - case[rank][1]:
                return mistake("local", f"for {someone} rank {rank} got {got}: that is this rank's own "
                                        f"flag; all-reduce it (want {want})")
            return mistake("wrong", f"for {someone} rank {rank} got {got}, want {want}")
    counts = {n for rows in per_rank for _, n, _ in rows}
    if counts != {1}:
        return mistake("two_all_reduces", f"right values, but {max(counts)} collectives per call: Composer pays "
                                          "two (MAX then MIN); one two-element MAX does both, since "
                                          "MIN(done) = 1 - MAX(not done)")
    return correct(f"all {len(CASES)} combinations of two ranks' flags agree with the formula and with "
                   "fsdp_lab.oom, in one all-reduce per call: a rank that ran out makes every rank retry, "
                   "and nobody leaves the agreement loop while a peer is still inside the batch")


def _reference(batch_size: int, failed: int, min_size: int):
    from fsdp_lab.automicrobatch import AutoMicrobatch
    return AutoMicrobatch._largest_divisor(batch_size, failed // 2, min_size)


@checker("next_microbatch", hint="count down from failed // 2 to min_size; return the first size that "
                                 "divides batch_size, or None")
def check_next_microbatch(next_microbatch):
    cases = [(b, f, m) for b in range(1, 25) for f in range(1, b + 1) for m in (1, 2, 3)]
    cases.sort(key=lambda c: c[1] == 1)  # failed = 1 last: there every rule's answer looks alike
    for b, f, m in cases:
        got, want = next_microbatch(b, f, m), _reference(b, f, m)
        if got == want:
            continue
        where = f"batch {b}, failed microbatch {f}, min {m}"
        if got == f and f > 1:
            return mistake("no_step_down", f"{where}: got {got}, the size that just failed; want {want}")
        if got == max(f // 2, 1) and (want is None or b % max(f // 2, 1)):
            return mistake("plain_halving", f"{where}: got {got}, want {want}. Plain halving is Composer's "
                                            f"rule; {got} does not divide {b} (or is below the minimum)")
        if got is not None and got < m:
            return mistake("below_min", f"{where}: got {got}, below min_size {m}; want {want}")
        return mistake("wrong", f"{where}: got {got}, want {want}")
    return correct(f"{len(cases)} cases agree with AutoMicrobatch's rule: every microbatch divides the batch, "
                   "so each step still sums the same samples with the same weights")
