"""Full (unsharded) state dicts: gather a sharded model onto rank 0, or load one back.

``model.state_dict()`` of a ``fully_shard``-ed model already holds the sharded DTensors (that
is what ``torch.distributed.checkpoint`` saves and loads, one shard per rank). For export to
plain PyTorch, ``get_full_state_dict`` all-gathers every DTensor (padding the uneven shards
the same way FSDP2 does) and keeps the full tensors on rank 0; ``load_full_state_dict`` takes
a full state dict (on rank 0, or on every rank) and copies each rank's rows into its shard.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lab import collectives

__all__ = ["get_full_state_dict", "load_full_state_dict"]


def _gather_full(value: DTensor) -> torch.Tensor:
    local = value.to_local()
    world, rows = dist.get_world_size(), value.shape[0]
    padded_rows = math.ceil(rows / world)
    padded = local.new_zeros((padded_rows, *value.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    full = local.new_empty((padded_rows * world, *value.shape[1:]))
    collectives.all_gather_into_tensor(full, padded, name="all_gather", meta={"module": "state_dict"})
    return full[:rows]


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` as a full plain tensor.

    Every rank must call it (it all-gathers). With ``rank0_only`` other ranks get ``{}``.
    ``cpu`` moves the tensors to CPU.
    """
    full = {}
    for key, value in model.state_dict().items():
        tensor = _gather_full(value) if isinstance(value, DTensor) else value.detach()
        full[key] = tensor.cpu() if cpu else tensor
    if rank0_only and dist.get_rank() != 0:
        return {}
    return full


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, *,
                         broadcast_from_rank0: bool = False) -> None:
    """Copy full tensors into the (sharded) ``model`` in place.

    ``broadcast_from_rank0``: only rank 0's ``full_state_dict`` is read (others may pass None)
    and each tensor is broadcast. Raises KeyError for a missing key and ValueError for a
    shape mismatch.
    """
    for key, target in model.state_dict().items():
        if broadcast_from_rank0:
            if dist.get_rank() == 0:
                source = full_state_dict[key].to(device=target.device if not isinstance(target, DTensor)
                                                 else target.to_local().device, dtype=target.dtype)
            else:
                device = target.to_local().device if isinstance(target, DTensor) else target.device
                source = torch.empty(target.shape, dtype=target.dtype, device=device)
            source = source.contiguous()
            collectives.broadcast(source, 0, meta={"module": "state_dict"})
        else:
            if key not in full_state_dict:
                raise KeyError(f"{key!r} is missing from the full state dict")
            source = full_state_dict[key]
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"{key}: the full state dict has shape {tuple(source.shape)}, the model "
                             f"{tuple(target.shape)}")
        if isinstance(target, DTensor):
            local = target.to_local()
            padded_rows = math.ceil(target.shape[0] / dist.get_world_size())
            start = dist.get_rank() * padded_rows
            local.copy_(source[start:start + local.shape[0]])
        else:
            target.copy_(source)
