"""Full (unsharded) state dicts: gather a sharded model onto rank 0, or load one back.

``model.state_dict()`` of a ``fully_shard``-ed model already holds the sharded DTensors (that
is what ``torch.distributed.checkpoint`` saves and loads, one shard per rank). For export to
plain PyTorch, ``get_full_state_dict`` all-gathers every DTensor (padding the uneven shards
the same way FSDP2 does) and keeps the full tensors on rank 0; ``load_full_state_dict`` takes
a full state dict (on rank 0, or on every rank) and copies each rank's rows into its shard.

A tensor subclass that shards itself (``fsdp_shard``, e.g. ``NF4Tensor``) holds no rows, so
it is gathered through its own FSDP2 hooks (``fsdp_pre_all_gather`` -> all-gather ->
``fsdp_post_all_gather``, then ``fsdp_unpadded`` if it has one, which drops the padding a
shard carries) and loaded with ``local.copy_(full)``: copying a whole tensor into a shard
takes that shard's part of it. An NF4 weight therefore round-trips as an ``NF4Tensor`` equal,
byte for byte, to ``to_nf4`` of the weight on one process, whatever the world size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_lab import collectives
from fsdp_lab.checks import StateDictMismatch, incompatible_keys
from fsdp_lab.fsdp2.param import padded_rows

__all__ = ["get_full_state_dict", "load_full_state_dict", "full_tensor", "load_full_tensor"]


def _shard_group(value: DTensor):
    """The process group the DTensor is sharded over, this rank's index in it, and its size."""
    mesh = value.device_mesh
    return mesh.get_group(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)


def _is_self_sharding(local: torch.Tensor) -> bool:
    return hasattr(local, "fsdp_shard") and hasattr(local, "fsdp_pre_all_gather")


