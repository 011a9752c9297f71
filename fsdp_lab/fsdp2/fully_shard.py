"""``fully_shard``: when each step of a parameter's life runs, driven by module and autograd hooks.

``fully_shard(module)`` shards the parameters the module owns (those not already owned by a
``fully_shard``-ed submodule) into one ``FSDPParamGroup`` and swaps the module's class for a
subclass of ``FSDPModule``. From then on hooks run the group:

* forward pre-hook: (first call only) lazy init of the root -> cast inputs -> unshard
  (waiting for a prefetched all-gather) -> issue explicit forward prefetches -> wrap the
  inputs so that autograd calls ``post_backward`` once the module's backward is done;
* forward post-hook: reshard if ``reshard_after_forward`` -> hook the outputs so their
  gradient triggers ``pre_backward`` -> cast outputs to ``output_dtype``;
* pre_backward: unshard again (if resharded) -> prefetch the group that ran just before in
  forward (implicit) or the explicit backward-prefetch list;
* post_backward: reduce-scatter the gradients (async; the previous one is finished first so
  only one is in flight) -> reshard if ``reshard_after_backward``;
* a final callback queued on the autograd engine at the first pre_backward finishes every
  group (modules whose inputs need no grad, tied weights used twice, unused prefetches) and
  waits for the last reduce-scatter, so ``.grad`` is complete when ``backward()`` returns.

The *root* is the first ``FSDPModule`` whose forward runs; it owns the bookkeeping shared by
all groups below it (forward order for prefetch, the in-flight reduce-scatter). The hooks and
the state they keep are in ``hooks.py``; this module builds the groups and the public API.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_lab.fsdp2.param import CPUOffloadPolicy, FSDPParam, OffloadPolicy
from fsdp_lab.fsdp2.hooks import _FSDPState
from fsdp_lab.fsdp2.param_group import FSDPParamGroup
from fsdp_lab.checks import check_bool
from fsdp_lab.precision import MixedPrecisionPolicy, param_dtypes

__all__ = ["fully_shard", "FSDPModule", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle",
           "register_fsdp_forward_method"]


# Original parameter (by identity) -> the name of the module that sharded it. Catches a
# parameter reached from two separately sharded modules (e.g. tied embeddings).
_CLAIMED = WeakIdKeyDictionary()
_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims=None):
    """Shard ``module``'s parameters across ``mesh`` (like ``torch.distributed.fsdp.fully_shard``).

    ``module`` may be a list: its modules form one group (one all-gather), e.g. tied
    ``[model.tok_embeddings, model.output]``. ``mesh``: a 1-D ``DeviceMesh``, or a 2-D one
    (replicate x shard: HSDP, shards within the last dim, gradients also averaged over the
    first); None builds a 1-D one over the whole world on this rank's device type.
    ``reshard_after_forward``: True frees the gathered parameters after forward and gathers
    them again in backward; False keeps them until after backward; None (default, as in
    PyTorch) means True except for the root module, whose parameters would be gathered again
    at once. ``mp_policy``: a bf16 or fp16 model's trainable parameters get float32 master
    shards by default (``main_params_dtype``; PyTorch's FSDP2 keeps them in their own dtype,
    which ``MixedPrecisionPolicy(main_params_dtype=None)`` gives). ``ignored_params``: parameters
    left as they are, as PyTorch's: not sharded, not moved, their gradients not reduced (each
    rank keeps its own). ``shard_placement_fn`` and ``dp_mesh_dims`` are PyTorch's keywords,
    taken at their default (None) only: every parameter is sharded on dim 0 over ``mesh``.
    Returns ``module`` (now an ``FSDPModule``).

    Raises:
        ValueError: the module is already an FSDPModule, or an ``nn.ModuleList`` / ``nn.ModuleDict``
            (never called itself); a parameter is a DTensor (a module above it
            was sharded first: shard bottom-up); a parameter is already managed by
            another ``fully_shard`` call; parameters on different devices; a mesh that is not
            1-D or 2-D over the whole world or whose device type differs from the parameters'.
        TypeError: a non-floating parameter; ``ignored_params`` not a collection of Parameters;
            a bad policy type (PyTorch's
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` is accepted and converted).
        NotImplementedError: an int ``reshard_after_forward`` (resharding to a smaller group), a
            ``shard_placement_fn`` or ``dp_mesh_dims`` other than None.
        RuntimeError: no default process group.
    """
    for keyword, value in (("shard_placement_fn", shard_placement_fn), ("dp_mesh_dims", dp_mesh_dims)):
        if value is not None:
            raise NotImplementedError(f"fully_shard({keyword}=...) is not supported here: every parameter "
                                      "is sharded on dim 0 over the mesh (leave it out, or None)")
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    mp_policy = MixedPrecisionPolicy.coerce(mp_policy)
    _check_args(modules, reshard_after_forward, mp_policy, offload_policy)
    mesh = mesh or _default_mesh()
    device = _check_mesh(mesh)
    ignored = _check_ignored(ignored_params)
    fsdp_params = _make_fsdp_params(modules, mesh, device, mp_policy, offload_policy, ignored)
    name = ",".join(type(m).__name__ for m in modules)
    group = FSDPParamGroup(fsdp_params, modules, mesh, device, reshard_after_forward is not False,
                           name=name) if fsdp_params else None
    state = _FSDPState(modules, group, mp_policy, auto_reshard=reshard_after_forward is None)
    if group is not None:
        _reshard_before_state_dicts(group)
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
        m.register_forward_pre_hook(state.pre_forward_hook, with_kwargs=True)
        m.register_forward_hook(state.post_forward_hook, with_kwargs=True)
    return module


def _reshard_before_state_dicts(group: FSDPParamGroup) -> None:
    """As PyTorch's FSDP2: saving or loading a state dict first reshards the group, so its entries
    are always the sharded DTensors the optimizer updates (a group left gathered, e.g. by
    ``set_reshard_after_backward(False)`` or ``unshard()``, would give its gathered copies,
    stale after an optimizer step and sharing storage a later reshard frees)."""
    group_ref = weakref.ref(group)  # the module's hook must not keep its group alive

    def to_sharded(*_args, **_kwargs) -> None:
        live = group_ref()
        if live is not None:
            live.reshard()

    owners = {id(module): module for fsdp_param in group.fsdp_params for module, _ in fsdp_param.module_infos}
    for module in owners.values():
        module.register_state_dict_pre_hook(to_sharded)
        module._register_load_state_dict_pre_hook(to_sharded)


# -- checks and construction ------------------------------------------------------------------
def _check_args(modules, reshard_after_forward, mp_policy, offload_policy) -> None:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: run inside fsdp_lab.launch, torchrun "
                           "(after fsdp_lab.init_distributed()), or fsdp_lab.simulated_world")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):  # as PyTorch's: its hooks would never run
            raise ValueError(f"fully_shard cannot shard an nn.{type(m).__name__}: a container without forward is "
                             "never called, so nothing would gather its parameters. Shard each module in it "
                             "(for block in model.layers: fully_shard(block)), or pass its modules as one "
                             "group (fully_shard(list(model.layers)))")
        if isinstance(m, FSDPModule):
            raise ValueError(f"{type(m).__name__} is already sharded by fully_shard; call it once per module")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward} (reshard to a smaller group after forward) is not "
            "supported by fsdp_lab's FSDP2; use True (free after forward) or False (keep until after backward)")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool or None, got {reshard_after_forward!r}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy(), got {offload_policy!r}")


def _default_mesh() -> DeviceMesh:
    from fsdp_lab.dist import current_device
    key = (current_device().type, id(dist.group.WORLD))  # a new process group needs a new mesh
    if key not in _MESHES:
        _MESHES.clear()
        _MESHES[key] = init_device_mesh(key[0], (dist.get_world_size(),))
    return _MESHES[key]


def _check_mesh(mesh: DeviceMesh) -> torch.device:
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fsdp_lab's fully_shard takes a 1-D mesh (shard) or a 2-D mesh (replicate x shard, "
                         f"HSDP); got a {mesh.ndim}-D mesh")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {dist.get_world_size()}; "
                         f"use init_device_mesh(device_type, ({dist.get_world_size()},)) or mesh=None")
    from fsdp_lab.dist import current_device
    device = current_device()
    if mesh.device_type != device.type:
        raise ValueError(f"the mesh is on {mesh.device_type!r} but this rank computes on {device}; "
                         f"build the mesh with init_device_mesh({device.type!r}, ...)")
    return device


def _check_ignored(ignored_params) -> set[int]:
    """The ids of ``ignored_params``; TypeError unless it is None or a collection of Parameters."""
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, (torch.Tensor, nn.Module, str)) or not hasattr(ignored_params, "__iter__"):
        raise TypeError(f"ignored_params must be a set of nn.Parameters (e.g. {{model.head.weight}}), "
                        f"got {type(ignored_params).__name__}")
    ignored = list(ignored_params)
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameters, got a {type(p).__name__}")
    return {id(p) for p in ignored}


def _managed_params(modules: list[nn.Module], ignored: set[int] = frozenset()
                    ) -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    """Parameters of ``modules`` not owned by a sharded submodule nor ignored -> where each is registered."""
    found: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    stack = list(modules)
    visited: set[int] = set()
    while stack:
        m = stack.pop(0)
        if id(m) in visited:
            continue
        visited.add(id(m))
        for name, p in m._parameters.items():
            if p is not None and id(p) not in ignored:
                found.setdefault(p, []).append((m, name))
        stack += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return found


def _make_fsdp_params(modules, mesh, device, mp_policy, offload_policy, ignored) -> list[FSDPParam]:
    found = _managed_params(modules, ignored)
    devices = {p.device for p in found}
    if len(devices) > 1:
        raise ValueError(f"the parameters of {type(modules[0]).__name__} are on different devices "
                         f"({', '.join(sorted(map(str, devices)))}); move the module to one device first")
    names = {p: f"{type(infos[0][0]).__name__}.{infos[0][1]}" for p, infos in found.items()}
    for p in found:
        if p in _CLAIMED:
            raise ValueError(
                f"parameter {names[p]} is already managed by fully_shard({_CLAIMED[p]}); a parameter shared "
                "between modules must be sharded once: pass those modules together, e.g. "
                "fully_shard([model.tok_embeddings, model.output])")
        if isinstance(p, DTensor):
            raise ValueError(
                f"parameter {names[p]} is a DTensor already: fully_shard of a module above it ran first "
                "(or another parallelism made it one); call fully_shard bottom-up, on each block and then "
                "on the root, as PyTorch's fully_shard expects")
        if not (p.is_floating_point() or hasattr(p, "fsdp_pre_all_gather") or hasattr(p, "fsdp_shard")):
            raise TypeError(f"parameter {names[p]} has dtype {p.dtype}; fully_shard shards floating-point "
                            "parameters only (keep integer state in buffers)")
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    fsdp_params = []
    for p, infos in found.items():
        data = p if p.device == device or p.is_meta else p.to(device)  # meta: shards on meta until to_empty
        extension = hasattr(p, "fsdp_pre_all_gather") or hasattr(p, "fsdp_shard")  # never trained
        trainable = p.requires_grad and not extension
        fsdp_param = FSDPParam(data, infos, mesh, device, param_dtypes(mp_policy, p.dtype, trainable),
                               offload, getattr(offload_policy, "pin_memory", False))
        if not (trainable or extension) and p.is_floating_point():  # frozen: if unfrozen later, narrower?
            wanted = param_dtypes(mp_policy, p.dtype, True).master
            fsdp_param.trained_master_dtype = wanted if wanted != fsdp_param.dtypes.master else None
        fsdp_params.append(fsdp_param)
        _CLAIMED[p] = type(modules[0]).__name__
    for fsdp_param in fsdp_params:
        fsdp_param.to_sharded()
    for m in modules:  # buffers follow the compute device
        for b_name, b in list(m.named_buffers()):
            if b.device != device and not b.is_meta:
                owner, _, leaf = b_name.rpartition(".")
                (m.get_submodule(owner) if owner else m)._buffers[leaf] = b.to(device)
    return fsdp_params


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


# -- the public module API -------------------------------------------------------------------
class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin a module gains from ``fully_shard`` (its class becomes ``FSDP<Class>``)."""

    _fsdp_state: "_FSDPState"

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now; with ``async_op`` return a handle to ``wait()`` on."""
        group = self._fsdp_state.group
        if group is not None:
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def _apply(self, fn, recurse: bool = True):
        # to_empty(device=...) after building on meta, or a device move: Module._apply gives the
        # module new DTensors; each FSDPParam adopts its new shard (PyTorch's FSDP2 does the same)
        module = super()._apply(fn, recurse)
        if self._fsdp_state.group is not None:
            for fsdp_param in self._fsdp_state.group.fsdp_params:
                fsdp_param.reset_sharded_param()
        return module

    def __deepcopy__(self, memo):
        raise RuntimeError(f"{type(self).__name__} is sharded by fully_shard and cannot be deep-copied (its "
                           f"parameters are shards tied to a process group): copy the model before fully_shard, "
                           f"or save its state dict and load it into a new one")

    def reshard(self) -> None:
        """Free this module's unsharded parameters (modules see the sharded DTensors again)."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def recover_from_error(self) -> None:
        """Bring every group under this module back to idle and sharded after an exception
        (e.g. out of memory) interrupted forward or backward.

        Finishes collectives already issued (every rank issued them, so they complete), frees
        unsharded parameters, drops unsharded and in-flight gradients and the rows HSDP kept for
        a later all-reduce (reduced shards already in ``.grad`` stay: clear them with
        ``optimizer.zero_grad()``) and clears the hook bookkeeping a broken forward/backward
        leaves behind. Call it on every rank.
        """
        states = {id(m._fsdp_state): m._fsdp_state for m in self.modules() if isinstance(m, FSDPModule)}
        roots = {id(s.root): s.root for s in states.values() if s.root is not None}
        for root in roots.values():   # root context -> state -> group -> parameter, each its own reset
            root.reset()
        for state in states.values():
            state.reset()

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        modules = self.modules() if recurse else [self]
        states = {id(m._fsdp_state): m._fsdp_state for m in modules if isinstance(m, FSDPModule)}
        return [s.group for s in states.values() if s.group is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded gradients locally (no reduce-scatter) until set back to True.
        Under HSDP it sets ``set_requires_all_reduce`` to the same value, as PyTorch's method.
        Raises TypeError for anything but a bool (a string such as "no" would read as True)."""
        check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation with sharded memory: False still reduce-scatters each
        microbatch's gradients within the shard group but keeps the reduced rows aside (no
        all-reduce across the replicas, no ``.grad`` yet); the next reduction with True adds them
        in and all-reduces once. Without a replica dimension it changes nothing. Raises
        TypeError for anything but a bool."""
        check_bool("requires_all_reduce", requires_all_reduce)
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backwards are not the step's last, so their end does not wait for the
        last reduce-scatter in flight (the next forward or backward finishes it); set True
        before the last microbatch's backward, whose end makes every ``.grad`` complete. Stays
        as set, as PyTorch's. Raises TypeError for anything but a bool."""
        check_bool("is_last_backward", is_last_backward)
        state = self._fsdp_state
        state.is_last_backward = is_last_backward
        if state.root is not None:
            state.root.is_last_backward = is_last_backward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep parameters gathered after backward (e.g. between gradient-accumulation steps).
        Raises TypeError for anything but a bool."""
        check_bool("reshard_after_backward", reshard_after_backward)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (bool only; TypeError otherwise)."""
        check_bool("reshard_after_forward", reshard_after_forward)
        for group in self._groups(recurse):
            group.reshard_after_forward = reshard_after_forward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not all-gather this module's own parameters again (nor prefetch
        them), for a module whose backward reads none of their values, such as an embedding
        (its weight's gradient needs only the token ids); the gradients are still reduced.
        A module whose backward does read them (a linear layer) then fails in backward with
        RuntimeError "... out of bounds for storage of size 0" (freed storage). Recomputed forwards (activation checkpointing) still gather. As
        PyTorch's method: this module's own groups. Raises TypeError for anything but a bool."""
        check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this module's gradients to the ranks' sum divided by ``factor`` (a positive
        number) instead of their mean, e.g. 1.0 for a loss already normalised by a global token
        count (PyTorch's method: this module's own groups, not its children's).
        Raises TypeError or ValueError for anything but a positive number."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor must be a number, got {factor!r}")
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor}; 1.0 sums the ranks' gradients")
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """PyTorch's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: the reduce-scatter (and HSDP's all-reduce) sum, and the mean or the divide factor
        is applied after them, as PyTorch's method (this module's own groups). Raises TypeError
        for anything but a bool."""
        check_bool("enable", enable)
        for group in self._groups(recurse=False):
            group.force_sum_reduction_for_comms = enable

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In forward, right after this module's all-gather, issue those of ``modules``."""
        self._fsdp_state.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In backward, issue the all-gathers of ``modules`` (instead of the implicit next one)."""
        self._fsdp_state.backward_prefetch = _states_of(modules)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run like its forward (as PyTorch's function of that name):
    the forward pre-hook (gather, prefetch, backward bookkeeping) before the method and the
    post-hook (reshard, output cast) after it. For a method that uses the module's own
    parameters without calling ``forward``. A module that is not an ``FSDPModule`` is left
    alone (the same code runs with and without FSDP).

    The patched method is an instance attribute that holds the module weakly, so dropping the
    model frees it without the collector. Raises ValueError if the module has no such method.
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register as a forward method")
    own = module.__dict__.get(method_name)  # already an instance attribute (registered before)
    unbound = inspect.getattr_static(type(module), method_name) if own is None else None
    module_ref = weakref.ref(module)

    @functools.wraps(own if own is not None else getattr(type(module), method_name))
    def run_as_forward(*args, **kwargs):
        owner = module_ref()
        state = owner._fsdp_state
        args, kwargs = state.pre_forward_hook(owner, args, kwargs)
        method = own if own is not None else unbound.__get__(owner, type(owner))
        output = method(*args, **kwargs)
        return state.post_forward_hook(owner, args, kwargs, output)

    setattr(module, method_name, run_as_forward)


def _states_of(modules: Iterable) -> list["_FSDPState"]:
    modules = list(modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"prefetch targets must be fully_shard-ed modules, got {type(m).__name__}")
    return [m._fsdp_state for m in modules]
