"""FSDP2 checkpoints for ``torch.distributed.checkpoint`` (DCP) that load at any world size.

``dcp.save(model.state_dict())`` already works for plain parameters: each is a DTensor
sharded by rows, and DCP reshards rows. A tensor subclass that shards itself by its own units
(``NF4Tensor``: whole quantization blocks) is not cut by rows, so DCP's row pieces of it
exist only where rows and blocks line up. Such a subclass can describe its shard in DCP's
terms instead, through two methods this module calls:

    local.fsdp_dcp_state(mesh, placements, gather) -> {name: tensor}
        DTensors split along the subclass's own units (e.g. a table with one row per
        quantization block), whose locals view the shard's bytes, and whole plain tensors;
    local.fsdp_load_dcp_state({name: tensor})
        take this shard's part of what ``dcp.load`` filled in.

``dcp_state_dict(model)`` is ``model.state_dict()`` with each such entry ``key`` replaced by
``key.<name>`` entries; ``load_dcp_state_dict(model, state)`` puts a loaded one back.

    state = dcp_state_dict(model); dcp.save(state, checkpoint_id=path)
    state = dcp_state_dict(model); dcp.load(state, checkpoint_id=path); load_dcp_state_dict(model, state)
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lab import collectives

__all__ = ["dcp_state_dict", "load_dcp_state_dict"]


def _describes_itself(value) -> bool:
    return isinstance(value, DTensor) and hasattr(value.to_local(), "fsdp_dcp_state")


def _gatherer(value: DTensor):
    """All-gather of equal 1-D pieces over the group ``value`` is sharded on, in rank order."""
    mesh = value.device_mesh
    group, world = mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1)

    def gather(piece: torch.Tensor) -> torch.Tensor:
        out = piece.new_empty(piece.numel() * world)
        collectives.all_gather_into_tensor(out, piece.reshape(-1), group=group, name="all_gather",
                                           meta={"module": "dcp_state_dict"})
        return out
    return gather


def dcp_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` for ``dcp.save`` / ``dcp.load``, loadable at any world size.

    Entries whose local shard describes itself (see the module docstring; NF4 weights) become
    ``<key>.<part>`` entries; every other entry is the state dict's own. Every rank must call
    it (a subclass may gather small metadata).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if not _describes_itself(value):
            out[key] = value
            continue
        parts = value.to_local().fsdp_dcp_state(value.device_mesh, value.placements, _gatherer(value))
        for name, part in parts.items():
            out[f"{key}.{name}"] = part
    return out


@torch.no_grad()
def load_dcp_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a state dict that ``dcp.load`` filled (built by ``dcp_state_dict(model)``) into ``model``.

    Raises KeyError naming a missing entry (e.g. a state dict built from another model or by
    ``model.state_dict()``).
    """
    plain = {}
    for key, value in model.state_dict().items():
        if not _describes_itself(value):
            if key not in state:
                raise KeyError(f"{key!r} is missing; build the state dict with dcp_state_dict(model) before dcp.load")
            plain[key] = state[key]
            continue
        prefix = f"{key}."
        parts = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not parts:
            raise KeyError(f"the parts of {key!r} are missing; build the state dict with dcp_state_dict(model) "
                           "before dcp.load")
        value.to_local().fsdp_load_dcp_state(parts)
    model.load_state_dict(plain, strict=False)
