"""Lab 01's checkers hold answers to the exercises' rules, even when the values are right.

Reduce-scatter: only ``collectives.all_reduce`` may run, and the input ``t`` is left alone (the
all-reduce works on a copy). All-reduce: only ``collectives.reduce_scatter_tensor`` and
``collectives.all_gather_into_tensor`` may run, and they must send what a ring all-reduce sends, so
a sum through ``torch.distributed`` itself or a local sum of gathered whole tensors fails. The
shipped solutions and a correct different answer pass. (The other verdicts of lab 01 are in
test_workshop_labs.py.)
"""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.workshop import lab01
from test_workshop_labs import Lab01Launch, Shipped

LAB01 = Shipped("01_collectives")


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


@pytest.fixture(scope="module")
def lab01_launch():
    solution = LAB01["my_reduce_scatter"][1]
    cases = [(solution, "reduce_scatter"), (reduce_scatter_itself, "reduce_scatter"),
             (all_reduce_in_place, "reduce_scatter"), (torch_all_reduce, "reduce_scatter"), (torch_all_reduce_in_place, "all_reduce"),
             (gather_whole_and_sum, "all_reduce"), (sum_without_return, "all_reduce"),
             (in_two_parts, "all_reduce"), (dummy_collectives_beside_torch, "all_reduce")]
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
