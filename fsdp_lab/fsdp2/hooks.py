"""The hooks ``fully_shard`` installs and the state they keep: one ``_FSDPState`` per
``fully_shard`` call, one ``_RootContext`` shared by every state under the root.

A state's ``training_state`` (``states.TrainingState``) walks IDLE -> FORWARD -> IDLE ->
BACKWARD_PRE -> BACKWARD_POST -> IDLE each step (BACKWARD_POST -> BACKWARD_PRE again when its
modules ran forward more than once before the backward); the root context's ``step``
(``states.StepState``) is IN_BACKWARD while its end-of-backward callback is queued. Each keeps
what is in flight in one named object (``_ReduceScatter``) and has a ``reset()``, which
``FSDPModule.recover_from_error`` calls root first, then state, group and parameter.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from fsdp_lab import sync_points
from fsdp_lab.fsdp2.param_group import FSDPParamGroup, _ReduceScatter
from fsdp_lab.passthrough import call_after_input_grads
from fsdp_lab.precision import MixedPrecisionPolicy, cast_floating, tensors_in
from fsdp_lab.states import StepState, TrainingState, assert_in_states

__all__ = ["root_final_callback_for"]  # and, for fully_shard.py, _FSDPState and _RootContext


class _RootContext:
    """What the root shares with every state below it.

    Every state holds the context; the context holds the states weakly (a module owns its
    state, never the other way round), so dropping the model frees it without the collector.
    """

    def __init__(self, states: list["_FSDPState"]):
        self._states = [weakref.ref(s) for s in states]
        self._post_forward_order: list[weakref.ref] = []
        self.step = StepState.IDLE  # IN_BACKWARD from the first pre_backward (callback queued) to its end
        self.pending_reduce: _ReduceScatter | None = None  # at most one reduce-scatter in flight
        # False (a microbatch before the last): the end of backward leaves the last reduce-scatter
        # in flight; the next forward or backward finishes it
        self.is_last_backward = True

    def reset(self) -> None:
        """After an interrupted step: finish the reduce-scatter in flight (every rank issued it)
        and drop its gradients; not in backward any more."""
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            pending.handle.wait()
        self.step = StepState.IDLE

    @property
    def states(self) -> list["_FSDPState"]:
        return [s for ref in self._states if (s := ref()) is not None]

    @property
    def post_forward_order(self) -> list["_FSDPState"]:
        """States in the order their forward finished (the backward prefetch order, reversed)."""
        return [s for ref in self._post_forward_order if (s := ref()) is not None]

    def record_post_forward(self, state: "_FSDPState") -> None:
        self._post_forward_order.append(weakref.ref(state))

    def clear_post_forward_order(self) -> None:
        self._post_forward_order = []

    @property
    def in_backward(self) -> bool:
        return self.step == StepState.IN_BACKWARD

    def finish_pending_reduce(self) -> None:
        if self.pending_reduce is not None:
            pending, self.pending_reduce = self.pending_reduce, None
            pending.wait()


class _FSDPState:
    """The hooks of one ``fully_shard`` call (shared by all modules of a list)."""

    def __init__(self, modules, group: FSDPParamGroup | None, mp_policy: MixedPrecisionPolicy, auto_reshard: bool):
        self._module_refs = [weakref.ref(m) for m in modules]  # the modules hold this state
        self.group, self.mp_policy = group, mp_policy
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.root: _RootContext | None = None
        self.forward_prefetch: list[_FSDPState] = []
        self.backward_prefetch: list[_FSDPState] | None = None
        self.training_state = TrainingState.IDLE
        self.is_last_backward = True  # set_is_last_backward before the first forward; the root context's after
        self._in_forward = 0  # modules of this group whose forward is running (nested calls)
        # ids of this group's modules still to run in the current forward pass: a group of
        # several modules (e.g. two blocks) gathers once and reshards after its last module.
        self._to_run: set[int] = set()

    @property
    def modules(self) -> list[nn.Module]:
        return [m for ref in self._module_refs if (m := ref()) is not None]

    def reset(self) -> None:
        """After an interrupted step: idle, no module mid-forward, the group sharded."""
        self.training_state = TrainingState.IDLE
        self._in_forward = 0
        self._to_run = set()
        if self.group is not None:
            self.group.reset()

    def lazy_init(self) -> None:
        """Make this state the root of every state in its modules' subtrees."""
        states: list[_FSDPState] = []
        for top in self.modules:
            for m in top.modules():
                state = getattr(m, "_fsdp_state", None)
                if state is not None and state not in states:
                    states.append(state)
        context = _RootContext(states)
        context.is_last_backward = self.is_last_backward
        names = {id(m): name for top in self.modules for name, m in top.named_modules()}
        for state in states:  # label timeline events with module paths, e.g. "layers.0"
            if state.group is not None:
                state.group.name = ",".join(names.get(id(m)) or "root" for m in state.modules)
                _check_not_meta(state.group, names)
                state.group.check_trainable_dtypes(names)  # here, as PyTorch: requires_grad may change after fully_shard
        for state in states:
            if state.is_root is not None and state is not self:
                raise RuntimeError("an FSDPModule ran forward on its own before its parent; run the root first")
            state.is_root, state.root = state is self, context
        if self.auto_reshard and self.group is not None:
            self.group.reshard_after_forward = False  # gathered again right away in backward

    def pre_forward_hook(self, module, args, kwargs):
        if self.is_root is None:
            self.lazy_init()
        if self.is_root and self._in_forward == 0:
            self.root.finish_pending_reduce()
            if torch.is_grad_enabled():
                self.root.clear_post_forward_order()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.mp_policy.param_dtype)
        sync_points.fire("pre_forward", self.group.name if self.group is not None else "")
        if not self.root.in_backward:  # not a recomputation inside backward (checkpointing)
            assert_in_states(self.training_state, TrainingState.IDLE, TrainingState.FORWARD,
                             where=f"{self.group.name if self.group is not None else 'root'} pre-forward")
        self.training_state = TrainingState.FORWARD  # a recomputation, too, asks backward to gather again
        self._in_forward += 1
        new_pass = id(module) not in self._to_run
        if new_pass:
            self._to_run = {id(m) for m in self.modules}
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
        if new_pass:
            for target in self.forward_prefetch:
                if target.group is not None:
                    target.group.unshard(async_op=True)
        if new_pass and torch.is_grad_enabled() and not self.root.in_backward:
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _register_post_backward(self, args, kwargs):
        if self.group is None:
            return args, kwargs
        args, kwargs, _ = call_after_input_grads(self.post_backward, args, kwargs)
        return args, kwargs

    def post_forward_hook(self, module, args, kwargs, output):
        self._in_forward -= 1
        if self._in_forward > 0:  # another module of this group is still running
            return output
        self._to_run.discard(id(module))
        if self._to_run:  # later modules of this group still need the gathered parameters
            return cast_floating(output, self.mp_policy.output_dtype) if self.mp_policy.output_dtype else output
        if self.root.in_backward:  # recomputed forward (activation checkpointing): backward needs the params
            return output
        self.training_state = TrainingState.IDLE
        training = torch.is_grad_enabled()
        if self.group is not None:
            if self.group.reshard_after_forward or not training:  # no backward will come to reshard
                self.group.reshard()
            if training:
                self.root.record_post_forward(self)
        if training:
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        root = self.root
        if root.step == StepState.IDLE:
            root.step = StepState.IN_BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(root_final_callback_for(root))
        if self.group is None or self.training_state == TrainingState.BACKWARD_PRE:
            return  # gathered for this part of the backward already
        # after BACKWARD_POST it gathers again: a module that ran forward twice (two losses summed)
        # has its backward run twice, and the first post-backward resharded it, as in PyTorch's
        sync_points.fire("pre_backward", self.group.name)
        self.training_state = TrainingState.BACKWARD_PRE
        if self.group.unshard_in_backward:
            self.group.unshard()
            self.group.wait_for_unshard()
        for target in self._backward_prefetch_targets():
            if target.group is not None and target.group.unshard_in_backward:
                target.group.unshard(async_op=True)

    def _backward_prefetch_targets(self) -> list["_FSDPState"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.post_forward_order
        if self not in order:
            return []
        index = len(order) - 1 - order[::-1].index(self)
        return [order[index - 1]] if index > 0 else []

    def post_backward(self) -> None:
        """Reduce the gradients this group holds and reshard (may run more than once per backward)."""
        if self.group is None:
            return
        sync_points.fire("post_backward", self.group.name)
        self.training_state = TrainingState.BACKWARD_POST
        # at most one reduce-scatter in flight: the previous group's is waited on (its input
        # buffer freed) just before this group's is made and issued, as PyTorch's default
        # reduce_scatter_max_input_buffers=1 does; a call that issues none (the final callback
        # runs every group's post-backward again) leaves it in flight, so a backward that is not
        # the last ends with its last reduce-scatter pending
        reduce = self.group.reduce_grads(before=self.root.finish_pending_reduce)
        if reduce is not None:
            self.root.pending_reduce = reduce
        if self.group.reshard_after_backward:
            self.group.reshard()


def root_final_callback_for(root: _RootContext):
    """The function the autograd engine runs once the whole backward is done."""

    def final_callback() -> None:
        for state in root.states:
            if state.group is None:
                continue
            state.group.wait_for_unshard()  # a prefetch nobody used
            state.post_backward()
            state.training_state = TrainingState.IDLE
        if root.is_last_backward:
            root.finish_pending_reduce()
        assert_in_states(root.step, StepState.IN_BACKWARD, where="end of backward")
        root.step = StepState.IDLE

    return final_callback


def _check_not_meta(group, names: dict[int, str]) -> None:
    """Raise RuntimeError naming a parameter still on the meta device (a model built on meta,
    sharded, and never given memory and values)."""
    for fsdp_param in group.fsdp_params:
        if fsdp_param.sharded_local_tensor.is_meta:
            module, attr = fsdp_param.module_infos[0]
            name = ".".join(filter(None, (names.get(id(module)), attr)))
            raise RuntimeError(
                f"{name} is still on the meta device at the first forward: after fully_shard, call "
                f"model.to_empty(device=...) and initialise the weights (reset_parameters() of each "
                f"module, or your own init) before running the model")
