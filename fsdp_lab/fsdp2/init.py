"""Initialise a model built on the meta device and sharded there, one module at a time.

PyTorch's recipe for a model too big for one rank: build it under ``torch.device("meta")``
(no memory), ``fully_shard`` each block and then the root (shards on meta), then
``model.to_empty(device=...)`` (each rank allocates only its shards) and initialise.
Initialising a DTensor in place with random values gives different numbers from one process
(and, on CPU, PyTorch warns that DTensor random ops are incomplete). ``init_sharded`` gives the
same numbers as one process: it calls ``init_fn(module)`` for every module in
``model.apply``'s order (children first) with that module's own parameters whole for the
call, then keeps each rank's rows. At any moment a rank holds its shards plus the whole
parameters of one module. A whole-model function that draws each parameter as a full tensor
and loads it with ``fsdp_lab.fsdp2.load_full_tensor`` (``Llama.init_weights`` does) is
bounded the same way: one parameter at a time.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from fsdp_lab.fsdp2.state_dict import load_full_tensor

__all__ = ["init_sharded"]


def _owners(model: nn.Module) -> dict[int, list]:
    """id(module) -> [(FSDPParam, attribute name)] for every sharded parameter the module holds."""
    owners: dict[int, list] = {}
    seen: set[int] = set()
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if state is None or state.group is None or id(state.group) in seen:
            continue
        seen.add(id(state.group))
        for fsdp_param in state.group.fsdp_params:
            for owner, name in fsdp_param.module_infos:
                owners.setdefault(id(owner), []).append((fsdp_param, name))
    return owners


def init_sharded(model: nn.Module, init_fn: Callable[[nn.Module], None]) -> nn.Module:
    """``model.apply(init_fn)`` as on one process, for a ``fully_shard``-ed ``model``.

    Call it after ``model.to_empty(device=...)``. For each module (children first) its own
    sharded parameters become whole plain parameters (uninitialised, the shard's device and
    dtype), ``init_fn(module)`` runs (it should set the module's own parameters and buffers,
    e.g. ``reset_parameters()``), and each rank copies its rows back into its shard. Runs no
    collective: every rank must compute the same values (seeded generators, or the same
    global RNG sequence on every rank). Returns ``model``. Raises RuntimeError if called
    during forward or backward (a parameter not at its shard).
    """
    owners = _owners(model)
    wholes: dict[int, nn.Parameter] = {}  # tied parameters stay whole until their last owner ran
    remaining = {id(fp): len(fp.module_infos) for fps in owners.values() for fp, _ in fps}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        owned = owners.get(id(module), [])
        for fsdp_param, name in owned:
            if module._parameters[name] is not fsdp_param.sharded_param:
                raise RuntimeError(f"init_sharded: {type(module).__name__}.{name} is not at its shard; "
                                   "call it outside forward and backward")
            if id(fsdp_param) not in wholes:
                local = fsdp_param.sharded_local_tensor
                whole = torch.empty(fsdp_param.orig_size, dtype=local.dtype, device=local.device)
                wholes[id(fsdp_param)] = nn.Parameter(whole, requires_grad=fsdp_param.requires_grad)
            module._parameters[name] = wholes[id(fsdp_param)]
        init_fn(module)
        for fsdp_param, name in owned:
            load_full_tensor(fsdp_param.sharded_param, wholes[id(fsdp_param)].detach())
            module._parameters[name] = fsdp_param.sharded_param
            remaining[id(fsdp_param)] -= 1
            if remaining[id(fsdp_param)] == 0:
                del wholes[id(fsdp_param)]

    visit(model)
    return model
