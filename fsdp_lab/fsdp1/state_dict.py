"""The parameter whole again: ``summon_full_params``, full and sharded state dicts.

Names are the original ones (``layers.0.attention.wq.weight``, no ``_fsdp_wrapped_module``).

* **full**: every parameter at its full shape in its own dtype (one full-precision
  all-gather per flat parameter, via ``summon_full_params``), plus persistent buffers.
  Loading copies each rank's own slice into its shard: bit-exact, any world size.
* **sharded**: no communication. Each parameter maps to a ``ShardedParam`` holding only the
  elements this rank owns (``local``, 1-D) and where they sit (``start``/``end`` in the
  parameter's flattened index space, ``shape``). Loading needs the same world size and
  wrapping; a mismatch raises ValueError naming the parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.nn as nn


@dataclasses.dataclass
class ShardedParam:
    """This rank's part of one parameter: ``local == full.reshape(-1)[start:end]``."""

    local: torch.Tensor
    start: int
    end: int
    shape: tuple[int, ...]


@contextlib.contextmanager
def summon_full_params(model: nn.Module, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
    """Give every original parameter its full shape in its own dtype inside the block.

    One full-precision all-gather per flat parameter (not the compute dtype). On exit, with
    ``writeback``, this rank's part of each (possibly modified) full tensor goes back into
    the shard; then the parameters are 1-D shard views again. Raises RuntimeError in backward.
    """
    from fsdp_lab.fsdp1.fully_sharded import FullyShardedDataParallel

    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if not recurse:
        units = units[:1]
    gathered = []
    for unit in units:
        if unit._root is not None and unit._root._in_backward:
            raise RuntimeError("summon_full_params cannot run during backward")
        for handle in unit._handles:
            full = handle.gather_full_precision()
            for info in handle.infos:
                info.param.data = full[info.offset:info.offset + info.numel].view(info.shape)
            gathered.append((handle, full))
    try:
        yield
    finally:
        for handle, full in gathered:
            if writeback:
                lo = handle.shard_rank * handle.shard_numel
                with torch.no_grad():
                    handle.flat_shard.copy_(full[lo:lo + handle.shard_numel])
            handle.use_sharded_views()


def _managed(model: nn.Module) -> dict[int, tuple]:
    """id(original Parameter) -> (handle, info, (start, end) in the parameter)."""
    from fsdp_lab.fsdp1.fully_sharded import FullyShardedDataParallel

    found = {}
    for unit in model.modules():
        if isinstance(unit, FullyShardedDataParallel):
            for handle in unit._handles:
                for info, bounds in zip(handle.infos, handle.bounds):
                    found[id(info.param)] = (handle, info, bounds)
    return found


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    from fsdp_lab.fsdp1.fully_sharded import _clean

    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[_clean(f"{prefix}.{name}" if prefix else name)] = buf
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (full shape, own dtype, CPU clone) and persistent buffer by original name."""
    out = {}
    with summon_full_params(model, writeback=False):
        for name, param in model.named_parameters(remove_duplicate=False):
            out[name] = param.detach().cpu().clone()
    for name, buf in _persistent_buffers(model).items():
        out[name] = buf.detach().cpu().clone()
    return out


def _match_names(model: nn.Module, state: dict, strict: bool):
    """The model's parameters and persistent buffers by name, and the names only one side has.

    Raises KeyError under ``strict`` when a name is missing or unexpected.
    """
    expected = dict(model.named_parameters(remove_duplicate=False))
    expected.update(_persistent_buffers(model))
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return expected, missing, unexpected


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True):
    """Copy each rank's slice of every full tensor in ``state`` into its shard.

    Raises KeyError (strict) for missing/unexpected names, ValueError for a wrong shape.
    Returns ``(missing, unexpected)`` name lists.
    """
    def this_rank_slice(name, value, shape, start, end):
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: state dict has shape {tuple(value.shape)}, model has {shape}")
        return value.reshape(-1)[start:end]

    return _load(model, state, strict, this_rank_slice)


def sharded_state_dict(model: nn.Module) -> dict[str, object]:
    """This rank's slices: ``ShardedParam`` per managed parameter, full tensors otherwise."""
    managed = _managed(model)
    out: dict[str, object] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        entry = managed.get(id(param))
        if entry is None:
            out[name] = param.detach().cpu().clone()
            continue
        _handle, info, (start, end) = entry
        out[name] = ShardedParam(param.detach().cpu().clone(), start, end, tuple(info.shape))
    for name, buf in _persistent_buffers(model).items():
        out[name] = buf.detach().cpu().clone()
    return out


@torch.no_grad()
def load_sharded_state_dict(model: nn.Module, state: dict[str, object], strict: bool = True):
    """Inverse of ``sharded_state_dict`` on the same world size and wrapping.

    Raises KeyError (strict) for missing/unexpected names; ValueError when a slice does not
    match this rank's slice of the parameter (different world size or wrapping).
    """
    def saved_slice(name, value, shape, start, end):
        if not isinstance(value, ShardedParam) or (value.start, value.end, tuple(value.shape)) != (start, end, shape):
            got = (value.start, value.end) if isinstance(value, ShardedParam) else type(value).__name__
            raise ValueError(f"{name}: saved slice {got} is not this rank's slice {(start, end)}; "
                             f"load a sharded state dict on the same world size and wrapping, or use a full one")
        return value.local

    return _load(model, state, strict, saved_slice)


def _load(model: nn.Module, state: dict, strict: bool, local_part) -> tuple[list[str], list[str]]:
    """Copy ``state`` into the model: whole tensors into unmanaged parameters and buffers,
    ``local_part(name, value, full_shape, start, end)`` into each managed parameter's shard."""
    managed = _managed(model)
    expected, missing, unexpected = _match_names(model, state, strict)
    for name, target in expected.items():
        if name not in state:
            continue
        value = state[name]
        entry = managed.get(id(target))
        if entry is None:  # ignored parameter or buffer: kept whole on every rank
            target.copy_(value.to(target.device, target.dtype))
            continue
        _handle, info, (start, end) = entry
        target.copy_(local_part(name, value, tuple(info.shape), start, end).to(target.device, target.dtype))
    return missing, unexpected
