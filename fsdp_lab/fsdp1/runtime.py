"""When each FSDP1 unit gathers, frees and reduces: the hooks of one step.

``ShardedUnit`` is the run-time half of ``FullyShardedDataParallel`` (construction and the
public API are in ``fully_sharded.py``). One unit per wrapped module; its flat parameters
are ``handle.FlatHandle``s. Per step, for a unit:

    forward   _pre_forward:   all-gather (or wait for the prefetched one), views into modules,
                              [forward_prefetch: start the next unit's all-gather]
              module forward
              _post_forward:  Parameters back on the modules; FULL_SHARD frees the gathered
                              flat params (not the root: backward needs it at once)
    backward  _pre_backward:  (first grad of the unit's outputs) all-gather again,
                              [BACKWARD_PRE: start the next unit's all-gather]
              module backward
              _post_backward: (a handle's flat gradient has all its parts) free,
                              [BACKWARD_POST prefetch], queue its reduce-scatter
              _on_input_grads:(grads w.r.t. the inputs of every forward since the last backward
                              exist) free frozen flat params
    end of backward (root):   wait for every reduce, free what is left, reset.

These are the places where collective-synchronising hooks belong (pre-forward,
pre-backward, post-backward). The root (the outermost unit called) owns what all units
share (``_RootState``): the execution order, the reduce queue, the all-gather limiter.
Units refer to the root weakly; the root finds its units through ``modules()``.
"""

from __future__ import annotations

import collections
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_lab import sync_points
from fsdp_lab.fsdp1.api import BackwardPrefetch
from fsdp_lab.fsdp1.flat_grad import FlatGrad
from fsdp_lab.fsdp1.handle import FlatHandle
from fsdp_lab.passthrough import call_after_input_grads
from fsdp_lab.precision import cast_floating, tensors_in
from fsdp_lab.states import ShardedState, StepState, TrainingState, assert_in_states

__all__ = ["ShardedUnit", "units_in", "owner_of", "claim", "clean_name", "WRAPPED", "BUFFER_DTYPES"]

WRAPPED = "_fsdp_wrapped_module"

# Original parameter -> weak reference to the unit that manages it. Weak both ways: a
# parameter pointing at its unit would keep the whole model in a reference cycle.
_OWNERS = WeakIdKeyDictionary()

# A buffer cast to MixedPrecision.buffer_dtype -> the dtype it had: state dicts give it back in
# that dtype, as PyTorch's FSDP1 does.
BUFFER_DTYPES = WeakIdKeyDictionary()


def owner_of(param: torch.Tensor) -> "ShardedUnit | None":
    """The FSDP1 unit managing ``param``, or None."""
    ref = _OWNERS.get(param)
    return ref() if ref is not None else None


def claim(param: torch.Tensor, unit: "ShardedUnit") -> None:
    """Record that ``unit`` manages ``param``."""
    _OWNERS[param] = weakref.ref(unit)


def units_in(module: nn.Module) -> list["ShardedUnit"]:
    """Every FSDP1 unit in ``module`` (itself included), outermost first."""
    return [m for m in module.modules() if isinstance(m, ShardedUnit)]


def clean_name(name: str) -> str:
    """A parameter or module path without the wrappers' ``_fsdp_wrapped_module.``."""
    return name.replace(f"{WRAPPED}.", "")


class _Forward:
    """A token for one forward of a unit (see ``ShardedUnit._on_input_grads``)."""

    __slots__ = ("__weakref__",)


def _weak_callback(unit: "ShardedUnit", method: str, *args) -> Callable[[], None]:
    """``getattr(unit, method)(*args)`` while ``unit`` lives; holds it weakly (autograd hooks
    that call back into the unit live on tensors the unit holds)."""
    ref = weakref.ref(unit)

    def call(*_ignored) -> None:
        owner = ref()
        if owner is not None:
            getattr(owner, method)(*args)

    return call


