"""An FSDP1 model's optimizer state by parameter name: whole tensors, or DCP's sharded ones.

The optimizer steps the original parameters, whose ``.data`` on a rank is its 1-D part of the
flat shard, so every state tensor shaped like a parameter (Adam's ``exp_avg`` and
``exp_avg_sq``, SGD's ``momentum_buffer``) holds this rank's part of that parameter's state.
``optimizer.state_dict()`` therefore saves and loads as it is on the same world size and
wrapping. To load elsewhere, the state must be keyed by name and made whole or sharded by
parameter, as PyTorch's ``FSDP.optim_state_dict`` does (same layout: ``{"state": {name:
{key: value}}, "param_groups": [{..., "params": [name, ...]}]}``):

* **whole** (``FULL_STATE_DICT``, the default): one all-gather per (flat parameter, state
  key); each tensor has its parameter's shape, on CPU, on every rank. Loads at any world size
  and wrapping, and into the same model trained in one process.
* **sharded** (inside ``FSDP.state_dict_type(model, SHARDED_STATE_DICT)``): each such tensor
  becomes a 1-D ``ShardedTensor`` of the parameter's flattened state holding this rank's range
  (a view of the optimizer's tensor), as ``dcp_state_dict`` does for the parameters themselves,
  so ``torch.distributed.checkpoint`` saves it once. No data moves, but building each
  ShardedTensor checks its metadata with the other ranks, so every rank calls it. ``load_dcp_optim_state_dict`` loads it at
  any world size: it reads which state each parameter has from the checkpoint's metadata
  (a fresh optimizer has none to offer as a template).

Tensors of another shape (Adam's 0-dim ``step``) are the same on every rank and stay as they are.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.fsdp1.api import StateDictSettings, StateDictType
from fsdp_lab.fsdp1.dcp import _check_strategy, _sharded_tensor
from fsdp_lab.fsdp1.layout import ShardedParam
from fsdp_lab.fsdp1.runtime import units_in
from fsdp_lab.fsdp1.state_dict import _managed
from fsdp_lab.states import TrainingState

__all__ = ["check_group", "optim_state_dict", "optim_state_dict_to_load"]


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()``'s order (its integer keys)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimizer parameter's name in ``model``; ValueError for one the model does not have."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = []
    for i, p in enumerate(_params_of(optimizer)):
        if id(p) not in by_id:
            raise ValueError(f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                             f"model; build the optimizer from this model's parameters after wrapping it")
        names.append(by_id[id(p)])
    return names


def _check_idle(model: nn.Module) -> None:
    for unit in units_in(model):
        if unit.training_state != TrainingState.IDLE:
            raise RuntimeError(f"optimizer state of an FSDP1 model is read between steps; {unit._name} is in "
                               f"{unit.training_state.name}")


def _elementwise(value, param: torch.Tensor) -> bool:
    """A state tensor laid out like this rank's part of the parameter."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape


def _as_is(value):
    return value.detach().clone() if torch.is_tensor(value) else copy.deepcopy(value)


def _named_groups(saved_groups: list[dict], names: list[str]) -> list[dict]:
    """``optimizer.state_dict()["param_groups"]`` with parameter names in place of indices."""
    groups, position = [], 0
    for group in saved_groups:
        count = len(group["params"])
        groups.append({**copy.deepcopy({k: v for k, v in group.items() if k != "params"}),
                       "params": names[position:position + count]})
        position += count
    return groups


def check_group(model: nn.Module, group) -> None:
    """ValueError unless ``group`` (PyTorch's ``group=`` argument) is None, the world, or a group
    of the model's root unit: the optimizer state moves over the model's own groups."""
    units = units_in(model)
    own = [g for g in (units[0].shard_group, units[0].replicate_group) if g is not None] if units else []
    if group is None or group is dist.group.WORLD or any(group is g for g in own):
        return
    raise ValueError("group= names another process group than the model's: the optimizer state is gathered "
                     "over the groups the model was wrapped with; pass group=None")


