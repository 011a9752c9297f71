"""The parameter whole again: ``summon_full_params``, full and sharded state dicts.

Names are the original ones (``layers.0.attention.wq.weight``, no ``_fsdp_wrapped_module``).
Each flat parameter (``handle.FlatHandle``) says what its parameters look like whole and on
this rank; this file walks the units and matches names.

* **full**: every parameter at its full shape in its own dtype (one full-precision
  all-gather per flat parameter, via ``summon_full_params``), plus persistent buffers.
  Loading copies each rank's own slice into its shard: bit-exact, any world size.
* **sharded**: no communication. Each parameter maps to what its handle keeps on this rank:
  a ``ShardedParam`` (the elements this rank owns, ``local``, 1-D, and where they sit:
  ``start``/``end`` in the parameter's flattened index space, ``shape``) for ordinary
  parameters, the handle's own entry for extensions (e.g. ``ShardedNF4``). Loading needs the
  same world size and wrapping; a mismatch raises ValueError naming the parameter.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import collectives
from fsdp_lab.checks import StateDictMismatch, incompatible_keys
from fsdp_lab.fsdp1.handle import FlatHandle
from fsdp_lab.fsdp1.layout import ShardedParam
from fsdp_lab.fsdp1.runtime import BUFFER_DTYPES, clean_name, units_in
from fsdp_lab.states import StepState, TrainingState, assert_in_states

__all__ = ["ShardedParam", "summon_full_params", "full_state_dict", "sharded_state_dict",
           "load_full_state_dict", "load_sharded_state_dict"]


def _check_summon_args(writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    if writeback and rank0_only:
        raise NotImplementedError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported (nor in PyTorch): only rank 0 "
            "holds the full parameters, so the other ranks would have nothing to write back. Pass writeback=False")
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            "summon_full_params(with_grads=True, offload_to_cpu=True) is not supported (nor in PyTorch): a "
            "parameter and its .grad must live on the same device. Leave one of them False")


@contextlib.contextmanager
def summon_full_params(model: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
    """Give every original parameter its full shape in the master dtype inside the block.

    One full-precision all-gather per flat parameter (not the compute dtype); every rank must
    enter it. ``recurse=False``: only the outermost unit of ``model``. ``rank0_only``: only
    rank 0 gets the full parameters (the others gather, free at once and stay sharded).
    ``offload_to_cpu``: the full parameters live in host memory. ``with_grads``: ``.grad``
    gets the full shape too (None where no rank has a gradient). On exit, with ``writeback``,
    this rank's part of each (possibly modified) full tensor goes back into the shard; then the
    parameters are 1-D shard views again, also when the block or a gather raises. A forward of
    a summoned unit inside the block runs on the whole parameters as they are (``generate()``
    on ``model.module``), only without gradients and where this rank holds them whole.

    Raises RuntimeError during backward, NotImplementedError for writeback with rank0_only
    and with_grads with offload_to_cpu (as PyTorch), or from a flat parameter that cannot be
    made whole (e.g. NF4 weights).
    """
    _check_summon_args(writeback, rank0_only, offload_to_cpu, with_grads)
    units = units_in(model)
    if not recurse:
        units = units[:1]
    for unit in units:
        if unit._root is not None and unit._shared.step == StepState.IN_BACKWARD:
            raise RuntimeError("summon_full_params cannot run during backward")
        if unit.training_state == TrainingState.SUMMON_FULL_PARAMS:  # nested: e.g. a full state_dict() inside
            raise RuntimeError(
                f"summon_full_params of {unit._name} inside summon_full_params: its parameters are whole "
                "already, read them there; a full state_dict() gathers them itself, so call it outside")
        assert_in_states(unit.training_state, TrainingState.IDLE, where=f"summon_full_params of {unit._name}")
    materialize = not rank0_only or dist.get_rank() == 0
    with contextlib.ExitStack() as stack:  # a failed gather unwinds the handles already whole
        for inner in (units_in(units[0])[1:] if units and not recurse else []):  # left sharded inside
            inner._under_summoned = True
            stack.callback(setattr, inner, "_under_summoned", False)
        for unit in units:
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
            stack.callback(setattr, unit, "training_state", TrainingState.IDLE)
            unit._summoned_whole = materialize
            stack.callback(setattr, unit, "_summoned_whole", False)
            for handle in unit._handles:
                stack.enter_context(handle.full_params(writeback=writeback, offload_to_cpu=offload_to_cpu,
                                                       with_grads=with_grads, materialize=materialize))
        yield


def _managed(model: nn.Module) -> dict[int, tuple[FlatHandle, int]]:
    """id(original Parameter) -> (its handle, its index in the handle)."""
    return {id(info.param): (handle, index)
            for unit in units_in(model) for handle in unit._handles for index, info in enumerate(handle.infos)}


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[clean_name(f"{prefix}.{name}" if prefix else name)] = buf
    return out


def _saved_buffer(buf: torch.Tensor) -> torch.Tensor:
    """A buffer as a state dict holds it: in its own dtype, not MixedPrecision's buffer_dtype."""
    return buf.detach().cpu().to(BUFFER_DTYPES.get(buf, buf.dtype), copy=True)


