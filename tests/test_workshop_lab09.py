"""Lab 09's checkers (slaying OOMs) on the shipped stubs, the shipped solutions and typical
wrong answers; and the allocation-site OOM and emulated retry count of ``memory_budget``.

References: the agreement's verdicts against a formula over both ranks' flags (and
fsdp_lab.oom's own all-reduce); the step-down rule against AutoMicrobatch's rule; the
allocation-site OOM against a hand count of a forward's allocations.
"""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.oom import memory_budget
from fsdp_lab.workshop import lab09
from test_workshop_labs import Shipped

SHIPPED = Shipped("09_slaying_ooms")


def sum_flags(oom, not_done):
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    collectives.all_reduce(t)  # SUM: counts ranks
    return int(t[0]), 1 - int(t[1])


def two_all_reduces(oom, not_done):
    a, b = torch.tensor([oom], dtype=torch.int32), torch.tensor([1 - not_done], dtype=torch.int32)
    collectives.all_reduce(a, op="max")
    collectives.all_reduce(b, op="min")
    return int(a), int(b)


def forgot_one_minus(oom, not_done):
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    collectives.all_reduce(t, op="max")
    return int(t[0]), int(t[1])


def any_rank_done(oom, not_done):
    t = torch.tensor([oom, 1 - not_done], dtype=torch.int32)
    collectives.all_reduce(t, op="max")  # MAX of done: 1 as soon as one rank is done
    return int(t[0]), int(t[1])


def min_flags(oom, not_done):
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    collectives.all_reduce(t, op="min")  # 1 only where every rank has the flag
    return int(t[0]), 1 - int(t[1])


def own_done(oom, not_done):
    t = torch.tensor([oom], dtype=torch.int32)
    collectives.all_reduce(t, op="max")  # only oom is shared
    return int(t[0]), 1 - not_done


def local_flags(oom, not_done):
    return oom, 1 - not_done  # no all-reduce: each rank sees only its own flags


def torch_distributed_max(oom, not_done):
    import torch.distributed as dist
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # right, past fsdp_lab's Timeline
    return int(t[0]), 1 - int(t[1])


def torch_distributed_max_then_min(oom, not_done):
    import torch.distributed as dist
    a, b = torch.tensor([oom], dtype=torch.int32), torch.tensor([1 - not_done], dtype=torch.int32)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)  # Composer's two all-reduces, past fsdp_lab
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    return int(a), int(b)


def torch_distributed_not_waited(oom, not_done):
    import torch.distributed as dist
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)  # torch's own, its work never waited on
    return int(t[0]), 1 - int(t[1])


def torch_distributed_waited(oom, not_done):
    import torch.distributed as dist
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()
    return int(t[0]), 1 - int(t[1])


def not_waited(oom, not_done):
    t = torch.tensor([oom, not_done], dtype=torch.int32)
    collectives.all_reduce(t, op="max", async_op=True)  # the handle is dropped: never waited on
    return int(t[0]), 1 - int(t[1])


def test_agreement_checker():
    stub, solution = SHIPPED["agreement"]
    assert lab09.check_agreement(stub).mistake == "stub"
    assert lab09.check_agreement(solution).solved
    assert lab09.check_agreement(sum_flags).mistake == "sum"
    assert lab09.check_agreement(two_all_reduces).mistake == "two_all_reduces"
    assert lab09.check_agreement(forgot_one_minus).mistake == "not_done"
    assert lab09.check_agreement(local_flags).mistake == "local"
    assert lab09.check_agreement(any_rank_done).mistake == "any_done"
    assert lab09.check_agreement(own_done).mistake == "local_done"
    assert lab09.check_agreement(min_flags).mistake == "min"
    assert lab09.check_agreement(not_waited).mistake == "not_waited"
    assert lab09.check_agreement(torch_distributed_not_waited).mistake == "not_waited"
    assert lab09.check_agreement(torch_distributed_waited).solved
    assert lab09.check_agreement(torch_distributed_max).solved
    assert lab09.check_agreement(torch_distributed_max_then_min).mistake == "two_all_reduces"


def test_expected_is_the_formula():
    assert lab09.expected(((1, 0), (0, 1))) == (1, 0)
    assert lab09.expected(((0, 0), (0, 0))) == (0, 1)


