"""``FullyShardedDataParallel``: PyTorch's FSDP1 API over flat parameters.

``FullyShardedDataParallel(module, ...)`` mirrors ``torch.distributed.fsdp.FullyShardedDataParallel``.
One wrapper is one unit; ``auto_wrap_policy`` makes nested units. This file builds a unit
(wrapping, process groups, one flat parameter per (dtype, requires_grad), extension handles
for registered tensor types) and holds the public API (``no_sync``, ``clip_grad_norm_``,
``summon_full_params``, state dicts and their settings, optimizer state). When each unit gathers, frees and reduces is
``runtime.py``; a flat parameter's life is ``flat_param.py``, its gradient's ``flat_grad.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import collectives
from fsdp_lab.dist import current_device
from fsdp_lab.fsdp1 import clip, groups
from fsdp_lab.fsdp1 import optim_state
from fsdp_lab.fsdp1 import state_dict as sd
from fsdp_lab.fsdp1.api import (BackwardPrefetch, CPUOffload, ShardingStrategy, StateDictSettings, StateDictType,
                                check_option_types, from_torch)
from fsdp_lab.fsdp1.flat_grad import GRAD_ACCUMULATION_MODES, GradConfig
from fsdp_lab.fsdp1.flat_param import FlatParamHandle
from fsdp_lab.fsdp1.handle import FlatHandle, handle_factory_for
from fsdp_lab.fsdp1.layout import ParamInfo, ShardingSpec
from fsdp_lab.fsdp1.runtime import WRAPPED, ShardedUnit, claim, clean_name, owner_of, units_in
from fsdp_lab.fsdp1.wrap import recursive_wrap
from fsdp_lab.precision import MixedPrecision, ParamDtypes, param_dtypes

__all__ = ["FullyShardedDataParallel"]



def _not_here(instead: str):
    """A method of PyTorch's FSDP1 that this package lacks: calling it raises NotImplementedError
    naming it and ``instead`` (an unknown attribute would be looked up on the wrapped module and
    blamed on it)."""

    class Missing:
        def __set_name__(self, owner, name):
            self.name = name

        def __get__(self, instance, owner):
            name = self.name

            def refuse(*args, **kwargs):
                raise NotImplementedError(f"FullyShardedDataParallel.{name} is PyTorch's and not "
                                          f"implemented here: {instead}")
            return refuse

    return Missing()

class FullyShardedDataParallel(ShardedUnit):
    """Shard ``module``'s parameters over ranks (FlatParameter design, PyTorch's API).

    Same keywords and defaults as PyTorch's FSDP1 except ``use_orig_params=True`` (the only
    mode here) and the extra ``grad_accumulation``: "flat" (default) adds each parameter's
    gradient straight into one pre-allocated flat buffer in the accumulation dtype (fairscale PR
    #1186); "concat" keeps a per-parameter gradient in that dtype and concatenates them once all
    exist (fairscale's ``optimize_backward_concat``, PR #1184). PyTorch's FSDP1 does neither: the
    backward of the split that makes its parameter views yields one flat gradient in the
    compute dtype, cast once to ``reduce_dtype``.
    ``limit_all_gathers`` is PyTorch's rate limiter (``runtime.AllGatherLimiter``).

    Raises:
        RuntimeError: no default process group; ``module`` (or one of its parameters) is
            already managed by an FSDP1 unit.
        TypeError: an option of the wrong type (a string for ``sharding_strategy``, ...).
        ValueError: a process group this rank is not in or that does not span the world;
            HYBRID_SHARD on a world that does not factor; a GPU ``device_id`` without a GPU; a bad
            ``grad_accumulation``; ``use_orig_params=False``; ``keep_low_precision_grads``.
    """

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: ShardingStrategy | None = ShardingStrategy.FULL_SHARD,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy=None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None,
                 param_init_fn: Callable[[nn.Module], None] | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = True, *, grad_accumulation: str = "flat"):
        super().__init__()
        sharding_strategy, backward_prefetch = (from_torch(sharding_strategy, ShardingStrategy),
                                                from_torch(backward_prefetch, BackwardPrefetch))
        cpu_offload, mixed_precision = from_torch(cpu_offload, CPUOffload), from_torch(mixed_precision, MixedPrecision)
        check_option_types(sharding_strategy, cpu_offload, backward_prefetch, mixed_precision, auto_wrap_policy,
                           sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                           limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs a process group: run under "
                               "fsdp_lab.launch(...) or call fsdp_lab.init_distributed() first")
        _check_not_wrapped(module)
        if not use_orig_params:
            raise ValueError("use_orig_params=False (an optimizer over FlatParameters) is not implemented; "
                             "fsdp_lab's FSDP1 always exposes the original parameters: pass use_orig_params=True")
        if grad_accumulation not in GRAD_ACCUMULATION_MODES:
            raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATION_MODES}, got {grad_accumulation!r}")
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
            if not isinstance(m, nn.Module):
                raise TypeError(f"ignored_modules must be nn.Modules (e.g. [model.output]), got {type(m).__name__}")
            ignored.update(m.modules())
        self._ignored_modules = ignored

        on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        if not on_meta:
            module.to(self.compute_device)
        if auto_wrap_policy is not None:
            wrap_kwargs = dict(process_group=process_group, sharding_strategy=strategy, cpu_offload=cpu_offload,
                               backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
                               ignored_modules=ignored_modules, param_init_fn=param_init_fn, device_id=device_id,
                               sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                               limit_all_gathers=limit_all_gathers, grad_accumulation=grad_accumulation)
            recursive_wrap(module, auto_wrap_policy, functools.partial(FullyShardedDataParallel, **wrap_kwargs),
                           ignored, lambda m: isinstance(m, FullyShardedDataParallel))
        if on_meta:  # after the inner units: each materialised and sharded its own modules, one at a time
            _materialize_meta(module, ignored, param_init_fn, self.compute_device)
        if sync_module_states:
            _broadcast_from_rank0(module, ignored)
        self._fsdp_wrapped_module = module
        self._spec = ShardingSpec.over(self.shard_group, self.compute_device, self.cpu_offload.offload_params)
        self._handles = self._build_handles(module, ignored)
        self._reshard_after_forward = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        self._state_dict_settings = StateDictSettings(StateDictType.FULL_STATE_DICT)
        self._init_runtime()
        for path, unit in self.named_modules():  # name units by path; an outer unit renames inner ones
            if isinstance(unit, FullyShardedDataParallel):
                for handle in unit._handles:
                    handle.unit_name = clean_name(path).removesuffix(f".{WRAPPED}") or "root"

    # --- construction -----------------------------------------------------------------------------
    def _grad_config(self, dtypes: ParamDtypes) -> GradConfig:
        """The flat gradient buffer accumulates unsharded (as FSDP1 does without sync) and travels in the wire dtype."""
        return GradConfig(dtypes.unsharded_accumulation, dtypes.wire, self.grad_accumulation, self.replicate_group,
                          self.world_size)

    def _build_handles(self, module: nn.Module, ignored: set[nn.Module]) -> list[FlatHandle]:
        """One flat parameter per (dtype, requires_grad) among the unit's own parameters, and
        one handle per registered tensor type (``handle.register_handle_type``)."""
        infos: dict[int, ParamInfo] = {}
        by_kind: dict[tuple, list[ParamInfo]] = {}
        by_factory: dict[Any, list[ParamInfo]] = {}
        for prefix, sub in _owned_modules(module, ignored):
            for name, param in list(sub._parameters.items()):
                if param is None:
                    continue
                if id(param) in infos:  # tied weight: one slot, several homes
                    infos[id(param)].uses.append((sub, name))
                    continue
                if owner_of(param) is not None:
                    raise RuntimeError(f"parameter {prefix}{name} is already sharded by another FSDP1 unit "
                                       f"(tied across units?): tie weights only within one unit")
                info = ParamInfo(f"{prefix}{name}", param.shape, param.numel(), 0, param, [(sub, name)])
                infos[id(param)] = info
                factory = handle_factory_for(param)
                if factory is not None:  # e.g. packed NF4 storage: its own handle, never cast
                    by_factory.setdefault(factory, []).append(info)
                    continue
                own = param.dtype
                main = param_dtypes(self.mixed_precision, own, param.requires_grad).master
                if main != own:  # the flat shard (master weights) is built from what the module holds
                    param.data = param.data.to(main)
                by_kind.setdefault((param.dtype, param.requires_grad, own), []).append(info)
        name = type(module).__name__  # replaced by the unit's path once the outermost unit is built
        handles: list[FlatHandle] = []
        for (dtype, requires_grad, own), members in by_kind.items():
            dtypes = param_dtypes(self.mixed_precision, own, requires_grad)
            compute = dtypes.compute if dtype.is_floating_point else dtype
            handles.append(FlatParamHandle(members, self._spec, compute_dtype=compute, unit_name=name,
                                           grad_config=self._grad_config(dtypes) if requires_grad else None))
        for factory, members in by_factory.items():
            handles.append(factory(members, self._spec, param_dtype=self.mixed_precision.param_dtype, unit_name=name))
        for handle in handles:
            for info in handle.infos:
                claim(info.param, self)
        return handles

    # --- PyTorch's FSDP1 methods this package does not have: say so, and what to use --------------
    _USE_OPTIM_STATE_DICT = ("PyTorch deprecates it: use FSDP.optim_state_dict(model, optim) to save and "
                             "FSDP.optim_state_dict_to_load(model, optim, state) to load")
    full_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    sharded_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    shard_full_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    scatter_full_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    flatten_sharded_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    rekey_optim_state_dict = _not_here(_USE_OPTIM_STATE_DICT)
    register_comm_hook = _not_here("the gradient reduction is this package's own (MixedPrecision's "
                                   "reduce_dtype chooses the dtype it travels in)")
    check_is_root = _not_here("the outermost FullyShardedDataParallel of a model is its root")

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

    def _apply(self, fn, recurse: bool = True):
        # A move to where every tensor already is (model.to(device) after wrapping, or a parent unit
        # wrapping this one) changes nothing, yet torch's _apply would swap each tensor-subclass
        # parameter (an NF4 weight) with itself, which the weak references kept on it refuse.
        if all(fn(t) is t for t in [*self.parameters(), *self.buffers()]):
            return self
        return super()._apply(fn, recurse)

    def __getitem__(self, key: Any) -> Any:
        """Index the wrapped module (an ``nn.Sequential``'s ``model[0]``), as PyTorch's FSDP1 does.
        Raises what the wrapped module raises (TypeError when it cannot be indexed)."""
        return self._fsdp_wrapped_module[key]

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        """Original names (no ``_fsdp_wrapped_module.``) and the original Parameter objects,
        whose ``.data`` is this rank's 1-D slice (possibly empty) outside forward."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield clean_name(name), param

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(*args, **kwargs):
            yield clean_name(name), buf

    # --- gradient accumulation, clipping --------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full (unsharded) gradients locally, with no reduce-scatter, until the
        first backward after the block. Call on the root (the outermost) unit."""
        if self._root is None:
            self._lazy_init_root()
        if self._root is not self:
            raise RuntimeError("call no_sync() on the outermost FullyShardedDataParallel unit")
        self._shared.sync_gradients = False
        try:
            yield
        finally:
            self._shared.sync_gradients = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global ``norm_type``-norm is at most ``max_norm``.

        Each rank sums its own shards (every element lives on exactly one rank of the shard
        group; padding has zero gradient), one all-reduce adds the ranks. Returns the total
        norm (before clipping) as a float32 tensor, the same on every rank.
        """
        return clip.clip_grad_norm(self, max_norm, norm_type)

    # --- full parameters, state dicts ------------------------------------------------------------
    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False):
        """Context manager: inside it every original parameter has its full shape in the master
        dtype (one all-gather per flat parameter), as in PyTorch; see ``state_dict.summon_full_params``
        for ``rank0_only``, ``offload_to_cpu`` and ``with_grads``. Raises RuntimeError during
        backward, NotImplementedError for combinations PyTorch refuses too."""
        return sd.summon_full_params(module, recurse=recurse, writeback=writeback, rank0_only=rank0_only,
                                     offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                        optim_state_dict_config=None) -> Iterator[StateDictSettings]:
        """Within the block ``state_dict()``, ``load_state_dict`` and ``optim_state_dict`` of
        every unit in ``module`` use these settings (see ``set_state_dict_type``); the previous
        ones come back after it. Yields the previous settings."""
        before = {id(u): u._state_dict_settings for u in units_in(module)}
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                optim_state_dict_config)
        try:
            yield previous
        finally:
            for unit in units_in(module):
                unit._state_dict_settings = before.get(id(unit), unit._state_dict_settings)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config=None,
                            optim_state_dict_config=None) -> StateDictSettings:
        """Set what every unit in ``module`` gives from ``state_dict()`` / ``optim_state_dict`` until
        set again, as PyTorch's: the type (this package's ``StateDictType`` or PyTorch's) and
        PyTorch's config classes (``FullStateDictConfig(offload_to_cpu, rank0_only)``, ...; see
        ``api.StateDictSettings``). Returns the previous settings of the outermost unit. Raises
        TypeError, NotImplementedError (LOCAL_STATE_DICT) or RuntimeError (a config of the other
        kind, as PyTorch), naming the argument; ValueError for a module without units."""
        settings = StateDictSettings.checked(state_dict_type, state_dict_config, optim_state_dict_config)
        units = units_in(module)
        if not units:
            raise ValueError("set_state_dict_type: the module holds no FullyShardedDataParallel unit; wrap it first")
        previous = units[0]._state_dict_settings
        for unit in units:
            unit._state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The settings ``state_dict()`` uses now (those of the outermost unit in ``module``).
        Raises ValueError for a module without units."""
        units = units_in(module)
        if not units:
            raise ValueError("get_state_dict_type: the module holds no FullyShardedDataParallel unit")
        return units[0]._state_dict_settings

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """The units in ``module`` (itself included), outermost first; ``root_only``: only those
        not inside another unit of ``module``."""
        units = units_in(module)
        if not root_only:
            return units
        inner = {id(u) for unit in units for u in units_in(unit._fsdp_wrapped_module)}
        return [u for u in units if id(u) not in inner]

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None,
                         group=None) -> dict:
        """``optim``'s state keyed by parameter name, as PyTorch's: whole tensors (on CPU, every
        rank), or inside ``state_dict_type(model, SHARDED_STATE_DICT)`` 1-D ShardedTensors for
        ``torch.distributed.checkpoint``. ``optim_state_dict``: ``optim.state_dict()``'s form to
        convert instead of ``optim``'s own; ``group``: None or the model's own process group.
        Every rank calls it; see ``optim_state.optim_state_dict`` for what it raises."""
        optim_state.check_group(model, group)
        return optim_state.optim_state_dict(model, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group=None) -> dict:
        """This rank's ``optim.load_state_dict`` argument from ``optim_state_dict``'s output (saved
        at any world size); ``load_directly`` also loads it into ``optim``. Raises ValueError when
        it does not fit the optimizer or model or ``group`` is not the model's, and
        NotImplementedError for ``is_named_optimizer`` (torchrec's keyed optimizers)."""
        optim_state.check_group(model, group)
        if is_named_optimizer:
            raise NotImplementedError("is_named_optimizer=True (torchrec's KeyedOptimizer or NamedOptimizer) is not "
                                      "supported: build a torch.optim optimizer over model.parameters()")
        loadable = optim_state.optim_state_dict_to_load(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(loadable)
        return loadable

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Full (default) or sharded state dict with original names; see ``state_dict.py``."""
        settings = self._state_dict_settings
        if settings.state_dict_type == StateDictType.FULL_STATE_DICT:
            offload_to_cpu, rank0_only = settings.full_options()
            result = sd.full_state_dict(self, offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
        else:
            result = sd.sharded_state_dict(self)
        result = {prefix + k: v for k, v in result.items()}
        if destination is not None:
            destination.update(result)
            return destination
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load what ``state_dict()`` returned (same state dict type, same world size for sharded)
        by copying into the shards; returns ``(missing_keys, unexpected_keys)`` as
        ``nn.Module.load_state_dict`` does. Raises ``StateDictMismatch`` (a RuntimeError) for names
        that do not match under ``strict``, NotImplementedError for ``assign=True`` (the shards
        are FSDP's own tensors: nothing of the state dict can take their place)."""
        if assign:
            raise NotImplementedError("load_state_dict(assign=True): an FSDP1 model copies a state dict into "
                                      "its shards; leave assign out")
        if self._state_dict_settings.state_dict_type == StateDictType.FULL_STATE_DICT:
            return sd.load_full_state_dict(self, state_dict, strict=strict)
        return sd.load_sharded_state_dict(self, state_dict, strict=strict)

    def __deepcopy__(self, memo):
        raise RuntimeError("a FullyShardedDataParallel model cannot be deep-copied (its parameters are shards "
                           "tied to a process group): copy the model before wrapping it, or save its state dict "
                           "and load it into a new one")

    def extra_repr(self) -> str:
        return f"sharding_strategy={self.sharding_strategy.name}, flat_params={len(self._handles)}"


# --- helpers -----------------------------------------------------------------------------------------
def _check_not_wrapped(module: nn.Module) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise RuntimeError("this module is already a FullyShardedDataParallel unit; wrap it once "
                           "(use auto_wrap_policy for nested units)")
    for name, param in module.named_parameters():
        if owner_of(param) is not None and not _inside_unit(module, param):
            raise RuntimeError(f"parameter {clean_name(name)} is already managed by FullyShardedDataParallel; "
                               f"wrap each module once")


def _inside_unit(module: nn.Module, param: nn.Parameter) -> bool:
    """True when ``param`` belongs to an FSDP1 unit nested inside ``module`` (manual wrapping)."""
    return any(owner_of(param) is unit for unit in units_in(module))


def _owned_modules(module: nn.Module, ignored: set[nn.Module], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its descendants, stopping at nested units and ignored modules."""
    if module in ignored:
        return
    yield prefix, module
    for name, child in module.named_children():
        if isinstance(child, ShardedUnit):
            continue
        yield from _owned_modules(child, ignored, f"{prefix}{name}.")


def _resolve_device(device_id) -> torch.device:
    if device_id is None:
        return current_device()
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cpu":
        return device  # what PyTorch's FSDP1 needs on CPU ranks: code written for it runs unchanged
    if not torch.cuda.is_available():
        raise ValueError(f"device_id={device_id!r} was given but this machine has no CUDA GPU; "
                         f"leave device_id=None (or pass torch.device('cpu')) to run on CPU")
    return device


def _materialize_meta(module: nn.Module, ignored: set[nn.Module], param_init_fn, device: torch.device) -> None:
    """PyTorch's meta-device init: ``param_init_fn(m)`` for each module this unit owns that has
    meta tensors (outer modules first), or, without one, ``m.to_empty(device, recurse=False)``
    then ``m.reset_parameters()``; tied parameters are tied again. Raises ValueError naming a module without
    ``reset_parameters`` (and no ``param_init_fn``) or a tensor left on meta."""
    def has_meta(m: nn.Module) -> bool:
        return any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()])

    # a parameter registered in several modules (tied weights) is materialised once per module by
    # to_empty; they are tied again below, to the first module's, as a model built off meta has them
    owned = list(_owned_modules(module, ignored))
    shared: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for _, sub in owned:
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                shared.setdefault(id(param), (param, []))[1].append((sub, name))
    for prefix, sub in owned:
        if not has_meta(sub):
            continue
        if param_init_fn is not None:
            param_init_fn(sub)
        elif hasattr(sub, "reset_parameters"):
            sub.to_empty(device=device, recurse=False)
            sub.reset_parameters()
        else:
            raise ValueError(f"{prefix.rstrip('.') or type(sub).__name__} ({type(sub).__name__}) is on the meta device "
                             "and has no reset_parameters(); give it one, or pass param_init_fn=fn where "
                             "fn(module) calls module.to_empty(device=..., recurse=False) and initialises it")
        if has_meta(sub):
            left = [n for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None and t.is_meta]
            raise ValueError(f"{prefix.rstrip('.') or type(sub).__name__} still has {left} on the meta device after "
                             f"{'param_init_fn' if param_init_fn else 'to_empty + reset_parameters'}; "
                             "param_init_fn(module) must materialise the module's own tensors, e.g. "
                             "module.to_empty(device=..., recurse=False) and then initialise them")
        sub._apply(lambda t: t.to(device), recurse=False)  # param_init_fn may have chosen another device
    for _, places in shared.values():
        (first, first_name), *others = places
        for sub, name in others:
            sub._parameters[name] = first._parameters[first_name]


@torch.no_grad()
def _broadcast_from_rank0(module: nn.Module, ignored: set[nn.Module]) -> None:
    for _, sub in _owned_modules(module, ignored):
        for tensor in list(sub._parameters.values()) + list(sub._buffers.values()):
            if tensor is not None:
                collectives.broadcast(tensor.data if isinstance(tensor, nn.Parameter) else tensor, 0)
