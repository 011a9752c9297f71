"""FSDP2 DCP checkpoints of NF4 weights whose rows cut quantization blocks, across world sizes.

``dcp.save(model.state_dict())`` reshards by rows, which NF4 shards (cut by blocks) support only
where rows hold whole blocks. ``fsdp_lab.fsdp2.dcp_state_dict`` hands DCP block tables instead.
Here: weights of 700 x 96 and 100 x 700 values (rows of 96 and 700 values, a partial last block,
double-quant groups across ranks), trained on 4 ranks as HSDP (2 replicas x 2 shards), saved,
and loaded on 3 plain FSDP ranks into a model built from other weights. The reference is independent of the code under test: ``to_nf4`` of
the same weights in this process (NF4 bytes equal bit for bit) and the 2-rank run's own
adapters and loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_lab
from fsdp_lab.qlora import NF4Tensor, apply_lora

INNER = ("packed", "scales", "scale_factors", "scale_mean")


def _build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(96, 700), nn.ReLU(), nn.Linear(700, 100))
    return apply_lora(model, target_modules=("0", "2"), rank=4, alpha=8)


def _wrap(seed, mesh=None):
    from fsdp_lab.fsdp2 import fully_shard

    model = _build(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(12, 96, generator=g), torch.randn(12, 100, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


@torch.no_grad()
def _loss(model, rank, world):
    x, y = _batch(9, rank, world)
    return F.mse_loss(model(x), y, reduction="sum").item()


def _save(directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fsdp_lab.fsdp2 import dcp_state_dict, get_full_state_dict

    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap(0, init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x, y = _batch(step, rank, world)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    dcp.save(dcp_state_dict(model), checkpoint_id=directory)
    return {"full": get_full_state_dict(model), "loss": _loss(model, rank, world)}


def _load(directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fsdp_lab.fsdp2 import dcp_state_dict, get_full_state_dict, load_dcp_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap(1)  # other weights and adapters: everything must come from the checkpoint
    lo = model[0].weight.to_local().nf4_layout  # does this shard start at its nominal first row?
    aligned = [lo.first_block * lo.block_size == lo.rank * lo.shape[0] * lo.full_shape[1]]
    state = dcp_state_dict(model)
    dcp.load(state, checkpoint_id=directory)
    load_dcp_state_dict(model, state)
    refused = None
    try:
        load_dcp_state_dict(model, model.state_dict())
    except KeyError as error:
        refused = str(error)
    return {"full": get_full_state_dict(model), "loss": _loss(model, rank, world), "aligned": aligned,
            "refused": refused}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp2_dcp"))
    saved = fsdp_lab.launch(_save, directory, world_size=4, timeout=300)
    loaded = fsdp_lab.launch(_load, directory, world_size=3, timeout=300)
    return saved, loaded


def _same(a, b) -> bool:
    if isinstance(a, NF4Tensor) or isinstance(b, NF4Tensor):
        return (isinstance(a, NF4Tensor) and isinstance(b, NF4Tensor)
                and all(torch.equal(getattr(a, n), getattr(b, n)) for n in INNER))
    return torch.equal(a, b)


def test_nf4_checkpoint_saved_by_hsdp_on_2x2_ranks_loads_on_3_bit_exactly(runs):
    saved, loaded = runs
    assert any(not a for r in loaded for a in r["aligned"])  # a shard starting inside a row: rows cannot carry it
    full_saved, full_loaded = saved[0]["full"], loaded[0]["full"]
    assert full_saved.keys() == full_loaded.keys()
    assert [k for k in full_saved if not _same(full_saved[k], full_loaded[k])] == []
    reference = _build(0)  # the weights quantized in one process, before any sharding
    for name in ("0.weight", "2.weight"):
        expected = reference.get_submodule(name.split(".")[0]).weight
        assert _same(full_loaded[name], expected), name
    assert sum(r["loss"] for r in loaded) == pytest.approx(sum(r["loss"] for r in saved), rel=1e-6)


def test_loading_a_plain_state_dict_names_the_function_to_use(runs):
    _, loaded = runs
    assert "dcp_state_dict(model)" in loaded[0]["refused"]


def test_a_shard_of_another_world_size_names_dcp_state_dict():
    from fsdp_lab.qlora.nf4_fsdp import shard

    torch.manual_seed(0)
    weight = _build(0)[0].weight
    target = shard(weight, 0, 3)
    with pytest.raises(ValueError, match=r"saved on 2 ranks.*fsdp_lab\.fsdp2\.dcp_state_dict\(model\)"):
        target.copy_(shard(weight, 0, 2))
