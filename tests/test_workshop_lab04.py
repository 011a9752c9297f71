"""Lab 04's checkers fed the shipped stub, the shipped solution and typical wrong answers.

``check_rank_shard`` runs in this process against FSDP1's arithmetic (and, here, against the
shards 3 real FSDP1 ranks hold for one block); ``check_reduce_flat_grad``'s answers all run in
one shared launch and are compared with the sharded gradient fsdp_lab's FSDP1 computes, and
their collectives must be reduce-scatters. The widget's controls offer HYBRID_SHARD only on
worlds it can split.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdp_lab
from fsdp_lab import collectives
from fsdp_lab.workshop import lab04
from test_workshop_labs import SharedLaunch, Shipped, refuse_launch

LAB04 = Shipped("04_fsdp1_flat_parameters")


# ----------------------------------------------------------------------------- rank_shard

def no_padding(params, world, rank):
    flat = torch.cat([p.reshape(-1) for p in params])
    shard = math.ceil(flat.numel() / world)
    return flat[rank * shard:(rank + 1) * shard]


def floor_shard(params, world, rank):
    flat = torch.cat([p.reshape(-1) for p in params])
    shard = flat.numel() // world
    return flat[rank * shard:(rank + 1) * shard]


def next_rank(params, world, rank):
    flat = torch.cat([p.reshape(-1) for p in params])
    shard = math.ceil(flat.numel() / world)
    flat = torch.cat([flat, flat.new_zeros(shard * world - flat.numel())])
    rank = (rank + 1) % world
    return flat[rank * shard:(rank + 1) * shard]


def padding_first(params, world, rank):
    flat = torch.cat([p.reshape(-1) for p in params])
    shard = math.ceil(flat.numel() / world)
    flat = torch.cat([flat.new_zeros(shard * world - flat.numel()), flat])
    return flat[rank * shard:(rank + 1) * shard]


def padded_with_ones(params, world, rank):
    flat = torch.cat([p.reshape(-1) for p in params])
    shard = math.ceil(flat.numel() / world)
    flat = torch.cat([flat, flat.new_ones(shard * world - flat.numel())])
    return flat[rank * shard:(rank + 1) * shard]


def _block_shards():
    import torch.distributed as dist

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy
    from fsdp_lab.models.llama import Llama, TransformerBlock

    model = FSDP(Llama("cpu", seed=0), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    (handle,) = [h for u in model.modules() if isinstance(u, FSDP) for h in u._handles
                 if h.unit_name == "layers.0"]
    return dist.get_rank(), handle.flat_shard.detach().clone()


@pytest.fixture(scope="module")
def real_block():
    from fsdp_lab.models.llama import Llama

    shards = dict(fsdp_lab.launch(_block_shards, world_size=3, timeout=300))
    return shards, list(Llama("cpu", seed=0).layers[0].parameters())


def padded_chunk(params, world, rank):
    """Pads each chunk to ceil(total / world), but torch.chunk gives short tensors fewer pieces."""
    flat = torch.cat([p.reshape(-1) for p in params])
    size = -(-flat.numel() // world)
    piece = flat.chunk(world)[rank]
    return torch.cat([piece, piece.new_zeros(size - piece.numel())])


def two_dims_only(params, world, rank):
    """Flattens each parameter as if it were 2-D: a 1-D one raises IndexError (no shape[1])."""
    flat = torch.cat([p.reshape(p.shape[0] * p.shape[1]) for p in params])
    shard = math.ceil(flat.numel() / world)
    flat = torch.cat([flat, flat.new_zeros(shard * world - flat.numel())])
    return flat[rank * shard:(rank + 1) * shard]


def test_rank_shard_verdicts(real_block):
    shards, params = real_block
    stub, solution = LAB04["rank_shard"]
    assert lab04.check_rank_shard(stub, real_shards=shards, params=params).mistake == "stub"
    right = lab04.check_rank_shard(solution, real_shards=shards, params=params)
    # one block: 184,576 elements; 3 ranks -> ceil = 61,526 each, 184,578 padded, 2 zeros
    assert right.solved and "184,576 elements, padded to 184,578 (2 zeros" in right.message
    assert lab04.check_rank_shard(solution).solved
    assert lab04.check_rank_shard(no_padding).mistake == "no_padding"
    assert lab04.check_rank_shard(floor_shard).mistake == "floor_shard"
    assert lab04.check_rank_shard(next_rank).mistake == "wrong_rank"
    assert lab04.check_rank_shard(padding_first).mistake == "padding_first"
    ones = lab04.check_rank_shard(padded_with_ones)
    assert ones.mistake == "padding_not_zero" and "padding holds 1 for" in ones.message
    assert lab04.check_rank_shard(padded_chunk).mistake == "short_chunks"
    verdict = lab04.check_rank_shard(two_dims_only)
    assert verdict.mistake == "raised" and "IndexError" in verdict.message and "1-D" in verdict.message


def test_reference_shard_matches_a_hand_worked_case():
    # 3 + 4 elements on 3 ranks: padded to 9, 3 per rank; rank 2 holds [a3? no: b1, b2, b3] + ...
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0])
    assert lab04.reference_shard([a, b], 3, 0).tolist() == [1.0, 2.0, 3.0]
    assert lab04.reference_shard([a, b], 3, 1).tolist() == [4.0, 5.0, 6.0]
    assert lab04.reference_shard([a, b], 3, 2).tolist() == [7.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- reduce_flat_grad

def not_averaged(flat_grad):
    import torch.distributed as dist
    shard = torch.empty(flat_grad.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, flat_grad)
    return shard


def all_reduced(flat_grad):
    import torch.distributed as dist
    collectives.all_reduce(flat_grad)
    return flat_grad / dist.get_world_size()


def own_piece(flat_grad):
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    n = flat_grad.numel() // world
    return flat_grad[rank * n:(rank + 1) * n] / 1.0


def all_reduced_then_sliced(flat_grad):
    """The right shard, cut out of an all-reduce: twice a reduce-scatter's traffic."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    collectives.all_reduce(flat_grad, op="avg")
    n = flat_grad.numel() // world
    return flat_grad[rank * n:(rank + 1) * n].clone()


