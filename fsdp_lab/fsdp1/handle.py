"""What an FSDP1 unit asks of each of its flat parameters: the ``FlatHandle`` protocol.

A unit (``runtime.py``) never looks inside a flat parameter. It calls the methods below, in
this order during a step:

    unshard -> wait_for_unshard -> use_unsharded_views     (pre-forward, pre-backward)
    use_sharded_views -> reshard                            (post-forward, post-backward)
    flat_grad.expect(...) ... the unit reduces flat_grad   (trainable handles only)
    to_idle                                                 (end of backward)
    reset                                                   (recover_from_error)

and, for ``summon_full_params`` and state dicts, ``full_params``, ``sharded_entry``,
``load_sharded_entry`` and ``load_full_entry``. ``FlatParamHandle`` (``flat_param.py``) is
the implementation for ordinary parameters. A tensor subclass that needs its own (e.g. NF4
weights, whose packed bytes must never be cast: ``fsdp_lab/qlora/nf4_handle.py``) registers
a factory with ``register_handle_type``; the unit then gives all its parameters of that type
to one handle built by the factory. This is FSDP1's counterpart of FSDP2's duck-typed
``fsdp_pre_all_gather`` extension: no FSDP1 code knows the subclass.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable

import torch

from fsdp_lab.fsdp1.flat_grad import FlatGrad
from fsdp_lab.fsdp1.layout import ParamInfo, ShardingSpec
from fsdp_lab.states import ShardedState

__all__ = ["FlatHandle", "HandleFactory", "register_handle_type", "handle_factory_for"]


@runtime_checkable
class FlatHandle(Protocol):
    """One flat parameter of a unit: the original parameters it manages and their life cycle.

    ``infos``: the original parameters (``ParamInfo.param``, in the handle's order);
    ``requires_grad``: whether they train; ``flat_grad``: their gradient (None when frozen);
    ``unit_name``: the unit's name (timeline events, sync points); ``state``: where its data
    is (``states.ShardedState``).
    """

    infos: list[ParamInfo]
    requires_grad: bool
    flat_grad: FlatGrad | None
    unit_name: str
    state: ShardedState

    def unshard(self) -> None:
        """Issue the all-gather(s) of this rank's shard (asynchronous; no-op unless sharded)."""

    def wait_for_unshard(self) -> None:
        """Finish the all-gather (issuing it first if needed); afterwards the data is whole."""

    def use_unsharded_views(self, track_grads: bool) -> bool:
        """Put full-shape parameters on the modules; with ``track_grads`` autograd leaves, made
        once and kept until ``reset``. True when new leaves were made (a gradient to expect each)."""

    def restore_unsharded_views(self) -> None:
        """Put the full-shape parameters of the last ``use_unsharded_views`` back on the modules."""

    def use_sharded_views(self) -> None:
        """Put the original Parameter objects (holding this rank's part) back on the modules."""

    def reshard(self) -> bool:
        """Free the gathered bytes; True if there were any to free."""

    def unsharded_bytes(self) -> int:
        """Bytes of gathered data held right now."""

    def to_idle(self) -> None:
        """Between steps (end of backward): freed, Parameters on the modules (views kept)."""

    def reset(self) -> None:
        """Back to idle after an interrupted step: collectives issued are finished, the
        gradient being built or reduced is dropped."""

    def full_params(self, *, writeback: bool, offload_to_cpu: bool, with_grads: bool,
                    materialize: bool) -> ContextManager[None]:
        """Whole parameters inside the block (see ``FlatParamHandle.full_params``), or raise
        NotImplementedError with the reason before gathering anything."""

    def sharded_entry(self, index: int) -> Any:
        """Parameter ``index``'s part on this rank, for a sharded state dict."""

    def load_sharded_entry(self, index: int, value: Any, name: str) -> None:
        """Load what ``sharded_entry`` returned; ValueError (naming ``name``) if it does not fit."""

    def load_full_entry(self, index: int, value: Any, name: str) -> None:
        """Load this rank's part of the whole parameter ``value``; ValueError if it does not fit."""


class HandleFactory(Protocol):
    """Builds the handle for all of a unit's parameters of one registered tensor type.

    ``param_dtype``: the mixed-precision policy's compute dtype (None: the parameters' own).
    """

    def __call__(self, infos: list[ParamInfo], spec: ShardingSpec, *, param_dtype: torch.dtype | None,
                 unit_name: str) -> FlatHandle: ...


_FACTORIES: dict[type, HandleFactory] = {}


def register_handle_type(tensor_type: type, factory: HandleFactory) -> None:
    """Give parameters of ``tensor_type`` (and its subclasses) their own handles built by ``factory``.

    Raises TypeError unless ``tensor_type`` is a ``torch.Tensor`` subclass.
    """
    if not (isinstance(tensor_type, type) and issubclass(tensor_type, torch.Tensor)):
        raise TypeError(f"register_handle_type takes a torch.Tensor subclass, got {tensor_type!r}")
    _FACTORIES[tensor_type] = factory


def handle_factory_for(param: torch.Tensor) -> HandleFactory | None:
    """The registered factory for ``param``'s type (nearest in its MRO), or None for the flat handle."""
    for cls in type(param).__mro__:
        factory = _FACTORIES.get(cls)
        if factory is not None:
            return factory
    return None
