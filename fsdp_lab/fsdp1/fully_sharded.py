"""The FSDP1 wrapper: when each unit gathers, frees and reduces (the parameter's schedule).

``FullyShardedDataParallel(module, ...)`` mirrors ``torch.distributed.fsdp.FullyShardedDataParallel``.
One wrapper is one unit; ``auto_wrap_policy`` makes nested units. Per step, for a unit:

    forward   _pre_forward:   all-gather (or wait for the prefetched one), views into modules,
                              [forward_prefetch: start the next unit's all-gather]
              module forward
              _post_forward:  Parameters back on the modules; FULL_SHARD frees the gathered
                              flat params (not the root: backward needs it at once)
    backward  _pre_backward:  (first grad of the unit's outputs) all-gather again,
                              [BACKWARD_PRE: start the next unit's all-gather]
              module backward
              _on_grads_ready:(all the unit's parameter grads exist) free, [BACKWARD_POST
                              prefetch], start the reduce-scatter  (flat_grad.py)
              _on_input_grads:(grads w.r.t. the unit's inputs exist) free frozen flat params
    end of backward (root):   wait for every reduce, free what is left, reset.

These are the places where collective-synchronising hooks belong (pre-forward,
pre-backward, post-backward). Layout and gather/free: flat_param.py. Gradients: flat_grad.py.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from fsdp_lab import collectives, sync_points
from fsdp_lab.fsdp1 import flat_grad, groups
from fsdp_lab.fsdp1.api import BackwardPrefetch, CPUOffload, ShardingStrategy, StateDictType
from fsdp_lab.fsdp1.flat_param import FlatParamHandle, ParamInfo
from fsdp_lab.fsdp1.nf4_handle import NF4FlatParamHandle
from fsdp_lab.qlora.nf4_tensor import NF4Tensor
from fsdp_lab.fsdp1.wrap import recursive_wrap
from fsdp_lab.precision import (MixedPrecision, accumulation_dtype, cast_floating, grad_comm_dtype,
                                main_params_dtype, reduce_dtype, tensors_in)

WRAPPED = "_fsdp_wrapped_module"


class FullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters over ranks (FlatParameter design, PyTorch's API).

    Same keywords and defaults as PyTorch's FSDP1 except ``use_orig_params=True`` (the only
    mode here) and the extra ``grad_accumulation``: "flat" (default) adds each parameter's
    gradient straight into one pre-allocated flat buffer in the reduce dtype; "concat"
    builds per-parameter reduce-dtype gradients and concatenates them (PyTorch's way).

    Raises:
        RuntimeError: no default process group; ``module`` (or one of its parameters) is
            already managed by an FSDP1 unit.
        ValueError: a process group this rank is not in or that does not span the world;
            HYBRID_SHARD on a world that does not factor; ``device_id`` without a GPU; a bad
            ``grad_accumulation``; ``use_orig_params=False``; ``keep_low_precision_grads``.
    """

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: ShardingStrategy | None = ShardingStrategy.FULL_SHARD,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = True, *, grad_accumulation: str = "flat"):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs a process group: run under "
                               "fsdp_lab.launch(...) or call fsdp_lab.init_distributed() first")
        _check_not_wrapped(module)
        if not use_orig_params:
            raise ValueError("use_orig_params=False (an optimizer over FlatParameters) is not implemented; "
                             "fsdp_lab's FSDP1 always exposes the original parameters: pass use_orig_params=True")
        if grad_accumulation not in flat_grad.GRAD_ACCUMULATION_MODES:
            raise ValueError(f"grad_accumulation must be one of {flat_grad.GRAD_ACCUMULATION_MODES}, "
                             f"got {grad_accumulation!r}")
        mixed_precision = mixed_precision or MixedPrecision()
        if mixed_precision.keep_low_precision_grads:
            raise ValueError("keep_low_precision_grads=True cannot work with original parameters whose "
                             ".grad must match their dtype; leave it False")
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        self.sharding_strategy, self.backward_prefetch = strategy, backward_prefetch
        self.forward_prefetch, self.limit_all_gathers = forward_prefetch, limit_all_gathers
        self.mixed_precision, self.cpu_offload = mixed_precision, cpu_offload or CPUOffload()
        self.grad_accumulation = grad_accumulation
        self.compute_device = _resolve_device(device_id)
        self.shard_group, self.replicate_group = groups.resolve(process_group, strategy)
        self.world_size = dist.get_world_size()
        ignored = set()
        for m in ignored_modules or ():
            ignored.update(m.modules())
        self._ignored_modules = ignored

        module.to(self.compute_device)
        if auto_wrap_policy is not None:
            wrap_kwargs = dict(process_group=process_group, sharding_strategy=strategy, cpu_offload=cpu_offload,
                               backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                               ignored_modules=ignored_modules, device_id=device_id,
                               sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                               limit_all_gathers=limit_all_gathers, grad_accumulation=grad_accumulation)
            recursive_wrap(module, auto_wrap_policy, functools.partial(FullyShardedDataParallel, **wrap_kwargs),
                           ignored, lambda m: isinstance(m, FullyShardedDataParallel))
        if sync_module_states:
            _broadcast_from_rank0(module, ignored)
        self._fsdp_wrapped_module = module
        self._handles = self._build_handles(module, ignored)
        self._reshard_after_forward = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        # accumulation buffer in main_grads_dtype (PyTorch: the reduce dtype), wire in grad_comm_dtype
        self._grad_states = {id(h): flat_grad.GradState(
            accumulation_dtype(mixed_precision.main_grads_dtype, h.compute_dtype,
                               reduce_dtype(mixed_precision, h.compute_dtype)),
            grad_accumulation, comm_dtype=grad_comm_dtype(mixed_precision, h.compute_dtype))
            for h in self._handles if h.requires_grad}
        # run-time state; the root (the outermost unit called) owns the shared part
        self.__dict__["_root"] = None  # a plain reference, not a submodule
        self._pre_backward_done = False
        self._post_prefetched = False
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        for path, unit in self.named_modules():  # name units by path; an outer unit renames inner ones
            if isinstance(unit, FullyShardedDataParallel):
                for handle in unit._handles:
                    handle.unit_name = _clean(path).removesuffix(f".{WRAPPED}") or "root"

    # --- construction -----------------------------------------------------------------------------
    def _build_handles(self, module: nn.Module, ignored: set[nn.Module]) -> list[FlatParamHandle]:
        """One flat parameter per (dtype, requires_grad) among the unit's own parameters."""
        infos: dict[int, ParamInfo] = {}
        groups_by_kind: dict[tuple, list[ParamInfo]] = {}
        nf4_infos: list[ParamInfo] = []
        for prefix, sub in _owned_modules(module, ignored):
            for name, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if id(param) in infos:  # tied weight: one slot, several homes
                    infos[id(param)].uses.append((sub, name))
                    continue
                if getattr(param, "_fsdp1_unit", None) is not None:
                    raise RuntimeError(f"parameter {prefix}{name} is already sharded by another FSDP1 unit "
                                       f"(tied across units?): tie weights only within one unit")
                if isinstance(param, NF4Tensor):  # packed storage: its own flat params, never cast
                    info = ParamInfo(f"{prefix}{name}", param.shape, param.numel(), 0, param, [(sub, name)])
                    infos[id(param)] = info
                    nf4_infos.append(info)
                    continue
                own = param.dtype
                main = main_params_dtype(self.mixed_precision, own, param.requires_grad)
                if main != own:  # the flat shard (master weights) is built from what the module holds
                    param.data = param.data.to(main)
                kind = (param.dtype, param.requires_grad, own)
                info = ParamInfo(f"{prefix}{name}", param.shape, param.numel(), 0, param, [(sub, name)])
                infos[id(param)] = info
                groups_by_kind.setdefault(kind, []).append(info)
        handles = []
        name = type(module).__name__  # replaced by the unit's path at the root's first forward
        for (dtype, requires_grad, own), members in groups_by_kind.items():
            offset = 0
            for info in members:
                info.offset, offset = offset, offset + info.numel
                info.param._fsdp1_unit = self
            compute = self.mixed_precision.param_dtype or own if dtype.is_floating_point else dtype
            handles.append(FlatParamHandle(
                members, unit_name=name, shard_group=self.shard_group,
                shard_rank=dist.get_rank(self.shard_group) if self.shard_group is not None else 0,
                shard_size=dist.get_world_size(self.shard_group) if self.shard_group is not None else 1,
                device=self.compute_device, compute_dtype=compute,
                offload=self.cpu_offload.offload_params))
        if nf4_infos:
            handles.append(NF4FlatParamHandle.for_unit(self, nf4_infos, name))
        return handles

    # --- names: look through the wrapper like PyTorch does ---------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        """Original names (no ``_fsdp_wrapped_module.``) and the original Parameter objects,
        whose ``.data`` is this rank's 1-D slice (possibly empty) outside forward."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield _clean(name), param

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(*args, **kwargs):
            yield _clean(name), buf

    # --- forward --------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._root is None:
            self._lazy_init_root()
        root = self._root
        if self is root and self.mixed_precision.cast_root_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mixed_precision.param_dtype)
        elif self.mixed_precision.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mixed_precision.param_dtype)
        self._pre_forward(args, kwargs)
        output = self._fsdp_wrapped_module(*args, **kwargs)
        self._post_forward(output)
        return output

    def _lazy_init_root(self) -> None:
        self._units = []
        for unit in self.modules():
            if isinstance(unit, FullyShardedDataParallel):
                unit.__dict__["_root"] = self
                self._units.append(unit)
        self._exec_order: list[FullyShardedDataParallel] = []
        self._order_recorded = False
        self._in_backward = False
        self._sync_gradients = True
        self._reduce_queue: list[tuple[FullyShardedDataParallel, FlatParamHandle]] = []
        if self.mixed_precision.buffer_dtype is not None:
            for buf_owner in self.modules():
                for key, buf in buf_owner._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        buf_owner._buffers[key] = buf.to(self.mixed_precision.buffer_dtype)

    def _pre_forward(self, args, kwargs) -> None:
        root = self._root
        sync_points.fire("pre_forward", self._name)
        if not root._order_recorded:
            root._exec_order.append(self)
        track = torch.is_grad_enabled()
        for handle in self._handles:
            handle.unshard()
        for handle in self._handles:
            handle.wait_unshard()
            trainable = track and handle.requires_grad
            handle.use_unsharded_views(track_grads=trainable)
            if trainable:
                state = self._grad_states[id(handle)]
                flat_grad.register_grad_hooks(handle, state, self._on_grads_ready)
        if self.forward_prefetch and root._order_recorded:
            order = root._exec_order
            ahead = order[order.index(self) + 1:] if self in order else []
            for unit in ahead[:1] if self.limit_all_gathers else ahead:
                unit._start_unshard()
        inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        frozen = [h for h in self._handles if not h.requires_grad]
        if track and frozen and inputs:
            register_multi_grad_hook(inputs, self._on_input_grads, mode="all")

    def _post_forward(self, output) -> None:
        for handle in self._handles:
            handle.use_sharded_views()
        if self is self._root:
            self._order_recorded = True
        if not torch.is_grad_enabled() or (self._reshard_after_forward and self is not self._root):
            for handle in self._handles:
                handle.reshard()
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            register_multi_grad_hook(outputs, self._pre_backward, mode="any")

    def _start_unshard(self) -> None:
        for handle in self._handles:
            handle.unshard()

    # --- backward -------------------------------------------------------------------------------------
    def _pre_backward(self, _grad) -> None:
        root = self._root
        if not root._in_backward:
            root._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
        if self._pre_backward_done:
            return
        sync_points.fire("pre_backward", self._name)
        self._pre_backward_done = True
        for handle in self._handles:
            handle.unshard()
        for handle in self._handles:
            handle.wait_unshard()
            handle.restore_leaf_views()
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        order = self._root._exec_order
        if self not in order:
            return
        index = order.index(self)
        for unit in reversed(order[:index]):
            if not unit._pre_backward_done:
                unit._start_unshard()
                return

    def _on_grads_ready(self, handle: FlatParamHandle) -> None:
        root = self._root
        sync_points.fire("post_backward", self._name)
        handle.reshard()
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_POST and not self._post_prefetched:
            self._post_prefetched = True
            self._prefetch_backward()
        state = self._grad_states[id(handle)]
        state.seen = set(range(len(handle.leaves)))  # done for this backward
        if root._sync_gradients:
            # One reduce in flight overlaps with the next unit's backward; waiting for the
            # older one first bounds the full-size gradients alive to about two units'.
            if root._reduce_queue:
                root._finish_oldest_reduce()
            flat_grad.start_reduce(handle, state)
            root._reduce_queue.append((self, handle))
        else:
            flat_grad.flush_pending(handle, state)

    def _finish_oldest_reduce(self) -> None:
        unit, handle = self._reduce_queue.pop(0)
        flat_grad.finish_reduce(handle, unit._grad_states[id(handle)],
                                replicate_group=unit.replicate_group, world_size=unit.world_size)

    def _on_input_grads(self, _grads) -> None:
        for handle in self._handles:
            if not handle.requires_grad:
                handle.reshard()

    def _finish_backward(self) -> None:
        """End of backward (root only): reduce what is left, wait for every reduce, free all."""
        for unit in self._units:
            for handle in unit._handles:
                state = unit._grad_states.get(id(handle))
                if state is not None and state.seen and len(state.seen) < len(handle.leaves):
                    unit._on_grads_ready(handle)  # some parameters got no gradient: they count as zero
        while self._reduce_queue:
            self._finish_oldest_reduce()
        for unit in self._units:
            for handle in unit._handles:
                handle.reshard()
                handle.use_sharded_views()
                handle.leaves = []
            unit._pre_backward_done = False
            unit._post_prefetched = False
        self._in_backward = False

    def recover_from_error(self) -> None:
        """Bring every unit back to idle and sharded after an exception (e.g. out of memory)
        interrupted forward or backward. Call it on the root, on every rank.

        Waits for collectives already issued (every rank issued them, so they complete),
        frees gathered flat parameters, drops full-size and in-flight gradients (reduced shards
        already in ``.grad`` stay: clear them with ``optimizer.zero_grad()``) and clears the
        bookkeeping a broken step leaves behind.
        """
        if self._root is None:
            return
        root = self._root
        for unit, handle in root._reduce_queue:
            state = unit._grad_states[id(handle)]
            if state.reduce is not None and state.reduce[1] is not None:
                state.reduce[1].wait()
            state.reduce = None
        root._reduce_queue, root._in_backward = [], False
        for unit in root._units:
            unit._pre_backward_done = unit._post_prefetched = False
            for handle in unit._handles:
                handle.reshard()  # waits for an issued all-gather first
                handle.use_sharded_views()
                handle.leaves = []
                state = unit._grad_states.get(id(handle))
                if state is not None:
                    state.buffer, state.pending, state.seen, state.reduce = None, {}, set(), None

    @property
    def _name(self) -> str:
        return self._handles[0].unit_name if self._handles else "root"

    # --- gradient accumulation, clipping --------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full (unsharded) gradients locally, with no reduce-scatter, until the
        first backward after the block. Call on the root (the outermost) unit."""
        if self._root is None:
            self._lazy_init_root()
        if self._root is not self:
            raise RuntimeError("call no_sync() on the outermost FullyShardedDataParallel unit")
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global ``norm_type``-norm is at most ``max_norm``.

        Each rank sums its own shards (every element lives on exactly one rank of the shard
        group; padding has zero gradient), one all-reduce adds the ranks. Returns the total
        norm (before clipping) as a float32 tensor, the same on every rank.
        """
        return flat_grad.clip_grad_norm(self, max_norm, norm_type)

    # --- full parameters, state dicts ------------------------------------------------------------
    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False):
        """Context manager: inside it every original parameter has its full shape and own dtype
        (one all-gather per flat parameter). With ``writeback`` changes to this rank's part are
        copied back to the shard on exit. Raises RuntimeError during backward."""
        from fsdp_lab.fsdp1 import state_dict as sd

        return sd.summon_full_params(module, recurse=recurse, writeback=writeback)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType) -> Iterator[None]:
        """Within the block ``module.state_dict()`` / ``load_state_dict`` use ``state_dict_type``."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        before = [u._state_dict_type for u in units]
        for unit in units:
            unit._state_dict_type = state_dict_type
        try:
            yield
        finally:
            for unit, old in zip(units, before):
                unit._state_dict_type = old

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Full (default) or sharded state dict with original names; see ``state_dict.py``."""
        from fsdp_lab.fsdp1 import state_dict as sd

        result = sd.full_state_dict(self) if self._state_dict_type == StateDictType.FULL_STATE_DICT \
            else sd.sharded_state_dict(self)
        result = {prefix + k: v for k, v in result.items()}
        if destination is not None:
            destination.update(result)
            return destination
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load what ``state_dict()`` returned (same state dict type, same world size for sharded)."""
        from fsdp_lab.fsdp1 import state_dict as sd

        if self._state_dict_type == StateDictType.FULL_STATE_DICT:
            return sd.load_full_state_dict(self, state_dict, strict=strict)
        return sd.load_sharded_state_dict(self, state_dict, strict=strict)

    def extra_repr(self) -> str:
        return f"sharding_strategy={self.sharding_strategy.name}, flat_params={len(self._handles)}"


# --- helpers -----------------------------------------------------------------------------------------
def _clean(name: str) -> str:
    return name.replace(f"{WRAPPED}.", "")


def _check_not_wrapped(module: nn.Module) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise RuntimeError("this module is already a FullyShardedDataParallel unit; wrap it once "
                           "(use auto_wrap_policy for nested units)")
    for name, param in module.named_parameters():
        if getattr(param, "_fsdp1_unit", None) is not None and not _inside_unit(module, param):
            raise RuntimeError(f"parameter {_clean(name)} is already managed by FullyShardedDataParallel; "
                               f"wrap each module once")


def _inside_unit(module: nn.Module, param: nn.Parameter) -> bool:
    """True when ``param`` belongs to an FSDP1 unit nested inside ``module`` (manual wrapping)."""
    return any(isinstance(m, FullyShardedDataParallel) and param._fsdp1_unit is m for m in module.modules())


def _owned_modules(module: nn.Module, ignored: set[nn.Module], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its descendants, stopping at nested units and ignored modules."""
    if module in ignored:
        return
    yield prefix, module
    for name, child in module.named_children():
        if isinstance(child, FullyShardedDataParallel):
            continue
        yield from _owned_modules(child, ignored, f"{prefix}{name}.")


def _resolve_device(device_id) -> torch.device:
    if device_id is None:
        from fsdp_lab.dist import current_device
        return current_device()
    if not torch.cuda.is_available():
        raise ValueError(f"device_id={device_id!r} was given but this machine has no CUDA GPU; "
                         f"leave device_id=None to run on CPU")
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module, ignored: set[nn.Module]) -> None:
    for _, sub in _owned_modules(module, ignored):
        for tensor in list(sub._parameters.values()) + list(sub._buffers.values()):
            if tensor is not None:
                collectives.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, 0)
