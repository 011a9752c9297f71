"""Lab 01's checkers hold answers to the exercises' rules, even when the values are right.

Reduce-scatter: only ``collectives.all_reduce`` may run, and the input ``t`` is left alone (the
all-reduce works on a copy). All-reduce: only ``collectives.reduce_scatter_tensor`` and
``collectives.all_gather_into_tensor`` may run, and they must send what a ring all-reduce sends, so
a sum through ``torch.distributed`` itself or a local sum of gathered whole tensors fails. The
shipped solutions and a correct different answer pass. The verdicts of the usual wrong answers,
and of answers right at 4 ranks only, follow (``Lab01Launch``: one shared launch per world size).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.workshop import lab01
from test_workshop_labs import SharedLaunch, Shipped, refuse_launch

LAB01 = Shipped("01_collectives")

class Lab01Launch:
    """Lab 01's checkers run a right answer once more on SMALL_WORLD ranks: one SharedLaunch
    per world size, each checker launch answered from the one of its size."""

    def __init__(self, cases: list[tuple], small_cases: list[tuple]):
        self.shared = {lab01.WORLD: SharedLaunch(lab01._run, cases, world_size=lab01.WORLD),
                       lab01.SMALL_WORLD: SharedLaunch(lab01._run, [(*c, lab01.SMALL_PER_RANK) for c in small_cases],
                                                       world_size=lab01.SMALL_WORLD)}

    def launch(self, fn, *case, world_size, **kwargs):
        return self.shared[world_size].launch(fn, *case, world_size=world_size, **kwargs)


def reduce_scatter_itself(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t.clone())
    return shard


def all_reduce_in_place(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    collectives.all_reduce(t)                       # t itself now holds the sum
    return t[rank * k:(rank + 1) * k].clone()


def torch_all_reduce(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    total = t.clone()
    dist.all_reduce(total)                          # not through fsdp_lab: no timeline event
    return total[rank * k:(rank + 1) * k]


def torch_all_reduce_in_place(t):
    import torch.distributed as dist
    dist.all_reduce(t)                              # right sum, but no recorded collective
    return t


def gather_whole_and_sum(t):
    import torch.distributed as dist
    n = dist.get_world_size()
    everything = torch.empty(n * t.numel())
    collectives.all_gather_into_tensor(everything, t)
    t.copy_(everything.view(n, -1).sum(0))          # right sum, n times the traffic
    return t


def sum_without_return(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t)
    collectives.all_gather_into_tensor(t, shard)    # t is right; the function returns None


def in_two_parts(t):
    import torch.distributed as dist
    n = dist.get_world_size()
    for part in (t[:2 * n], t[2 * n:]):             # an all-reduce of each part, async
        shard = torch.empty(part.numel() // n)
        collectives.reduce_scatter_tensor(shard, part.clone(), async_op=True).wait()
        gathered = torch.empty_like(part)
        collectives.all_gather_into_tensor(gathered, shard)
        part.copy_(gathered)
    return t


def dummy_collectives_beside_torch(t):
    import torch.distributed as dist
    n = dist.get_world_size()
    dist.all_reduce(t)                              # the sum, not recorded
    shard = torch.empty(1)
    collectives.reduce_scatter_tensor(shard, torch.zeros(n))
    collectives.all_gather_into_tensor(torch.empty(n), shard)
    return t


def all_gather_not_waited(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t.clone())
    gathered = torch.empty_like(t)
    collectives.all_gather_into_tensor(gathered, shard, async_op=True)   # the handle is dropped
    t.copy_(gathered)
    return t


def all_reduce_not_waited(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    total = t.clone()
    collectives.all_reduce(total, async_op=True)     # the handle is dropped
    return total[rank * k:(rank + 1) * k]


@pytest.fixture(scope="module")
def lab01_launch():
    solution = LAB01["my_reduce_scatter"][1]
    cases = [(solution, "reduce_scatter"), (reduce_scatter_itself, "reduce_scatter"),
             (all_reduce_in_place, "reduce_scatter"), (torch_all_reduce, "reduce_scatter"), (torch_all_reduce_in_place, "all_reduce"),
             (gather_whole_and_sum, "all_reduce"), (sum_without_return, "all_reduce"),
             (in_two_parts, "all_reduce"), (dummy_collectives_beside_torch, "all_reduce"),
             (all_gather_not_waited, "all_reduce"), (all_reduce_not_waited, "reduce_scatter")]
    return Lab01Launch(cases, [(solution, "reduce_scatter"), (in_two_parts, "all_reduce")])


def test_right_chunks_pass_only_within_the_rules(lab01_launch, monkeypatch):
    monkeypatch.setattr(lab01, "launch", lab01_launch.launch)
    right = lab01.check_my_reduce_scatter(LAB01["my_reduce_scatter"][1])
    assert right.solved and "2x the traffic" in right.message

    # each answer below returns every rank's correct chunk, yet breaks a rule of the exercise
    direct = lab01.check_my_reduce_scatter(reduce_scatter_itself)
    assert direct.mistake == "used_other_collective" and not direct.solved
    assert "1 reduce_scatter" in direct.message and "all_reduce alone" in direct.message
    assert "t.clone()" in direct.hint

    in_place = lab01.check_my_reduce_scatter(all_reduce_in_place)
    assert in_place.mistake == "changed_t" and not in_place.solved
    assert "changed its input t" in in_place.message and "t.clone()" in in_place.hint

    unseen = lab01.check_my_reduce_scatter(torch_all_reduce)
    assert unseen.mistake == "no_all_reduce" and not unseen.solved


def test_all_reduce_passes_only_through_the_two_collectives(lab01_launch, monkeypatch):
    monkeypatch.setattr(lab01, "launch", lab01_launch.launch)
    # 12 float32 = 48 bytes; a ring all-reduce sends 2 * 3/4 * 48 = 72 bytes per rank
    parts = lab01.check_my_all_reduce(in_two_parts)
    assert parts.solved and "48 bytes in 2 reduce-scatters and 48 in 2 all-gathers" in parts.message
    assert "72 bytes sent per rank" in parts.message

    # each answer below leaves the right sum in t, yet breaks a rule of the exercise
    unseen = lab01.check_my_all_reduce(torch_all_reduce_in_place)
    assert unseen.mistake == "no_collective" and not unseen.solved
    assert "0 bytes" not in unseen.message

    local = lab01.check_my_all_reduce(gather_whole_and_sum)
    assert local.mistake == "no_reduce_scatter" and not local.solved
    assert "sent 144 bytes per rank" in local.message and "sends 72" in local.message

    hidden = lab01.check_my_all_reduce(dummy_collectives_beside_torch)
    assert hidden.mistake == "wire_bytes" and not hidden.solved
    assert "not recorded" in hidden.message

    none = lab01.check_my_all_reduce(sum_without_return)
    assert none.mistake == "returned_none" and "return t" in none.hint


def test_a_collective_not_waited_on_is_named(lab01_launch, monkeypatch):
    monkeypatch.setattr(lab01, "launch", lab01_launch.launch)
    gathered = lab01.check_my_all_reduce(all_gather_not_waited)
    assert gathered.mistake == "not_waited" and "issued all_gather with async_op=True" in gathered.message
    summed = lab01.check_my_reduce_scatter(all_reduce_not_waited)
    assert summed.mistake == "not_waited" and "issued all_reduce with async_op=True" in summed.message


# ----------------------------------------------------------------------------- lab 01


def averaged_all_reduce(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t, op="avg")
    collectives.all_gather_into_tensor(t, shard)
    return t


def shard_only(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t)
    return shard


def all_reduce_itself(t):
    collectives.all_reduce(t)
    return t


def first_chunk_everywhere(t):
    import torch.distributed as dist
    k = t.numel() // dist.get_world_size()
    total = t.clone()
    collectives.all_reduce(total)
    return total[:k]


def own_chunk_unreduced(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    collectives.all_reduce(t.clone())
    return t[rank * k:(rank + 1) * k].clone()


def next_chunk(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    total = t.clone()
    collectives.all_reduce(total)
    return total[(rank + 1) * k:(rank + 2) * k]      # off by one: the last rank gets nothing


def last_chunk_short(t):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    k = t.numel() // world
    total = t.clone()
    collectives.all_reduce(total)
    return total[rank * k:(rank + 1) * k - (rank == world - 1)]   # the last rank drops an element


def own_slice_reduced(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    mine = t[rank * k:(rank + 1) * k].clone()
    collectives.all_reduce(mine)                     # adds the ranks' different slices together
    return mine


def all_reduce_for_four(t):
    shard = torch.empty(t.numel() // 4, dtype=t.dtype)   # the world size of the check, fixed
    collectives.reduce_scatter_tensor(shard, t)
    collectives.all_gather_into_tensor(t, shard)
    return t


def reduce_scatter_for_four(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // 4            # the world size of the check, fixed
    total = t.clone()
    collectives.all_reduce(total)
    return total[rank * k:(rank + 1) * k]




@pytest.fixture(scope="module")
def verdicts_launch():
    ar, rs = LAB01["my_all_reduce"][1], LAB01["my_reduce_scatter"][1]
    right = [(ar, "all_reduce"), (all_reduce_for_four, "all_reduce"), (rs, "reduce_scatter"),
             (reduce_scatter_for_four, "reduce_scatter")]
    cases = right + [(averaged_all_reduce, "all_reduce"), (shard_only, "all_reduce"),
                     (all_reduce_itself, "all_reduce"), (first_chunk_everywhere, "reduce_scatter"),
                     (own_chunk_unreduced, "reduce_scatter"), (next_chunk, "reduce_scatter"),
                     (last_chunk_short, "reduce_scatter"), (own_slice_reduced, "reduce_scatter")]
    return Lab01Launch(cases, right)


def test_my_all_reduce_verdicts(verdicts_launch, monkeypatch):
    stub, solution = LAB01["my_all_reduce"]
    monkeypatch.setattr(lab01, "launch", refuse_launch)
    assert lab01.check_my_all_reduce(stub).mistake == "stub"
    monkeypatch.setattr(lab01, "launch", verdicts_launch.launch)
    right = lab01.check_my_all_reduce(solution)
    # 12 float32 = 48 bytes; a ring sends (n-1)/n of it twice: 2 * 3/4 * 48 = 72 per rank
    assert right.solved and "72 bytes sent per rank" in right.message
    assert lab01.check_my_all_reduce(averaged_all_reduce).mistake == "averaged"
    assert lab01.check_my_all_reduce(shard_only).mistake == "returned_shard"
    assert lab01.check_my_all_reduce(all_reduce_itself).mistake == "used_all_reduce"
    # right on the check's 4 ranks, but the 4 is written into the answer
    fixed = lab01.check_my_all_reduce(all_reduce_for_four)
    assert fixed.mistake == "fixed_world_size", fixed
    assert "not on 2 ranks with 10 elements" in fixed.message and "dist.get_world_size()" in fixed.hint


def test_my_reduce_scatter_verdicts(verdicts_launch, monkeypatch):
    stub, solution = LAB01["my_reduce_scatter"]
    monkeypatch.setattr(lab01, "launch", refuse_launch)
    assert lab01.check_my_reduce_scatter(stub).mistake == "stub"
    monkeypatch.setattr(lab01, "launch", verdicts_launch.launch)
    right = lab01.check_my_reduce_scatter(solution)
    # the all-reduce sends 2 * 3/4 * 48 = 72 bytes; a real reduce-scatter 3/4 * 48 = 36
    assert right.solved and "sent 72 bytes per rank where a real reduce-scatter" in right.message
    assert "sends 36: 2x the traffic" in right.message
    assert lab01.check_my_reduce_scatter(first_chunk_everywhere).mistake == "wrong_chunk"
    assert lab01.check_my_reduce_scatter(own_chunk_unreduced).mistake == "not_reduced"
    shifted = lab01.check_my_reduce_scatter(next_chunk)
    assert shifted.mistake == "wrong_chunk", shifted
    assert "rank 0 returned the chunk of rank 1 (and rank 3 returned 0 elements)" in shifted.message
    short = lab01.check_my_reduce_scatter(last_chunk_short)
    assert short.mistake == "wrong_size" and "rank 3 returned 2 elements" in short.message, short
    own = lab01.check_my_reduce_scatter(own_slice_reduced)
    assert own.mistake == "reduced_own_slice" and "only your slice" in own.message, own
    fixed = lab01.check_my_reduce_scatter(reduce_scatter_for_four)
    assert fixed.mistake == "fixed_world_size", fixed
    assert "rank 0 returned 2 elements where a chunk has 5" in fixed.message