def _gather_rows(value: DTensor) -> torch.Tensor:
    group, _, world = _shard_group(value)
    local = value.to_local().detach()
    rows = value.shape[0]
    rows_per_rank = padded_rows(rows, world)
    padded = local.new_zeros((rows_per_rank, *value.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    full = local.new_empty((rows_per_rank * world, *value.shape[1:]))
    collectives.all_gather_into_tensor(full, padded, group=group, name="all_gather",
                                       meta={"module": "state_dict"})
    return full[:rows]


def _gather_self_sharding(value: DTensor) -> torch.Tensor:
    """The whole tensor from a subclass's shards, through its own all-gather hooks."""
    group, _, world = _shard_group(value)
    local = value.to_local()
    stride = tuple(torch.empty(value.shape, device="meta").stride())
    inputs, metadata = local.fsdp_pre_all_gather(value.device_mesh, value.shape, stride, None, None)
    outputs = []
    for piece in inputs:
        piece = piece.contiguous().view(-1)
        out = piece.new_empty(piece.numel() * world)
        collectives.all_gather_into_tensor(out, piece, group=group, name="all_gather",
                                           meta={"module": "state_dict"})
        outputs.append(out)
    full, _ = local.fsdp_post_all_gather(tuple(outputs), metadata, None)
    return full.fsdp_unpadded() if hasattr(full, "fsdp_unpadded") else full


@torch.no_grad()
def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a ``fully_shard``-ed parameter (or ``value`` itself if not a DTensor).

    Like ``DTensor.full_tensor()``, but it also gathers tensor subclasses that shard
    themselves (an NF4 weight comes back as a whole ``NF4Tensor``). Every rank of the
    parameter's mesh must call it (it all-gathers).
    """
    if not isinstance(value, DTensor):
        return value.detach()
    if _is_self_sharding(value.to_local()):
        return _gather_self_sharding(value)
    return _gather_rows(value)


def get_full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every entry of ``model.state_dict()`` as a whole tensor.

    Plain DTensors become plain tensors; NF4 weights become whole ``NF4Tensor``s (quantized
    bytes, bit-identical to ``to_nf4`` of the weight on one process; ``.dequantize()`` one for
    floats). Every rank must call it (it all-gathers). With ``rank0_only`` other ranks get
    ``{}``. ``cpu`` moves the tensors to CPU. Raises RuntimeError naming the entry if one
    cannot be gathered.
    """
    full = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):  # a module's extra state: kept as it is
            full[key] = value
            continue
        try:
            tensor = full_tensor(value)
        except (NotImplementedError, ValueError) as error:
            kind = type(value.to_local() if isinstance(value, DTensor) else value).__name__
            raise RuntimeError(f"get_full_state_dict: cannot gather {key!r} ({kind} "
                               f"shards from fsdp_lab.fsdp2.fully_shard): {error}") from error
        full[key] = tensor.cpu() if cpu else tensor
    if rank0_only and torch.distributed.get_rank() != 0:
        return {}
    return full


def _local_device(target: torch.Tensor) -> torch.device:
    return target.to_local().device if isinstance(target, DTensor) else target.device


def _broadcast_source(key: str, target: torch.Tensor, full_state_dict) -> torch.Tensor:
    """Rank 0's entry ``key`` on every rank (shaped and typed like ``target``)."""
    rank = torch.distributed.get_rank()
    if isinstance(target, DTensor) and _is_self_sharding(target.to_local()):
        # A whole subclass tensor of the right inner sizes on every rank, then rank 0's bytes.
        source = _gather_self_sharding(target)
        if rank == 0:
            source.copy_(full_state_dict[key].to(source.device))
        names, _ = source.__tensor_flatten__()
        for name in names:
            inner = getattr(source, name)
            if inner.numel():
                collectives.broadcast(inner, 0, meta={"module": "state_dict"})
        return source
    if rank == 0:
        source = full_state_dict[key].to(device=_local_device(target), dtype=target.dtype)
    else:
        source = torch.empty(target.shape, dtype=target.dtype, device=_local_device(target))
    source = source.contiguous()
    collectives.broadcast(source, 0, meta={"module": "state_dict"})
    return source


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full_state_dict: dict[str, torch.Tensor] | None, *,
                         broadcast_from_rank0: bool = False, strict: bool = True) -> tuple[list[str], list[str]]:
    """Copy whole tensors into the (sharded) ``model`` in place.

    Each rank keeps its rows; an NF4 shard takes its blocks of a whole ``NF4Tensor`` (one
    saved at any world size) or quantizes a float tensor with its own block sizes.
    ``broadcast_from_rank0``: only rank 0's ``full_state_dict`` is read (others may pass None)
    and each tensor is broadcast; rank 0 first tells every rank whether the names match, so a
    mismatch raises on every rank instead of leaving the others waiting. ``strict`` (as
    ``nn.Module.load_state_dict``): names the model has and the state dict lacks, or the other
    way round, are refused before anything is copied; with ``strict=False`` they are skipped.
    A module's extra state (``get_extra_state``) goes to its ``set_extra_state``.
    Returns ``(missing_keys, unexpected_keys)``, a named tuple as ``nn.Module.load_state_dict``
    returns (rank 0's names on every rank under ``broadcast_from_rank0``). Raises
    ``StateDictMismatch`` (a RuntimeError and a KeyError; strict) for missing or unexpected names;
    ValueError, whatever ``strict`` is, for ``full_state_dict=None`` where it is read, a shape
    mismatch (where ``nn.Module`` raises RuntimeError) or an NF4 entry with other block sizes.
    """
    targets = model.state_dict()
    missing, unexpected = _mismatched_names(targets, full_state_dict, broadcast_from_rank0)
    if strict and (missing or unexpected):
        raise StateDictMismatch(_mismatch_message(missing, unexpected))
    for key, target in targets.items():
        if key in missing:
            continue
        if not isinstance(target, torch.Tensor):  # a module's extra state: its module sets it
            _load_extra_state(model, key, full_state_dict, broadcast_from_rank0)
            continue
        if broadcast_from_rank0:
            source = _broadcast_source(key, target, full_state_dict)
        else:
            source = full_state_dict[key]
        try:  # (shapes were compared before anything was copied)
            load_full_tensor(target, source)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from error
    return incompatible_keys(sorted(missing), unexpected)