def averaged_by_the_collective(flat_grad):
    """Right, and different from the shipped solution: the reduce-scatter averages."""
    import torch.distributed as dist
    shard = torch.empty(flat_grad.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, flat_grad, op="avg")
    return shard


def two_ranks_hard_coded(flat_grad):
    """Right on 2 ranks only: the world size is written in."""
    shard = torch.empty(flat_grad.numel() // 2)
    collectives.reduce_scatter_tensor(shard, flat_grad)
    return shard / 2


def averaged_twice(flat_grad):
    import torch.distributed as dist
    shard = torch.empty(flat_grad.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, flat_grad, op="avg")
    return shard / dist.get_world_size()              # avg already divided


def not_waited_on(flat_grad):
    """Reduce-scatters asynchronously and divides before the handle is waited on (never)."""
    import torch.distributed as dist
    shard = torch.empty(flat_grad.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, flat_grad, async_op=True)
    return shard / dist.get_world_size()


@pytest.fixture(scope="module")
def lab04_launch():
    solution = LAB04["reduce_flat_grad"][1]
    cases = [(solution,), (not_averaged,), (all_reduced,), (own_piece,), (all_reduced_then_sliced,),
             (averaged_by_the_collective,), (two_ranks_hard_coded,), (not_waited_on,), (averaged_twice,)]
    return SharedLaunch(lab04._reduce_case, cases, world_size=lab04.REDUCE_WORLD)


@pytest.fixture(scope="module")
def lab04_other_world():
    """The answers right on 2 ranks, run again on another world size (the checker's second launch)."""
    solution = LAB04["reduce_flat_grad"][1]
    cases = [(solution,), (averaged_by_the_collective,), (two_ranks_hard_coded,)]
    return SharedLaunch(lab04._reduce_other_world, cases, world_size=lab04.OTHER_WORLD)


def test_reduce_flat_grad_verdicts(lab04_launch, lab04_other_world, monkeypatch):
    stub, solution = LAB04["reduce_flat_grad"]
    monkeypatch.setattr(lab04, "launch", refuse_launch)
    assert lab04.check_reduce_flat_grad(stub).mistake == "stub"

    def launch(fn, *args, **kwargs):
        shared = lab04_launch if fn is lab04._reduce_case else lab04_other_world
        return shared.launch(fn, *args, **kwargs)

    monkeypatch.setattr(lab04, "launch", launch)
    right = lab04.check_reduce_flat_grad(solution)
    assert right.solved and "divided" not in right.message and "world size 2" in right.message
    assert lab04.check_reduce_flat_grad(not_averaged).mistake == "not_averaged"
    assert lab04.check_reduce_flat_grad(not_waited_on).mistake == "not_waited"
    assert lab04.check_reduce_flat_grad(averaged_twice).mistake == "averaged_twice"
    assert lab04.check_reduce_flat_grad(all_reduced).mistake == "whole_gradient"
    assert lab04.check_reduce_flat_grad(own_piece).mistake == "not_reduced"
    assert lab04.check_reduce_flat_grad(all_reduced_then_sliced).mistake == "not_reduce_scatter"
    assert lab04.check_reduce_flat_grad(averaged_by_the_collective).solved
    assert lab04.check_reduce_flat_grad(two_ranks_hard_coded).mistake == "fixed_world"


# ----------------------------------------------------------------------------- widget

def test_widget_offers_hybrid_shard_only_on_worlds_it_splits(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert lab04.world_sizes("FULL_SHARD") == [1, 2, 4]
    assert lab04.world_sizes("HYBRID_SHARD") == [4]          # 1 and 2 ranks do not split in groups of 2
    assert lab04.world_sizes("HYBRID_SHARD", (3, 6, 9)) == [6, 9]
    controls = lab04.explorer_controls()
    assert controls["world_size"].value == 2
    controls["strategy"].value = "HYBRID_SHARD"
    assert tuple(controls["world_size"].options) == (4,) and controls["world_size"].value == 4
    controls["strategy"].value = "NO_SHARD"
    assert tuple(controls["world_size"].options) == (1, 2, 4) and controls["world_size"].value == 4


def test_the_gathered_units_map_starts_at_zero_and_says_when_nothing_is_gathered():
    # NO_SHARD (or one rank) gathers nothing: the map once read -0.1 to 0.1 MiB of a uniform blue
    import matplotlib.pyplot as plt

    from fsdp_lab.timeline import Timeline

    with Timeline() as timeline:
        with timeline.span("forward"):
            pass
    samples = [(f"forward layers.{i} start", {"root": 0, "layers.0": 0}, {"sharded_params": 2**20}) for i in range(3)]
    fig = lab04.draw_step([{"timeline": timeline, "samples": samples}], "NO_SHARD")
    heat = fig.axes[1]
    assert heat.images[0].get_clim()[0] == 0
    assert any("nothing is gathered" in t.get_text() for t in heat.texts)
    gathered = [(label, {"root": 2**20, "layers.0": 0}, memory) for label, _, memory in samples]
    fig = lab04.draw_step([{"timeline": timeline, "samples": gathered}], "FULL_SHARD")
    assert fig.axes[1].images[0].get_clim() == (0, 1.0) and not fig.axes[1].texts
    plt.close("all")
