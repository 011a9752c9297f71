"""Checkers for lab 00 (ranks, process groups, launch).

* ``check_global_mean(global_mean)``: every rank holds a different number of values; the
  learner's ``global_mean(values)`` must return, on every rank, the mean of all of them, without
  gathering the values (the collectives it issues are recorded: any all-gather or gather is a
  mistake). Reference: the mean of the concatenated values, computed here in one process.
* ``check_shard_range(shard_range)``: ``shard_range(numel, rank, world)`` gives the
  ``(start, end)`` of a rank's contiguous shard of ``numel`` elements, padded so every rank
  has ``ceil(numel / world)``. Reference: fsdp_lab's FSDP1 (``fsdp1.shard_boundaries``).
"""

from __future__ import annotations

import math

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, checker, collective_calls, correct,
                                        is_placeholder, mistake, not_waited, placeholder_left)

MEAN_WORLD = 3  # ranks for check_global_mean


def rank_values(rank: int) -> torch.Tensor:
    """What rank ``rank`` holds in the global-mean exercise: rank r holds r + 1 values,
    10r, 10r + 2, ... (rank 0: [0.]; rank 1: [10., 12.]; rank 2: [20., 22., 24.]). Their mean,
    88 / 6, is no whole number, so an integer division shows."""
    return 2.0 * torch.arange(rank + 1, dtype=torch.float64) + 10.0 * rank


GATHERS = ("all_gather", "gather")  # collectives that collect the values in one place


def _run_global_mean(global_mean):
    import torch.distributed as dist

    with collective_calls() as calls:
        value = global_mean(rank_values(dist.get_rank()))
    value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    return {"value": value, "collectives": [c.name for c in calls], "unwaited": calls.unwaited}


def _explain_mean(error: BaseException, text: str):
    # gloo all-reducing tensors of different sizes: a rank's transfer does not fit, the pair is
    # closed, and the first error reported is a closed connection (or a size mismatch)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "all_reduce" in text and ("Connection closed by peer" in first or "mismatch" in first.lower()):
        return mistake("different_sizes", "the ranks all-reduced tensors of different sizes (each "
                                          "rank holds a different number of values), which an "
                                          "all-reduce cannot combine: every rank must pass a "
                                          "tensor of the same size",
                       "all-reduce fixed-size totals instead: one tensor [sum of values, number of "
                       "values] on every rank, then divide")
    return None


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and abs(a - b) <= 1e-6 * max(1.0, abs(b))


@checker("global_mean", hint="all-reduce two numbers from every rank, the sum of its values and "
                              "how many it holds; then divide one total by the other",
         explain=_explain_mean)
def check_global_mean(global_mean):
    """Run ``global_mean(values)`` on 3 ranks whose values differ in number, and compare each
    rank's answer with the mean of all values computed in one process; an answer that gathers
    the values (any all-gather or gather, recorded) is a mistake even when its mean is right."""
    out = launch(_run_global_mean, global_mean, world_size=MEAN_WORLD, timeout=CHECK_TIMEOUT)
    answers = [o["value"] for o in out]
    if any(is_placeholder(a) for a in answers):
        return placeholder_left("global_mean")
    unwaited = not_waited([o["unwaited"] for o in out])
    if unwaited:
        return unwaited
    gathers = sorted({name for o in out for name in o["collectives"] if name in GATHERS})
    if gathers:
        return mistake("gathered_values", f"your function used {' and '.join(gathers)}, which "
                                          "collects every rank's data in one place; the rule is "
                                          "not to collect the values: each rank sends only its "
                                          "sum and its count (two numbers, however many values "
                                          "it holds), and an all-reduce adds them up")
    held = [rank_values(r) for r in range(MEAN_WORLD)]
    everything = torch.cat(held)
    expected = everything.mean().item()
    if all(_close(a, expected) for a in answers):
        return correct(f"every rank returned {expected:g}, the mean of all {everything.numel()} "
                       f"values; the ranks held {', '.join(str(len(h)) for h in held)} of them, "
                       "so the total and the count both had to be summed over the ranks")
    if not all(isinstance(a, (int, float)) for a in answers):
        kinds = sorted({type(a).__name__ for a in answers})
        others = [r for r, a in enumerate(answers) if not isinstance(a, (int, float))]
        if len(others) < len(answers):
            which = f"rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}"
            return mistake("not_a_number", f"{which} returned {', '.join(sorted({type(answers[r]).__name__ for r in others}))}, "
                                           "the others a number: every rank must return the mean (after "
                                           "an all-reduce every rank holds the totals)")
        return mistake("not_a_number", f"global_mean returned {', '.join(kinds)}; return a "
                                       "number (a float, or a one-element tensor)")
    local = [h.mean().item() for h in held]
    mean_of_means = sum(local) / MEAN_WORLD
    if all(_close(a, m) for a, m in zip(answers, local)):
        return mistake("no_collective", "each rank returned the mean of its own values only: "
                                        "nothing was exchanged between ranks")
    if all(_close(a, mean_of_means) for a in answers):
        return mistake("mean_of_means", f"every rank returned {mean_of_means:g}, the average of "
                                        f"the ranks' means; but the ranks hold different numbers "
                                        f"of values, so each value must count once: the mean is "
                                        f"{expected:g}",
                       "all-reduce the sum of the values and the number of values, not the means")
    if all(_close(a, math.floor(expected)) for a in answers):
        return mistake("integer_division", f"every rank returned {answers[0]:g}, the mean rounded "
                                           f"down to a whole number; the mean of all values is "
                                           f"{expected:g}",
                       "divide in floating point: totals[0] / totals[1] (an integer tensor, int() "
                       "or // drops the fraction)")
    if all(_close(a, everything.sum().item() / MEAN_WORLD) for a in answers):
        return mistake("divided_by_world", f"every rank returned {answers[0]:g}, the sum of all values "
                                           f"divided by the number of ranks ({MEAN_WORLD}); the ranks hold "
                                           f"{everything.numel()} values in all, so the mean is {expected:g}",
                       "all-reduce the number of values too, and divide the summed values by it")
    if all(_close(a, everything.sum().item()) for a in answers) or all(
            _close(a, sum(local)) for a in answers):
        return mistake("not_divided", "every rank returned a sum over the ranks, not a mean: "
                                      "divide by the total number of values")
    if len({round(a, 9) for a in answers}) > 1:
        return mistake("ranks_disagree", f"the ranks returned different values {answers}; after "
                                         "an all-reduce every rank holds the same totals")
    return mistake("wrong_value", f"every rank returned {answers[0]:g}; the mean of all values "
                                  f"is {expected:g}")