def _load_extra_state(model: nn.Module, key: str, full_state_dict, broadcast_from_rank0: bool) -> None:
    """Give ``<module>._extra_state`` to its module (``set_extra_state``), rank 0's to every rank
    under ``broadcast_from_rank0``."""
    if broadcast_from_rank0:
        value = [full_state_dict[key] if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(value, src=0)
        value = value[0]
    else:
        value = full_state_dict[key]
    owner = key.rpartition(".")[0]
    (model.get_submodule(owner) if owner else model).set_extra_state(value)


_MATCHES, _MISSING, _MISSHAPEN = 0, 1, 2


def _mismatched_names(targets: dict, full_state_dict, broadcast_from_rank0: bool) -> tuple[set[str], list[str]]:
    """(missing, unexpected) names of ``full_state_dict`` against the model's ``targets``. Under
    ``broadcast_from_rank0`` rank 0 tells every rank which of the model's names it lacks or holds
    in another shape (a code per name, in the model's order: every rank then skips the same
    broadcasts, and none waits in one rank 0 refused), and its unexpected names. Raises ValueError,
    on every rank, when the dict to read is None or an entry has another shape than the model's."""
    reads = not broadcast_from_rank0 or torch.distributed.get_rank() == 0
    given = full_state_dict is not None
    codes, unexpected = [_MATCHES] * len(targets), []
    if reads and given:
        codes = [_MISSING if k not in full_state_dict
                 else _MISSHAPEN if _shape(full_state_dict[k]) != _shape(t) else _MATCHES
                 for k, t in targets.items()]
        unexpected = sorted(k for k in full_state_dict if k not in targets)
    if broadcast_from_rank0:
        first = next((t for t in targets.values() if isinstance(t, torch.Tensor)), None)
        device = _local_device(first) if first is not None else torch.device("cpu")
        flags = torch.tensor([int(given), len(unexpected), *codes], device=device)
        collectives.broadcast(flags, 0, meta={"module": "state_dict"})
        given, n_unexpected, *codes = flags.tolist()
        if n_unexpected:  # every rank returns (or names) them, as rank 0 sees them
            names = [unexpected]
            torch.distributed.broadcast_object_list(names, src=0)
            unexpected = names[0]
    if not given:
        raise ValueError("load_full_state_dict got full_state_dict=None; pass the state dict (on rank 0 "
                         "at least, with broadcast_from_rank0=True)")
    for (key, target), code in zip(targets.items(), codes):
        if code == _MISSHAPEN:
            saved = _shape(full_state_dict[key]) if reads else "another (on rank 0)"
            raise ValueError(f"{key}: the full state dict has shape {saved}, the model {_shape(target)}")
    return {k for k, code in zip(targets, codes) if code == _MISSING}, unexpected


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # a module's extra state need not be a tensor


def _mismatch_message(missing, unexpected) -> str:
    def some(names):
        names = sorted(names)
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    parts = ([f"missing from it: {some(missing)}"] if missing else []) + \
            ([f"not in the model: {some(unexpected)}"] if unexpected else [])
    return ("the full state dict does not match the model (" + "; ".join(parts) + "): build the model "
            "as it was when saved (the same layers; apply_lora before loading a state dict with adapters), "
            "or pass strict=False to load the names both have")


@torch.no_grad()
def load_full_tensor(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the whole tensor ``source`` into ``target`` (a ``fully_shard``-ed DTensor keeps
    this rank's part; anything else is copied whole). No communication. Raises ValueError
    for a shape mismatch, or an NF4 source of other block sizes."""
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"a tensor of shape {tuple(source.shape)} cannot load into one of {tuple(target.shape)}")
    if not isinstance(target, DTensor):
        target.copy_(source)
        return
    local = target.to_local()
    if _is_self_sharding(local):
        local.copy_(source.to(local.device))  # the subclass takes its own part of the whole
        return
    _, rank, world = _shard_group(target)
    start = rank * padded_rows(target.shape[0], world)
    local.copy_(source[start:start + local.shape[0]])
