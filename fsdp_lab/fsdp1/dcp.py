"""FSDP1 checkpoints for ``torch.distributed.checkpoint`` (DCP), loadable at any world size.

FSDP1's sharded state dict (``state_dict.py``) holds each parameter as a flat range
``[start, end)`` of its flattened values, which is not a block of rows, so it cannot be a
DTensor. DCP also takes ``ShardedTensor``s, whose shards may be any ranges: here every
managed parameter, and every part of an extension entry (``ShardedNF4``'s packed codes,
scales, factors and mean), becomes a 1-D ``ShardedTensor`` of its flattened values in which
this rank holds its range. DCP saves each range once and, on load, reads the ranges the new
layout needs, whatever world size wrote them: bit-exact, NF4 bytes included. Unmanaged
parameters and persistent buffers stay whole tensors. (PyTorch deprecates ``ShardedTensor``
for DTensor and says so in a ``FutureWarning`` from DCP.)

    state = dcp_state_dict(model); dcp.save(state, checkpoint_id=path)
    state = dcp_state_dict(model); dcp.load(state, checkpoint_id=path); load_dcp_state_dict(model, state)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.fsdp1.layout import ShardedParam
from fsdp_lab.fsdp1.runtime import units_in
from fsdp_lab.fsdp1.state_dict import load_sharded_state_dict, sharded_state_dict

__all__ = ["dcp_state_dict", "load_dcp_state_dict"]


def _parts(name: str, entry) -> list[tuple[str, ShardedParam]]:
    """The flat ranges of one sharded entry, by DCP key."""
    if isinstance(entry, ShardedParam):
        return [(name, entry)]
    parts = getattr(entry, "parts", None)  # an extension's entry (e.g. ShardedNF4): one range per inner tensor
    if isinstance(parts, dict) and all(isinstance(p, ShardedParam) for p in parts.values()):
        return [(f"{name}.{inner}", part) for inner, part in parts.items()]
    return []


def _sharded_tensor(part: ShardedParam):
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    numel = _numel(part)
    device = part.local.device.type
    shards = [Shard(part.local, ShardMetadata([part.start], [part.end - part.start],
                                              f"rank:{dist.get_rank()}/{device}"))] if part.end > part.start else []
    return ShardedTensor._init_from_local_shards(shards, [numel])


def _check_strategy(model: nn.Module) -> None:
    for unit in units_in(model):
        replicas = unit.replicate_group
        if replicas is not None and dist.get_world_size(replicas) > 1:  # NO_SHARD, HYBRID_SHARD
            raise NotImplementedError(
                f"dcp_state_dict needs every rank to hold a different part ({unit.sharding_strategy.name} keeps "
                "copies on several ranks); save a full state dict (StateDictType.FULL_STATE_DICT) instead")


def dcp_state_dict(model: nn.Module) -> dict[str, object]:
    """This rank's parts as 1-D ``ShardedTensor``s (see the module docstring), for ``dcp.save``/``dcp.load``.

    Every rank must call it (building a ShardedTensor checks its shards with the others).
    Raises NotImplementedError for NO_SHARD / HYBRID_SHARD units (ranks hold copies).
    """
    _check_strategy(model)
    out: dict[str, object] = {}
    for name, entry in sharded_state_dict(model).items():
        parts = _parts(name, entry)
        if not parts:
            out[name] = entry  # an unmanaged parameter or a buffer: whole on every rank
        for key, part in parts:
            # a parameter without elements has no range on any rank, which a ShardedTensor refuses;
            # it is saved as the empty tensor it is
            out[key] = _sharded_tensor(part) if _numel(part) else part.local.new_empty(part.shape)
    return out


def _numel(part: ShardedParam) -> int:
    return math.prod(part.shape)


@torch.no_grad()
def load_dcp_state_dict(model: nn.Module, state: dict[str, object]) -> None:
    """Copy a state dict that ``dcp.load`` filled (built by ``dcp_state_dict(model)``) into the shards.

    Raises KeyError for a missing key (e.g. a state dict built from another model).
    """
    template = sharded_state_dict(model)
    for name, entry in template.items():
        parts = _parts(name, entry)
        if not parts:
            template[name] = state[name]
        for key, part in parts:
            if key not in state:
                raise KeyError(f"{key!r} is missing; build the state dict with dcp_state_dict(model) before dcp.load")
            if not _numel(part):  # nothing to copy into an empty parameter
                continue
            shards = state[key].local_shards()
            if shards:
                part.local.copy_(shards[0].tensor)
    load_sharded_state_dict(model, template)
