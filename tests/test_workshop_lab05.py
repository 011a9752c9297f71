"""Lab 05's checkers fed the shipped stub, the shipped solution and typical wrong answers.

``check_shard_param`` runs in this process against ``torch.chunk`` plus padding (and the
padded shards fsdp_lab's ``fully_shard`` gives a 5x3 weight on 4 ranks, measured here);
``check_pre_forward``'s answers run in one shared launch and are compared with the same
``nn.Linear`` computed in one process, and their collectives must be all-gathers.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdp_lab
from fsdp_lab import collectives
from fsdp_lab.workshop import lab05
from test_workshop_labs import SharedLaunch, Shipped, refuse_launch

LAB05 = Shipped("05_fsdp2_per_parameter")


# ----------------------------------------------------------------------------- shard_param

def unpadded(param, world, rank):
    chunks = torch.chunk(param, world, dim=0)
    return chunks[rank] if rank < len(chunks) else param[:0]


def floor_rows(param, world, rank):
    rows = param.shape[0] // world
    return param[rank * rows:(rank + 1) * rows]


def split_evenly(param, world, rank):
    rows = math.ceil(param.shape[0] / world)
    mine = torch.tensor_split(param, world, dim=0)[rank]   # 2, 1, 1, 1 rows of 5 where chunk gives 2, 2, 1, 0
    return torch.cat([mine, param.new_zeros((rows - mine.shape[0], *param.shape[1:]))])


def padding_on_top(param, world, rank):
    rows = math.ceil(param.shape[0] / world)
    mine = param[rank * rows:(rank + 1) * rows]
    return torch.cat([param.new_zeros((rows - mine.shape[0], *param.shape[1:])), mine])


def _fully_shard_5x3():
    import torch.distributed as dist
    import torch.nn as nn

    from fsdp_lab.fsdp2 import fully_shard

    torch.manual_seed(0)
    layer = nn.Linear(3, 5)
    full = layer.weight.detach().clone()
    fully_shard(layer)
    padded = layer._fsdp_state.group.fsdp_params[0]._sharded_data
    return dist.get_rank(), full, layer.weight.to_local().shape[0], padded.clone()


def padded_chunk(param, world, rank):
    """Pads its chunk to ceil(rows / world), but torch.chunk gives short tensors fewer pieces."""
    rows = -(-param.shape[0] // world)
    piece = torch.chunk(param, world, dim=0)[rank]
    return torch.cat([piece, piece.new_zeros((rows - piece.shape[0], *param.shape[1:]))])


def two_dims_only(param, world, rank):
    """Right for 2-D parameters; a 1-D one has no shape[1] (IndexError)."""
    rows = math.ceil(param.shape[0] / world)
    chunks = torch.chunk(param, world, dim=0)
    padded = param.new_zeros(rows, param.shape[1])
    if rank < len(chunks):
        padded[:chunks[rank].shape[0]] = chunks[rank]
    return padded


def test_shard_param_verdicts():
    stub, solution = LAB05["shard_param"]
    assert lab05.check_shard_param(stub).mistake == "stub"
    ranks = fsdp_lab.launch(_fully_shard_5x3, world_size=4, timeout=300)
    weight = ranks[0][1]
    real = {rank: padded for rank, _, _, padded in ranks}
    # 5 rows on 4 ranks: ceil = 2 rows each; real rows 2, 2, 1, 0; every storage 2 x 3 = 6 floats
    assert [rows for _, _, rows, _ in ranks] == [2, 2, 1, 0]
    assert all(padded.shape == (2, 3) for padded in real.values())
    right = lab05.check_shard_param(solution, real=real, param=weight)
    assert right.solved and "[2, 2, 1, 0] real rows" in right.message
    assert "every piece of 24 parameters x worlds" in right.message
    # a shard that differs from what fully_shard holds (here: one value of rank 2's) is caught
    altered = {rank: padded.clone() for rank, padded in real.items()}
    altered[2][0, 0] += 1.0
    assert lab05.check_shard_param(solution, real=altered, param=weight).mistake == "differs_from_fully_shard"
    assert lab05.check_shard_param(unpadded).mistake == "no_padding"
    assert lab05.check_shard_param(floor_rows).mistake == "floor_rows"
    assert lab05.check_shard_param(padding_on_top).mistake == "padding_first"
    split = lab05.check_shard_param(split_evenly)
    assert split.mistake == "tensor_split" and "[2, 1, 1, 1] per rank" in split.message
    assert "[2, 2, 1, 0]" in split.message
    assert lab05.check_shard_param(padded_chunk).mistake == "short_chunks"
    verdict = lab05.check_shard_param(two_dims_only)
    assert verdict.mistake == "raised" and "IndexError" in verdict.message and "1-D" in verdict.message
    assert lab05.check_shard_param(lambda param, world, rank: param).mistake == "whole_param"
    assert lab05.check_shard_param(lambda param, world, rank: param[:, :2]).mistake == "wrong_dim"


# ----------------------------------------------------------------------------- pre_forward

def kept_padding(module, args):
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered)


def own_shard_only(module, args):
    for name, shard in module.shards.items():
        setattr(module, name, shard)


def reversed_ranks(module, args):
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard)
        pieces = gathered.split(shard.shape[0])
        setattr(module, name, torch.cat(pieces[::-1])[:module.rows[name]])


def all_reduced_pieces(module, args):
    """The right weights, by an all-reduce of zero tensors that hold only this rank's rows."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, shard in module.shards.items():
        whole = torch.zeros(world * shard.shape[0], *shard.shape[1:])
        whole[rank * shard.shape[0]:(rank + 1) * shard.shape[0]] = shard
        collectives.all_reduce(whole)
        setattr(module, name, whole[:module.rows[name]])


