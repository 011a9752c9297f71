"""Lab 01's reduce-scatter checker holds answers to the exercise's two rules: only
``collectives.all_reduce`` may run, and the input ``t`` is left alone (the all-reduce works on a
copy). The shipped solution passes; an answer breaking either rule is named, even when the chunk it
returns is right. (The other verdicts of lab 01 are in test_workshop_labs.py.)
"""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.workshop import lab01
from test_workshop_labs import SharedLaunch, shipped

LAB01 = shipped("01_collectives")


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


@pytest.fixture(scope="module")
def lab01_launch():
    solution = LAB01["my_reduce_scatter"][1]
    cases = [(solution, "reduce_scatter"), (reduce_scatter_itself, "reduce_scatter"),
             (all_reduce_in_place, "reduce_scatter"), (torch_all_reduce, "reduce_scatter")]
    return SharedLaunch(lab01._run, cases, world_size=lab01.WORLD)


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
