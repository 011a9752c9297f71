"""HSDP under fsdp_lab's FSDP2: a 2-D mesh (replicate x shard) on 4 real gloo ranks.

Parameters are sharded over the mesh's shard dim (2 ranks) and replicated over its replicate
dim (2 replicas); gradients are reduce-scattered within a shard group and then averaged over
the replicas. One launch trains the same model under fsdp_lab's ``fully_shard`` and under
PyTorch's own ``torch.distributed.fsdp.fully_shard`` with the same mesh; the references are
PyTorch's run and single-process training on the same global batches (a QLoRA model too).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig
from fsdp_lab.qlora import NF4Tensor, apply_lora
from _torch_reference import TORCH_FSDP2_ON_CPU, needs_torch_fsdp2_on_cpu

WORLD, REPLICAS, SHARDS = 4, 2, 2
STEPS, GLOBAL_BATCH, SEQ, LR = 3, 8, 16, 5e-3


def _model(qlora=False):
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    if qlora:
        torch.manual_seed(0)
        apply_lora(model, rank=8, alpha=16, quantize_base=True)
    return model


def _train(model, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=1e-4)
    losses = []
    for step in range(STEPS):
        batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=step), rank, world)
        loss = model(batch.input_ids, batch.labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def _groups_used():
    """{(collective, ranks of its group)} of fsdp_lab's all-gathers, reduce-scatters and all-reduces
    (the module attributes fsdp_lab.fsdp2 calls) inside the block."""
    import torch.distributed as dist

    from fsdp_lab import collectives

    seen = set()
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    originals = {name: getattr(collectives, name) for name in names}

    def recording(name):
        def call(*args, group=None, **kwargs):
            seen.add((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD))))
            return originals[name](*args, group=group, **kwargs)
        return call

    for name in names:
        setattr(collectives, name, recording(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)


def _rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict
    from fsdp_lab.timeline import Timeline

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    out = {}
    runs = [("ours", fully_shard, False), ("ours qlora", fully_shard, True)]
    if TORCH_FSDP2_ON_CPU:
        runs.insert(1, ("torch", torch_fully_shard, False))
    for name, shard, qlora in runs:
        model = _model(qlora)
        for layer in model.layers:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        with Timeline() as tl, _groups_used() as groups:
            losses = _train(model, rank, world)
        param = model.layers[0].attention.wq.weight
        if name == "torch":
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        else:
            full = get_full_state_dict(model, rank0_only=False)
        out[name] = {"losses": losses, "full": full, "placements": [str(p) for p in param.placements],
                     "local_rows": param.to_local().shape[0],
                     "comms": sorted({(e.name, e.args.get("group_size")) for e in tl.comm_events(rank)}),
                     "group_ranks": sorted(groups)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_rank, world_size=WORLD, timeout=600)


def _reference(qlora=False):
    model = _model(qlora)
    losses = _train(model, 0, 1)
    return losses, model.state_dict()


def _mean_losses(ranks, name):
    return [sum(r[name]["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]


@needs_torch_fsdp2_on_cpu
def test_parameters_are_sharded_over_the_shard_dim_and_replicated(ranks):
    for r in ranks:
        assert r["ours"]["placements"] == r["torch"]["placements"] == ["R", "S(0)"]
        assert r["ours"]["local_rows"] == r["torch"]["local_rows"] == 128 // SHARDS


def test_hsdp_matches_pytorch_fsdp2_hsdp(torch_fsdp2_reference, ranks):
    for r in ranks:
        assert max(abs(a - b) for a, b in zip(r["ours"]["losses"], r["torch"]["losses"])) < 1e-6
        for key, value in r["torch"]["full"].items():
            assert torch.allclose(r["ours"]["full"][key], value, atol=1e-6, rtol=0), key


def test_hsdp_matches_one_process(ranks):
    losses, state = _reference()
    assert max(abs(a - b) for a, b in zip(_mean_losses(ranks, "ours"), losses)) < 1e-5
    for r in ranks:
        for key, value in state.items():
            assert torch.allclose(r["ours"]["full"][key], value, atol=1e-5, rtol=0), key
    # the replicas were really averaged: every rank ends with the same weights
    for r in ranks[1:]:
        assert all(torch.equal(r["ours"]["full"][k], ranks[0]["ours"]["full"][k]) for k in state)


def test_hsdp_gathers_within_the_shard_group_and_all_reduces_across_replicas(ranks):
    # init_device_mesh("cpu", (REPLICAS, SHARDS)) lays ranks out row-major: rank r sits at
    # (r // SHARDS, r % SHARDS). Its shard group is its row, its replica group its column.
    for rank, r in enumerate(ranks):
        row, column = divmod(rank, SHARDS)
        shard_group = tuple(row * SHARDS + j for j in range(SHARDS))
        replica_group = tuple(i * SHARDS + column for i in range(REPLICAS))
        for name in ("ours", "ours qlora"):
            assert r[name]["comms"] == [("all_gather", SHARDS), ("all_reduce", REPLICAS),
                                        ("reduce_scatter", SHARDS)], (name, r[name]["comms"])
            assert r[name]["group_ranks"] == [("all_gather_into_tensor", shard_group),
                                              ("all_reduce", replica_group),
                                              ("reduce_scatter_tensor", shard_group)], (name, r[name]["group_ranks"])


def test_qlora_under_hsdp_matches_one_process(ranks):
    losses, state = _reference(qlora=True)
    assert max(abs(a - b) for a, b in zip(_mean_losses(ranks, "ours qlora"), losses)) < 1e-5
    full = ranks[0]["ours qlora"]["full"]
    for key, value in state.items():
        if isinstance(value, NF4Tensor):
            assert torch.equal(full[key].packed, value.packed), key
        else:
            assert torch.allclose(full[key], value, atol=1e-5, rtol=0), key