def _in_module_order(model: nn.Module, out: dict) -> dict:
    """``out`` in ``nn.Module.state_dict``'s order: each module's parameters, then its buffers,
    module by module as ``named_modules`` walks them."""
    order = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        names = [*module._parameters, *(b for b in module._buffers if b not in module._non_persistent_buffers_set)]
        order += [clean_name(f"{prefix}.{name}" if prefix else name) for name in names]
    ordered = {name: out[name] for name in dict.fromkeys(order) if name in out}
    return ordered | out  # anything the walk missed keeps its place at the end


def full_state_dict(model: nn.Module, offload_to_cpu: bool = True, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (full shape, own dtype, a copy: on CPU, or with ``offload_to_cpu=False`` on
    its device) and persistent buffer by original name. Every rank takes part; with
    ``rank0_only`` the others get an empty dict (and never hold the whole parameters)."""
    keep = not rank0_only or dist.get_rank() == 0
    copy = (lambda t: t.detach().cpu().clone()) if offload_to_cpu else (lambda t: t.detach().clone())
    out = {}
    with summon_full_params(model, writeback=False, rank0_only=rank0_only):
        if keep:
            for name, param in model.named_parameters(remove_duplicate=False):
                out[name] = copy(param)
    if keep:
        for name, buf in _persistent_buffers(model).items():
            out[name] = _saved_buffer(buf) if offload_to_cpu else buf.detach().to(BUFFER_DTYPES.get(buf, buf.dtype),
                                                                                     copy=True)
    return _in_module_order(model, out)


def sharded_state_dict(model: nn.Module) -> dict[str, object]:
    """This rank's parts: each handle's entry per managed parameter, full tensors otherwise."""
    managed = _managed(model)
    out: dict[str, object] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        entry = managed.get(id(param))
        out[name] = param.detach().cpu().clone() if entry is None else entry[0].sharded_entry(entry[1])
    for name, buf in _persistent_buffers(model).items():
        out[name] = _saved_buffer(buf)
    return _in_module_order(model, out)


def _match_names(model: nn.Module, state: dict, strict: bool):
    """The model's parameters and persistent buffers by name, and the names only one side has.

    Raises ``StateDictMismatch`` (a RuntimeError and a KeyError) under ``strict`` when a name is
    missing or unexpected.
    """
    expected = dict(model.named_parameters(remove_duplicate=False))
    expected.update(_persistent_buffers(model))
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise StateDictMismatch(f"Error(s) in loading state_dict for {type(model).__name__}: state dict "
                                f"mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return expected, missing, unexpected


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True):
    """Copy each rank's slice of every full tensor in ``state`` into its shard.

    Raises ``StateDictMismatch`` (a RuntimeError and a KeyError; strict) for missing/unexpected
    names, ValueError for a wrong shape. Returns ``(missing_keys, unexpected_keys)``, a named tuple
    as ``nn.Module.load_state_dict`` returns.
    """
    return _load(model, state, strict, lambda handle: handle.load_full_entry)


@torch.no_grad()
def load_sharded_state_dict(model: nn.Module, state: dict[str, object], strict: bool = True):
    """Inverse of ``sharded_state_dict`` on the same world size and wrapping.

    Raises ``StateDictMismatch`` (strict) for missing/unexpected names; ValueError when an entry does not
    match this rank's part of the parameter (different world size or wrapping).
    """
    return _load(model, state, strict, lambda handle: handle.load_sharded_entry)


def _load(model: nn.Module, state: dict, strict: bool,
          loader: Callable[[FlatHandle], Callable[[int, object, str], None]]) -> tuple[list[str], list[str]]:
    """Copy ``state`` into the model: whole tensors into unmanaged parameters and buffers,
    ``loader(handle)(index, value, name)`` for each managed parameter."""
    managed = _managed(model)
    refused = None
    try:
        expected, missing, unexpected = _match_names(model, state, strict)
        for name, target in expected.items():
            if name not in state:
                continue
            entry = managed.get(id(target))
            if entry is None:  # ignored parameter or buffer: kept whole on every rank
                target.copy_(state[name].to(target.device, target.dtype))
                continue
            handle, index = entry
            loader(handle)(index, state[name], name)
    except (KeyError, ValueError, RuntimeError) as error:
        refused = error
    _stop_together(model, refused)
    return incompatible_keys(missing, unexpected)


def _stop_together(model: nn.Module, refused: BaseException | None) -> None:
    """Raise ``refused`` on this rank, and a ValueError on every other rank, when any rank's load
    failed: a load that fails on one rank (a sharded state dict holding another rank's slices)
    would otherwise leave the others waiting for it in the next collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        units = units_in(model)
        device = units[0].compute_device if units else torch.device("cpu")
        failed = torch.tensor([dist.get_rank() + 1 if refused is not None else 0], device=device)
        collectives.all_reduce(failed, op="max", meta={"module": "state_dict"})
        if refused is None and failed.item():
            raise ValueError(f"loading the state dict failed on rank {int(failed.item()) - 1} (its error says "
                             "why): every rank stops here, so that none waits for it in a collective")
    if refused is not None:
        raise refused