def _expected_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """The reference: fsdp_lab's FSDP1 shard boundaries of one flat parameter."""
    from fsdp_lab.fsdp1 import shard_boundaries

    return shard_boundaries([numel], world, rank)[0]


CASES = [(10, 4), (12, 4), (7, 3), (5, 8), (1, 2), (64, 2), (1000, 7), (9, 1)]


@checker("shard_range", hint="every rank gets ceil(numel / world) slots, the last ones maybe "
                              "padding; rank r's slots start r times that far in; clip start and "
                              "end to numel")
def check_shard_range(shard_range):
    """Compare ``shard_range(numel, rank, world)`` with fsdp_lab's FSDP1 boundaries for
    several sizes, including ones that do not divide evenly and ranks holding only padding."""
    for numel, world in CASES:
        got = [shard_range(numel, rank, world) for rank in range(world)]
        if any(is_placeholder(g) for g in got):
            return placeholder_left("shard_range")
        got = [tuple(int(x) for x in g) if isinstance(g, (tuple, list)) and len(g) == 2 else g
               for g in got]
        expected = [_expected_range(numel, rank, world) for rank in range(world)]
        if got == expected:
            continue
        return _diagnose_range(numel, world, got, expected)
    numel, world = 10, 4
    per = math.ceil(numel / world)
    ranges = ", ".join(f"{a}:{b}" for a, b in (_expected_range(numel, r, world) for r in range(world)))
    return correct(f"for {numel} elements on {world} ranks every rank has {per} slots "
                   f"(ranges {ranges}); the last rank's missing {per * world - numel} are padding, "
                   "so every shard has the same size and an all-gather can rebuild the whole")


def _diagnose_range(numel: int, world: int, got: list, expected: list):
    case = f"numel={numel}, world={world}"
    shown = f"you gave {got}, expected {expected}"
    if not all(isinstance(g, tuple) and len(g) == 2 for g in got):
        return mistake("not_a_pair", f"for {case} shard_range returned {got}; return a pair "
                                     "(start, end) for each rank")
    per, floor = math.ceil(numel / world), numel // world
    if any(end > numel for _, end in got):
        return mistake("not_clipped", f"for {case} a range ends past element {numel}: {shown}",
                       "clip start and end to numel: the ranks at the end own padding only")
    if all(b - a == a_e - a_s - 1 for (a, b), (a_s, a_e) in zip(got, expected) if a_e > a_s) and \
            all(a == a_s for (a, _), (a_s, _) in zip(got, expected)):
        return mistake("end_inclusive", f"for {case} every range stops one element early: {shown}",
                       "end is exclusive, as in Python slices: t[start:end]")
    if floor != per and all(b - a == floor for a, b in got):
        covered = sum(b - a for a, b in got)
        return mistake("floor_division", f"for {case} every rank took numel // world = {floor} "
                                         f"elements, so the last {numel - covered} belong to no rank",
                       "round the shard size up: per = ceil(numel / world), then clip to numel")
    owners = [0] * numel
    for a, b in got:
        for i in range(max(a, 0), min(b, numel)):
            owners[i] += 1
    if any(o > 1 for o in owners):
        return mistake("overlap", f"for {case} some elements belong to two ranks: {shown}")
    return mistake("wrong_bounds", f"for {case} {shown}")