def _check_optimizer_form(saved_state, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless ``saved_state`` has ``optimizer.state_dict()``'s form for this optimizer."""
    count = len(_params_of(optimizer))
    if not (isinstance(saved_state, dict) and isinstance(saved_state.get("state"), dict)
            and isinstance(saved_state.get("param_groups"), list)
            and all(isinstance(i, int) and 0 <= i < count for i in saved_state["state"])
            and [len(g.get("params", ())) for g in saved_state["param_groups"]]
            == [len(g["params"]) for g in optimizer.param_groups]):
        raise ValueError("optim_state_dict= must be the optimizer's own state_dict() (integer ids, the same "
                         "parameter groups); a dict keyed by parameter names is what optim_state_dict returns: "
                         "pass that to optim_state_dict_to_load")


def optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, saved_state: dict | None = None) -> dict:
    """``optimizer``'s state by parameter name: whole tensors, or 1-D ShardedTensors inside
    ``state_dict_type(model, SHARDED_STATE_DICT)`` (see the module docstring). ``saved_state``:
    a state in ``optimizer.state_dict()``'s form to convert instead of the optimizer's own
    (ValueError when it has another form).

    Every rank must call it between steps; it changes nothing (an optimizer without state gives
    none: to load a DCP checkpoint into one, use ``load_dcp_optim_state_dict``). Whole tensors
    leave the device one by one as they are gathered (``offload_to_cpu``, the default) and are
    kept only on rank 0 under ``rank0_only``. Sharded entries view the optimizer's own tensors
    (no copy, as ``optimizer.state_dict()``). Raises ValueError for an optimizer parameter the
    model does not have, RuntimeError when the ranks' optimizer states differ in kind or inside
    forward or backward, NotImplementedError (sharded) for units whose ranks hold copies
    (NO_SHARD, HYBRID_SHARD).
    """
    _check_idle(model)
    settings = _settings(model)
    sharded = settings.state_dict_type == StateDictType.SHARDED_STATE_DICT
    if sharded:
        _check_strategy(model)
    offload_to_cpu, rank0_only = (False, False) if sharded else settings.full_options(optim=True)
    keep = not rank0_only or dist.get_rank() == 0
    names, params, managed = _names(model, optimizer), _params_of(optimizer), _managed(model)
    handles = [h for u in units_in(model) for h in u._handles]
    numbers = {id(h): n for n, h in enumerate(handles)}
    state: dict[str, dict] = {}
    parts: dict[tuple, dict[int, torch.Tensor]] = {}  # (handle number, key, dtype) -> {index: this rank's part}
    owners: dict[tuple[int, int], str] = {}           # (handle number, index) -> parameter name
    if saved_state is None:
        saved_state = optimizer.state_dict()
    else:
        _check_optimizer_form(saved_state, optimizer)
    for i, saved in saved_state["state"].items():
        param, name, entry = params[i], names[i], managed.get(id(params[i]))
        state[name] = {}
        for key, value in saved.items():
            if entry is None or not _elementwise(value, param):
                state[name][key] = _as_is(value)
            else:
                number = numbers[id(entry[0])]
                parts.setdefault((number, key, value.dtype), {})[entry[1]] = value.detach()
                owners[(number, entry[1])] = name
    _check_same_on_every_rank(parts)  # the collectives below must match, or they would hang
    for (number, key, dtype), by_index in sorted(parts.items(), key=lambda item: item[0][:2]):
        handle = handles[number]
        if sharded:
            for index, local in by_index.items():
                start, end = handle.layout.bounds[index]
                state[owners[(number, index)]][key] = _sharded_tensor(
                    ShardedParam(local, start, end, tuple(handle.infos[index].shape)))
            continue
        if not hasattr(handle, "gather_param_shaped"):
            raise TypeError(f"{type(handle).__name__} ({handle.unit_name}) cannot gather optimizer state; "
                            f"only ordinary flat parameters train")
        for index, whole in handle.gather_param_shaped(by_index, dtype).items():
            if keep:
                state[owners[(number, index)]][key] = whole.to("cpu", copy=True) if offload_to_cpu else whole.clone()
    if not keep:
        return {}
    if offload_to_cpu:
        state = {name: {k: v.cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
                 for name, entry in state.items()}
    return {"state": state, "param_groups": _named_groups(saved_state["param_groups"], names)}


def _settings(model: nn.Module) -> StateDictSettings:
    units = units_in(model)
    return units[0]._state_dict_settings if units else StateDictSettings(StateDictType.FULL_STATE_DICT)


def _check_same_on_every_rank(parts: dict) -> None:
    """RuntimeError unless every rank has state for the same parameters, keys and dtypes."""
    plan = sorted((number, key, str(dtype), sorted(by_index)) for (number, key, dtype), by_index in parts.items())
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    if any(p != plan for p in plans):
        raise RuntimeError("the ranks' optimizer states differ (other keys, dtypes or parameters with state); "
                           "every rank must step the same optimizer over the same parameters")


def optim_state_dict_to_load(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: dict) -> dict:
    """What ``optimizer.load_state_dict`` takes on this rank, from ``optim_state_dict``'s output
    (whole, saved at any world size or by one process in the same layout; or sharded, filled by
    ``dcp.load``). No communication, except under ``FullOptimStateDictConfig(rank0_only=True)``:
    then only rank 0's ``optim_state_dict`` is read and broadcast (the others may pass None).

    Raises ValueError when the parameter groups or their names differ from the optimizer's, or a
    tensor does not fit its parameter (another model, or a sharded state of another layout).
    """
    _check_idle(model)
    settings = _settings(model)
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT and settings.full_options(optim=True)[1] \
            and dist.get_world_size() > 1:
        box = [optim_state_dict if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        optim_state_dict = box[0]
    names, params, managed = _names(model, optimizer), _params_of(optimizer), _managed(model)
    groups = optim_state_dict["param_groups"]
    ours = _named_groups(optimizer.state_dict()["param_groups"], names)
    if [sorted(g["params"]) for g in groups] != [sorted(g["params"]) for g in ours]:
        raise ValueError("the saved parameter groups name other parameters than the optimizer's: build the "
                         "optimizer with the same groups over the same model before loading")
    index = {name: i for i, name in enumerate(names)}
    state = {}
    for name, saved in optim_state_dict["state"].items():
        if name not in index:
            raise ValueError(f"optimizer state for {name!r}, which the optimizer does not hold")
        i = index[name]
        entry = managed.get(id(params[i]))
        state[i] = {key: _local(value, entry, params[i], f"{name}.{key}") for key, value in saved.items()}
    # hyperparameters as saved, parameters in this optimizer's own order: load_state_dict pairs
    # the ids listed here with its parameters by position
    return {"state": state,
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [index[n] for n in own["params"]]} for g, own in zip(groups, ours)]}