def test_next_microbatch_checker():
    stub, solution = SHIPPED["next_microbatch"]
    assert lab09.check_next_microbatch(stub).mistake == "stub"
    assert lab09.check_next_microbatch(solution).solved
    plain = lab09.check_next_microbatch(lambda b, f, m=1: max(f // 2, 1))
    assert plain.mistake == "plain_halving" and "below min_size" in plain.message  # batch 2, failed 2, min 2
    halving_above_min = lab09.check_next_microbatch(lambda b, f, m=1: f // 2 if f // 2 >= m else None)
    assert halving_above_min.mistake == "plain_halving" and "does not divide" in halving_above_min.message
    assert lab09.check_next_microbatch(lambda b, f, m=1: f).mistake == "no_step_down"
    assert lab09.check_next_microbatch(divisor_of_failed).mistake == "divides_failed"


def test_next_microbatch_names_the_rule_behind_every_case():
    # each answer is classified over all cases, not from the first case it gets wrong
    composer = lab09.check_next_microbatch(composer_halving)
    assert composer.mistake == "plain_halving", composer
    assert "do not divide the batch" in composer.message and "Composer" in composer.message
    no_min = lab09.check_next_microbatch(ignores_min_size)
    assert no_min.mistake == "ignores_min_size", no_min
    assert "below min_size" in no_min.message and "Plain halving" not in no_min.message
    to_min = lab09.check_next_microbatch(falls_back_to_min)
    assert to_min.mistake == "min_instead_of_none", to_min
    assert "return None" in to_min.message and "half of 2" in to_min.message
    assert "from 1 down to" not in to_min.message  # the empty range, worded sensibly
    below = lab09.check_next_microbatch(one_below_half)
    assert below.mistake == "one_below_half", below
    assert "half of" in below.message and "one below" in below.message
    up = lab09.check_next_microbatch(rounds_half_up)
    assert up.mistake == "rounds_half_up", up
    assert "half of" in up.message and "rounds" in up.message


def composer_halving(b, f, m=1):
    return max(f // 2, m)  # Composer's halving, floored at min_size: need not divide the batch


def ignores_min_size(b, f, m=1):
    for d in range(f // 2, 0, -1):  # down to 1, not to min_size
        if b % d == 0:
            return d
    return None


def one_below_half(b, f, m=1):
    for size in range(f // 2 - 1, m - 1, -1):  # starts one below half of the failed size
        if b % size == 0:
            return size
    return None


def rounds_half_up(b, f, m=1):
    for size in range((f + 1) // 2, m - 1, -1):  # half of an odd failed size rounded up
        if b % size == 0:
            return size
    return None


def falls_back_to_min(b, f, m=1):
    size = f // 2
    while size >= m:
        if b % size == 0:
            return size
        size -= 1
    return m  # nothing fits: should be None


def divisor_of_failed(b, f, m=1):
    size = f // 2
    while size >= m:
        if f % size == 0:  # divides the failed size, not the batch
            return size
        size -= 1
    return None


def test_next_microbatch_that_never_returns_is_named(monkeypatch):
    monkeypatch.setattr(lab09, "ANSWER_SECONDS", 0.5)

    def never_lowers(b, f, m=1):
        deadline = time.monotonic() + 30  # without the checker's limit this fails the test, not hangs it
        size = f // 2
        while size >= m and time.monotonic() < deadline:
            if b % size == 0:
                return size      # the size is never lowered: spins on the first size that does not divide
        return None

    verdict = lab09.check_next_microbatch(never_lowers)
    assert verdict.mistake == "never_returns", verdict
    assert "no answer within 0.5 s" in verdict.message


def test_fail_at_raises_at_the_nth_allocation_of_a_phase():
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))  # labels: "forward 0 start", ...
    x = torch.randn(4, 8)
    with pytest.raises(torch.OutOfMemoryError, match="allocation 1 of phase 'forward'"):
        with memory_budget(None, model=lin, fail_at=("forward", 1)) as tracker:
            lin(x)
    assert tracker.failures == 1 and tracker.failed_at.startswith("forward")
    with pytest.raises(ValueError, match="fail_at"):
        with memory_budget(None, fail_at=("forward", 0)):
            pass


def test_retry_above_counts_each_crossing():
    with memory_budget(None, retry_above=1000) as tracker:
        a = torch.zeros(200)      # 800 B: under the line
        b = torch.zeros(100)      # 1200 B in all: crosses once
        c = torch.zeros(100)      # still above: no new crossing
        del b, c
        d = torch.zeros(100)      # 800 + 400 = 1200 again: a second crossing
    assert tracker.alloc_retries == 2
    del a, d


def test_agreement_timeline_keeps_oom_sync_and_oom_flag_apart():
    from fsdp_lab.timeline import Event, Timeline

    merged = Timeline(rank=0, device="cpu")
    merged._events = [Event(0, "compute", "f", 0, 0.0, 1.0, args={"phase": "forward"}),
                      Event(0, "comm", "oom_sync", 8, 1.0, 1.2, "comm"),
                      Event(1, "comm", "oom_flag", 4, 1.5, 1.6, "comm")]
    fig = lab09.plot_agreement_timeline(merged, oom_time=0.5, retry_time=1.3)
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["forward", "oom_flag", "oom_sync", "OOM on rank 1",
                                                          "retry starts (rank 0)"]
    colours = [tuple(h.get_facecolor()) for h in legend.legend_handles[:3]]
    assert len(set(colours)) == 3