def gathered_around_collectives(module, args):
    """The right weights from torch.distributed directly, which the check cannot see."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        dist.all_gather_into_tensor(gathered, shard.contiguous())
        setattr(module, name, gathered[:module.rows[name]])


def one_gather_for_both(module, args):
    """Right, and different from the shipped solution: one all-gather for both parameters
    (copy-in, collective, copy-out, as fully_shard does for a group)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    names = list(module.shards)
    flat = torch.cat([module.shards[n].reshape(-1) for n in names])
    gathered = torch.empty(world * flat.numel())
    collectives.all_gather_into_tensor(gathered, flat)
    per_rank = gathered.view(world, -1).split([module.shards[n].numel() for n in names], dim=1)
    for name, column in zip(names, per_rank):
        shard = module.shards[name]
        setattr(module, name, column.reshape(world * shard.shape[0], *shard.shape[1:])[:module.rows[name]])


def output_one_shard_long(module, args):
    """Forgets the world size in the output: the all-gather raises before module.weight is set."""
    for name, shard in module.shards.items():
        gathered = torch.empty(shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered[:module.rows[name]])


def stacked_output(module, args):
    """Right: all-gathers into (world, rows, ...), the form NCCL also takes, then reshapes it."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world, *shard.shape)
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered.reshape(-1, *shard.shape[1:])[:module.rows[name]])


def flat_output(module, args):
    """Right: all-gathers into a flat buffer, as lab 03's ZeRO stages do, then views it."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        flat = torch.empty(world * shard.numel())
        collectives.all_gather_into_tensor(flat, shard.contiguous())
        setattr(module, name, flat.view(world * shard.shape[0], *shard.shape[1:]).narrow(0, 0, module.rows[name]))


def stacked_rows_kept(module, args):
    """Stacks the shards, (world, rows, ...), and keeps its first entries as if they were rows."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world, *shard.shape)
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered[:module.rows[name]])


def half_the_rows(module, args):
    """Keeps 4 of the 8 gathered rows (the weight has 7): the layer computes 4 outputs."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered[:gathered.shape[0] // 2])


def last_rows(module, args):
    """Keeps the last 7 rows: drops the first real row and keeps the padding row."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard)
        setattr(module, name, gathered[-module.rows[name]:])


def gather_not_waited(module, args):
    """Sets the weights from all-gathers whose handles are never waited on."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for name, shard in module.shards.items():
        gathered = torch.empty(world * shard.shape[0], *shard.shape[1:])
        collectives.all_gather_into_tensor(gathered, shard, async_op=True)
        setattr(module, name, gathered[:module.rows[name]])


@pytest.fixture(scope="module")
def lab05_launch():
    solution = LAB05["pre_forward"][1]
    cases = [(solution,), (kept_padding,), (own_shard_only,), (reversed_ranks,), (all_reduced_pieces,),
             (gathered_around_collectives,), (one_gather_for_both,), (output_one_shard_long,),
             (half_the_rows,), (last_rows,), (stacked_output,), (flat_output,), (stacked_rows_kept,),
             (gather_not_waited,)]
    return SharedLaunch(lab05._hook_case, cases, world_size=lab05.HOOK_WORLD)


def test_pre_forward_verdicts(lab05_launch, monkeypatch):
    stub, solution = LAB05["pre_forward"]
    monkeypatch.setattr(lab05, "launch", refuse_launch)
    assert lab05.check_pre_forward(stub).mistake == "stub"
    monkeypatch.setattr(lab05, "launch", lab05_launch.launch)
    right = lab05.check_pre_forward(solution)
    assert right.solved and "7 rows from 4 padded shards of 2, 1 padding row dropped" in right.message
    assert lab05.check_pre_forward(kept_padding).mistake == "kept_padding"
    assert lab05.check_pre_forward(own_shard_only).mistake == "not_gathered"
    assert lab05.check_pre_forward(reversed_ranks).mistake == "wrong_order"
    assert lab05.check_pre_forward(all_reduced_pieces).mistake == "not_all_gather"
    assert lab05.check_pre_forward(gathered_around_collectives).mistake == "no_collective"
    assert lab05.check_pre_forward(one_gather_for_both).solved
    raised = lab05.check_pre_forward(output_one_shard_long)
    assert raised.mistake == "hook_raised" and "before setting module.weight" in raised.message
    assert lab05.check_pre_forward(half_the_rows).mistake == "wrong_rows"
    assert lab05.check_pre_forward(last_rows).mistake == "dropped_first_rows"
    assert lab05.check_pre_forward(stacked_output).solved
    assert lab05.check_pre_forward(flat_output).solved
    assert lab05.check_pre_forward(gather_not_waited).mistake == "not_waited"
    stacked = lab05.check_pre_forward(stacked_rows_kept)
    assert stacked.mistake == "stacked_output" and "shape (4, 2, 5)" in stacked.message


def test_reference_shard_is_chunk_plus_zero_rows():
    param = torch.arange(10.0).reshape(5, 2)
    assert lab05.reference_shard(param, 4, 2).tolist() == [[8.0, 9.0], [0.0, 0.0]]
    assert lab05.reference_shard(param, 4, 3).tolist() == [[0.0, 0.0], [0.0, 0.0]]