def _local(value, entry, param: torch.Tensor, where: str):
    """This rank's part of one saved value, a copy (the optimizer steps it in place)."""
    if entry is None or not torch.is_tensor(value) or value.dim() == 0:
        return _as_is(value)
    handle, index = entry
    local_shards = getattr(value, "local_shards", None)
    if local_shards is not None:  # a ShardedTensor that dcp.load filled
        start, end = handle.layout.bounds[index]
        shards = local_shards()
        offset = shards[0].metadata.shard_offsets[0] if shards else start
        local = shards[0].tensor if shards else param.new_empty(0)
        if offset != start or local.numel() != end - start:
            raise ValueError(f"{where}: the sharded state holds elements [{offset}, {offset + local.numel()}) but "
                             f"this rank owns [{start}, {end}); build it with optim_state_dict on this model")
        return local.reshape(-1).clone()
    try:
        return handle.local_part(index, value).clone()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}; load a state saved from the same model") from None


def load_dcp_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id=None, *,
                              key: str = "optim", storage_reader=None) -> None:
    """Load into ``optimizer`` the state that ``dcp.save`` wrote under ``key`` (``optim_state_dict``
    in the sharded mode, from any world size), reading this rank's ranges only.

    ``checkpoint_id``: the checkpoint's directory (or pass a DCP ``storage_reader``). Every
    rank calls it between steps. Raises ValueError when the checkpoint holds no optimizer state
    under ``key`` or it was saved for other parameter groups, and what
    ``optim_state_dict_to_load`` raises.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_idle(model)
    if storage_reader is None:
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    saved = storage_reader.read_metadata().state_dict_metadata
    names, params, managed = _names(model, optimizer), _params_of(optimizer), _managed(model)
    group_prefix = f"{key}.param_groups."
    # DCP's keys, flattened as dcp.save wrote them: loading them flat (no nesting to match) keeps
    # DCP from guessing an older key format because the checkpoint holds more (the model)
    flat: dict[str, object] = {k: None for k in saved if k.startswith(group_prefix)}  # objects: filled in
    if not flat:
        raise ValueError(f"the checkpoint holds no optimizer state under {key!r}; pass the key it was saved under")
    where: dict[str, tuple[str, str]] = {}  # flat key -> (parameter name, state key)
    for name, param in zip(names, params):
        prefix, entry = f"{key}.state.{name}.", managed.get(id(param))
        for flat_key, meta in saved.items():
            state_key = flat_key[len(prefix):] if flat_key.startswith(prefix) else None
            if not state_key:
                continue
            if "." in state_key:
                raise ValueError(f"{flat_key}: the optimizer state of {name} holds a container ({state_key!r}); "
                                 f"load_dcp_optim_state_dict takes one tensor or plain value per state key; save "
                                 f"such an optimizer's whole state (FULL_STATE_DICT) instead")
            where[flat_key] = (name, state_key)
            if not isinstance(meta, TensorStorageMetadata):
                flat[flat_key] = None
            elif entry is not None and list(meta.size) == [entry[0].infos[entry[1]].numel]:  # a flat range
                handle, index = entry
                start, end = handle.layout.bounds[index]
                local = torch.empty(end - start, dtype=meta.properties.dtype, device=param.device)
                flat[flat_key] = _sharded_tensor(ShardedParam(local, start, end, tuple(handle.infos[index].shape)))
            else:
                flat[flat_key] = torch.empty(list(meta.size), dtype=meta.properties.dtype)
    dcp.load(flat, storage_reader=storage_reader, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    state: dict[str, dict] = {}
    for flat_key, (name, state_key) in where.items():
        state.setdefault(name, {})[state_key] = flat[flat_key]
    groups: dict[int, dict] = {}
    for flat_key in saved:
        if flat_key.startswith(group_prefix):
            number, _, field = flat_key[len(group_prefix):].partition(".")
            groups.setdefault(int(number), {})[field] = flat[flat_key]
    loaded = {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}
    optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, loaded))