class ReduceQueue:
    """The flat gradients being reduced, oldest first: at most one in flight in backward.

    One reduce-scatter in flight overlaps with the next unit's backward; finishing the older
    one before the next starts bounds the full-size gradients alive to about two units'.
    """

    def __init__(self):
        self._in_flight: list[FlatGrad] = []

    def submit(self, flat_grad: FlatGrad) -> None:
        """Finish the reduce in flight, then let ``flat_grad`` start its own."""
        self.drain()
        flat_grad.start_reduce()
        self._in_flight.append(flat_grad)

    def drain(self) -> None:
        """Finish every reduce in flight (their shards land in ``.grad``)."""
        while self._in_flight:
            self._in_flight.pop(0).finish_reduce()

    def reset(self) -> None:
        """Drop every reduce in flight (after an error): waited for, not applied."""
        for flat_grad in self._in_flight:
            flat_grad.reset()
        self._in_flight = []


class _HostEvent:
    """A free on the host is finished when it returns: nothing to wait for."""

    def synchronize(self) -> None:
        pass


class AllGatherLimiter:
    """PyTorch's ``limit_all_gathers``: at most ``MAX_IN_FLIGHT`` all-gathers ahead of the frees.

    Every free of gathered parameters records an event; before issuing an all-gather the
    host waits for the free ``MAX_IN_FLIGHT`` frees ago to have happened on the device. On
    a GPU this stops the host, which runs ahead of the kernels, from issuing every unit's
    all-gather at once; on CPU a free happens when it is called, so the wait never blocks.
    ``waits`` counts the times the limit was reached.
    """

    MAX_IN_FLIGHT = 2  # PyTorch's empirically chosen value

    def __init__(self, device: torch.device):
        self.device = device
        self._frees: collections.deque = collections.deque()
        self.waits = 0

    def record_free(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        else:
            event = _HostEvent()
        self._frees.append(event)

    def before_all_gather(self) -> None:
        if len(self._frees) >= self.MAX_IN_FLIGHT:
            self._frees.popleft().synchronize()
            self.waits += 1


class _RootState:
    """What the root unit shares with every unit below it (units are held weakly)."""

    def __init__(self, device: torch.device):
        self._exec_order: list[weakref.ref] = []  # units in the order their forward began
        self.order_recorded = False                 # after the first forward: prefetch by it
        self.step = StepState.IDLE
        self.sync_gradients = True                  # False inside no_sync()
        self.reduces = ReduceQueue()
        self.limiter = AllGatherLimiter(device)

    def reset(self) -> None:
        """After an interrupted step: drop the reduces in flight, leave the backward."""
        self.reduces.reset()
        self.step = StepState.IDLE

    @property
    def exec_order(self) -> list["ShardedUnit"]:
        return [unit for ref in self._exec_order if (unit := ref()) is not None]

    def record(self, unit: "ShardedUnit") -> None:
        self._exec_order.append(weakref.ref(unit))


class ShardedUnit(nn.Module):
    """The hooks of one FSDP1 unit. Subclasses set, before the first forward:
    ``_fsdp_wrapped_module``, ``_handles`` (list of ``FlatHandle``), ``mixed_precision``,
    ``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``,
    ``_reshard_after_forward`` and ``compute_device``."""

    _handles: list[FlatHandle]

    def _init_runtime(self) -> None:
        self.__dict__["_root_ref"] = None  # weak: the root holds its units, not the other way round
        self.__dict__["_root_state"] = None  # only on the root
        self.training_state = TrainingState.IDLE
        self._summoned_whole = False  # inside summon_full_params with this rank's parameters whole
        self._under_summoned = False  # an enclosing unit is summoned, this one is not (recurse=False)
        # one token per tracked forward whose input gradients have not come back; only that
        # forward's graph holds it, so a graph dropped without backward (an evaluation with grad
        # on, a recomputation's) leaves the set by itself
        self._forwards_awaiting_input_grads: weakref.WeakSet[_Forward] = weakref.WeakSet()
        self._running_forward = False  # inside this unit's forward, which calls the wrapped module
        # A call of the wrapped module that goes past this unit (``model.generate()``, which the
        # wrapper hands to the inner model, or ``model.module(...)``) would meet 1-D shards
        self._fsdp_wrapped_module.register_forward_pre_hook(_weak_callback(self, "_check_called_through_unit"))

    def reset_runtime(self) -> None:
        """After an interrupted step: this unit idle, its flat parameters reset."""
        self.training_state = TrainingState.IDLE
        self._forwards_awaiting_input_grads.clear()
        for handle in self._handles:
            handle.reset()

    # --- the root ------------------------------------------------------------------------------------
    @property
    def _root(self) -> "ShardedUnit | None":
        """The outermost unit of the last forward (None before the first)."""
        ref = self.__dict__["_root_ref"]
        return ref() if ref is not None else None

    @property
    def _shared(self) -> _RootState:
        return self._root.__dict__["_root_state"]

    def _lazy_init_root(self) -> None:
        for unit in units_in(self):
            unit.__dict__["_root_ref"] = weakref.ref(self)
        self.__dict__["_root_state"] = _RootState(self.compute_device)
        if self.mixed_precision.buffer_dtype is not None:
            for buf_owner in self.modules():
                for key, buf in buf_owner._buffers.items():
                    if buf is not None and buf.is_floating_point():
                        cast = buf_owner._buffers[key] = buf.to(self.mixed_precision.buffer_dtype)
                        BUFFER_DTYPES[cast] = BUFFER_DTYPES.get(buf, buf.dtype)

    @property
    def _name(self) -> str:
        return self._handles[0].unit_name if self._handles else "root"

    # --- forward --------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._root is None:
            self._lazy_init_root()
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:
            return self._forward_summoned(args, kwargs)
        if self._under_summoned:
            self._check_dtype_under_summoned()
        policy = self.mixed_precision
        if self is self._root and policy.cast_root_forward_inputs or policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        args, kwargs = self._pre_forward(args, kwargs)
        self._running_forward = True
        try:
            output = self._fsdp_wrapped_module(*args, **kwargs)
        finally:
            self._running_forward = False
        self._post_forward(output)
        return output

    def _check_called_through_unit(self) -> None:
        """RuntimeError when the wrapped module runs while this unit's parameters are 1-D shards:
        called directly, not through this unit's forward, outside ``summon_full_params`` and
        outside backward (where a checkpointed module is run again on gathered parameters)."""
        if (self._running_forward or not self._handles or self.training_state == TrainingState.SUMMON_FULL_PARAMS
                or self._root is not None and self._shared.step != StepState.IDLE):
            return
        inner = type(self._fsdp_wrapped_module).__name__
        raise RuntimeError(
            f"{self._name}: {inner}.forward ran without going through its FSDP1 unit (model.generate(), "
            f"model.module(...) or another method of the inner model calls it directly), so its parameters are "
            f"still this rank's 1-D shards. Call the wrapper, model(...), to run a step; for generate() or "
            f"another method, run it inside `with FSDP.summon_full_params(model, recurse=False, writeback=False):` "
            f"as model.module.generate(...) (docs/fsdp1.md), or shard the model with FSDP2, whose modules "
            f"keep their own methods")

    def _forward_summoned(self, args, kwargs):
        """A forward inside ``summon_full_params`` (e.g. ``model.module.generate()`` there): the
        parameters are already whole in the master dtype, so run the module on them as they are,
        with nothing gathered, freed or cast. Raises RuntimeError where that cannot be right."""
        if not self._summoned_whole:
            raise RuntimeError(f"{self._name}: forward inside summon_full_params(rank0_only=True) on a rank "
                               f"other than 0, whose parameters stay sharded: summon every unit (recurse=True) "
                               f"and run the model on rank 0 only, or summon with rank0_only=False")
        self._check_summoned_dtypes()
        if torch.is_grad_enabled() and any(h.requires_grad for h in self._handles):
            raise RuntimeError(f"{self._name}: a forward with gradients inside summon_full_params: the whole "
                               f"parameters there are a temporary copy, so no gradient would reach the shards. "
                               f"Run it under torch.no_grad() (as generate() does), or outside the block to train")
        return self._fsdp_wrapped_module(*args, **kwargs)

    def _widened_handles(self) -> list[FlatHandle]:
        """Handles whose shard (master) dtype is not the dtype they compute in."""
        return [h for h in self._handles if hasattr(h, "compute_dtype") and h.compute_dtype != h.dtype]

    def _check_dtype_under_summoned(self) -> None:
        """RuntimeError when this unit computes in another dtype than its master one (a policy's
        ``param_dtype``, or a bf16 model's float32 masters) while an enclosing unit is summoned:
        the enclosing unit's whole parameters are in the master dtype, and the two would meet."""
        widened = self._widened_handles()
        if widened:
            raise RuntimeError(f"{self._name} computes in {widened[0].compute_dtype} but runs inside "
                               f"summon_full_params(recurse=False) of an enclosing unit, whose parameters are whole "
                               f"in their master dtype {widened[0].dtype} there: the two dtypes would meet. Summon "
                               f"every unit (recurse=True)")

    def _check_summoned_dtypes(self) -> None:
        """RuntimeError when this summoned unit holds parameters of several dtypes because some
        were widened to float32 masters (e.g. a bf16 QLoRA model's adapters beside its bf16 NF4
        weights): a forward would mix them, where the model itself has one dtype."""
        widened = self._widened_handles()
        dtypes = {info.param.dtype for h in self._handles for info in h.infos if info.param.is_floating_point()}
        if widened and len(dtypes) > 1:
            names = ", ".join(sorted(str(d) for d in dtypes))
            raise RuntimeError(f"{self._name}: inside summon_full_params its parameters are in their master dtypes "
                               f"({names}), which would meet in one forward, where the model computes in "
                               f"{widened[0].compute_dtype}. Keep the masters in the model's dtype "
                               f"(MixedPrecision(main_params_dtype=None)), or run a plain model loaded with the "
                               f"full state dict")

    def _unshard(self) -> None:
        """Issue the all-gathers of this unit's flat parameters (asynchronous)."""
        limiter = self._shared.limiter if self.limit_all_gathers else None
        for handle in self._handles:
            if limiter is not None and handle.state == ShardedState.SHARDED:
                limiter.before_all_gather()
            handle.unshard()

    def _reshard(self, handles: list[FlatHandle]) -> None:
        for handle in handles:
            if handle.reshard() and self.limit_all_gathers:
                self._shared.limiter.record_free()

    def _pre_forward(self, args, kwargs) -> tuple[tuple, dict]:
        shared = self._shared
        sync_points.fire("pre_forward", self._name)
        if shared.step == StepState.IDLE:  # not a recomputation inside backward (checkpointing)
            assert_in_states(self.training_state, TrainingState.IDLE, where=f"{self._name} pre-forward")
            self.training_state = TrainingState.FORWARD
        if not shared.order_recorded:
            shared.record(self)
        track = torch.is_grad_enabled()
        self._unshard()
        for index, handle in enumerate(self._handles):
            handle.wait_for_unshard()
            trainable = track and handle.requires_grad
            if handle.use_unsharded_views(track_grads=trainable):  # new leaves (a later forward reuses them)
                handle.flat_grad.expect(handle.leaves, _weak_callback(self, "_post_backward", index))
        if self.forward_prefetch and shared.order_recorded:
            order = shared.exec_order
            ahead = order[order.index(self) + 1:] if self in order else []
            for unit in ahead[:1]:  # PyTorch's forward_prefetch: the next unit only
                unit._unshard()
        if track and any(not h.requires_grad for h in self._handles):
            token = _Forward()
            args, kwargs, hooked = call_after_input_grads(_weak_callback(self, "_on_input_grads", token), args, kwargs)
            if hooked:
                self._forwards_awaiting_input_grads.add(token)
        return args, kwargs

    def _post_forward(self, output) -> None:
        for handle in self._handles:
            handle.use_sharded_views()
        if self.training_state == TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE
        if self is self._root:
            self._shared.order_recorded = True
        # a checkpointed call recomputed after this unit's backward began (the unit is called
        # more than once): that backward still needs the gathered weights, and its pre-backward
        # hook does not gather again, so they stay until the unit's post-backward
        in_own_backward = self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
        if not torch.is_grad_enabled() or (self._reshard_after_forward and self is not self._root
                                           and not in_own_backward):
            self._reshard(self._handles)
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            register_multi_grad_hook(outputs, _weak_callback(self, "_pre_backward"), mode="any")

    # --- backward -------------------------------------------------------------------------------------
    def _pre_backward(self) -> None:
        shared = self._shared
        if shared.step == StepState.IDLE:
            shared.step = StepState.IN_BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(_weak_callback(self._root, "_finish_backward"))
        if self.training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST):
            return  # gathered for this backward already
        assert_in_states(self.training_state, TrainingState.IDLE, where=f"{self._name} pre-backward")
        sync_points.fire("pre_backward", self._name)
        self.training_state = TrainingState.BACKWARD_PRE
        self._unshard()
        for handle in self._handles:
            handle.wait_for_unshard()
            handle.restore_unsharded_views()
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        order = self._shared.exec_order
        if self not in order:
            return
        for unit in reversed(order[:order.index(self)]):
            if unit.training_state == TrainingState.IDLE:  # its backward has not begun
                unit._unshard()
                return

    def _post_backward(self, index: int) -> None:
        """All gradients of ``self._handles[index]`` arrived: free it, prefetch, reduce."""
        handle, shared = self._handles[index], self._shared
        assert_in_states(self.training_state, TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST,
                         where=f"{self._name} post-backward")
        sync_points.fire("post_backward", self._name)
        first = self.training_state == TrainingState.BACKWARD_PRE  # the unit's first handle to finish
        self.training_state = TrainingState.BACKWARD_POST
        self._reshard([handle])
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_POST and first:
            self._prefetch_backward()
        if shared.sync_gradients:
            shared.reduces.submit(handle.flat_grad)
        else:
            handle.flat_grad.keep_unreduced()

    def _on_input_grads(self, token: "_Forward") -> None:
        """The gradients of one forward's inputs exist: once every live forward's have (a unit
        run twice before one backward has its backward run twice), nothing needs the frozen flat
        parameters any more. A forward whose graph was dropped is not waited for (its token died
        with the graph); a further backward through a kept graph finds its token gone already."""
        self._forwards_awaiting_input_grads.discard(token)
        if not self._forwards_awaiting_input_grads:
            self._reshard([h for h in self._handles if not h.requires_grad])

    def _finish_backward(self) -> None:
        """End of backward (root only): reduce what is left, wait for every reduce, free all."""
        units = units_in(self)
        for unit in units:
            for index, handle in enumerate(unit._handles):
                if handle.flat_grad is not None and handle.flat_grad.partly_arrived:
                    unit._post_backward(index)  # some parameters got no gradient: they count as zero
        if self._shared.sync_gradients:
            # a unit that ran only in microbatches under no_sync() still holds their gradient,
            # which one process would sum into this step: reduce it now (left, it would be lost
            # for this step and added to the next)
            for unit in units:
                for handle in unit._handles:
                    if handle.flat_grad is not None and handle.flat_grad.holds_unreduced:
                        self._shared.reduces.submit(handle.flat_grad)
        self._shared.reduces.drain()
        for unit in units:
            unit._reshard(unit._handles)
            for handle in unit._handles:
                handle.to_idle()
            unit.training_state = TrainingState.IDLE
            unit._forwards_awaiting_input_grads.clear()
        self._shared.step = StepState.IDLE

    def recover_from_error(self) -> None:
        """Bring every unit back to idle and sharded after an exception (e.g. out of memory)
        interrupted forward or backward. Call it on the root, on every rank.

        Waits for collectives already issued (every rank issued them, so they complete),
        frees gathered flat parameters, drops full-size and in-flight gradients (reduced shards
        already in ``.grad`` stay: clear them with ``optimizer.zero_grad()``) and clears the
        bookkeeping a broken step leaves behind.
        """
        root = self._root
        if root is None:
            return
        root._shared.reset()
        for unit in units_in(root):
            unit.reset_runtime()
