"""NF4 weights in FSDP1: their packed storage as separate frozen flat parameters, never cast.

A unit's ``NF4Tensor`` parameters are not flattened with its float parameters (that would
dequantize them, or, as the common workaround does, reinterpret their bytes as bf16, which a
``MixedPrecision`` cast then scrambles). Instead their *inner* tensors are flattened, grouped
by dtype: all packed codes (uint8) in one flat parameter, all int8 scales in another, the
float32 double-quant factors and means in a third. Each is an ordinary ``FlatParamHandle``
whose compute dtype is its own dtype, so it is sharded, all-gathered and freed like any
frozen flat parameter, byte for byte. One flat per dtype keeps every inner tensor aligned to
its element size without padding between them.

After the all-gather each NF4 weight is rebuilt as an ``NF4Tensor`` over views of the
gathered buffers (no copy) and put on its module for forward; ``F.linear`` dequantizes from
there. Between passes the original NF4 parameter object stays on its module holding views of
this rank's byte ranges of its inner tensors (like a float parameter's 1-D shard view, it is
not a usable weight on its own). The handle is frozen: no gradient, no reduce-scatter; like
other frozen handles it is resharded once the gradients of its unit's inputs are computed.

``NF4FlatParamHandle`` follows FSDP1's ``FlatHandle`` protocol and is registered for
``NF4Tensor`` parameters when ``fsdp_lab.qlora`` is imported. A sharded state dict holds one
``ShardedNF4`` per weight (this rank's bytes of each inner tensor); a full state dict (and
``summon_full_params``) holds the whole ``NF4Tensor``, equal byte for byte to ``to_nf4`` of the
weight on one process, and loads into any world size. Both load back bit-exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.nn as nn

from fsdp_lab.fsdp1.flat_param import FlatParamHandle
from fsdp_lab.fsdp1.handle import register_handle_type
from fsdp_lab.fsdp1.layout import ParamInfo, ShardedParam, ShardingSpec
from fsdp_lab.memory.tags import tag
from fsdp_lab.qlora.nf4_tensor import INNER_TENSORS, NF4Layout, NF4Tensor
from fsdp_lab.states import ShardedState

__all__ = ["NF4FlatParamHandle", "ShardedNF4"]


@dataclasses.dataclass
class ShardedNF4:
    """This rank's part of one NF4 weight: its bytes of each inner tensor (``packed``,
    ``scales``, ``scale_factors``, ``scale_mean``) and the weight's layout (shape, blocks)."""

    parts: dict[str, ShardedParam]
    layout: dict  # NF4Layout's fields but dtype and compile: plain values only


# sharded state dicts load with torch.load(weights_only=True)
torch.serialization.add_safe_globals([ShardedNF4])


def _layout_fields(layout: NF4Layout) -> dict:
    """What must match for bytes to mean the same values (not the reported dtype)."""
    fields = dataclasses.asdict(layout)
    fields.pop("dtype")
    fields.pop("compile")
    return fields


@dataclasses.dataclass
class _Slot:
    """Where one inner tensor of one weight lives: its flat parameter and index there."""

    handle: FlatParamHandle
    index: int


class NF4FlatParamHandle:
    """The NF4 weights of one FSDP1 unit: one frozen ``FlatParamHandle`` per inner dtype.

    ``infos``: the unit's NF4 parameters (``ParamInfo`` whose ``param`` is an ``NF4Tensor``
    parameter). ``param_dtype``: the dtype the rebuilt weights report and dequantize to
    (``MixedPrecision.param_dtype``, None: the weight's own).
    Raises ValueError for a parameter that is not a whole NF4Tensor (e.g. an FSDP2 shard).
    """

    requires_grad = False
    flat_grad = None

    def __init__(self, infos: list[ParamInfo], spec: ShardingSpec, *, param_dtype: torch.dtype | None,
                 unit_name: str):
        self.infos = infos
        self.layouts: list[NF4Layout] = []
        members: dict[torch.dtype, list[ParamInfo]] = {}
        owners: list[list[tuple[torch.dtype, int]]] = []  # per weight: (inner dtype, index) per inner tensor
        for info in infos:
            weight = info.param
            if not isinstance(weight, NF4Tensor) or weight.is_shard:
                raise ValueError(f"{info.fqn}: NF4FlatParamHandle takes whole NF4Tensor parameters, got {weight!r}")
            self.layouts.append(dataclasses.replace(weight.nf4_layout, dtype=param_dtype or weight.dtype))
            slots = []
            for name in INNER_TENSORS:
                inner = getattr(weight, name).detach()
                group = members.setdefault(inner.dtype, [])
                carrier = nn.Parameter(inner, requires_grad=False)
                group.append(ParamInfo(f"{info.fqn}.{name}", inner.shape, inner.numel(), 0, carrier, []))
                slots.append((inner.dtype, len(group) - 1))
            owners.append(slots)
        self.handles: dict[torch.dtype, FlatParamHandle] = {}
        for dtype, group in members.items():
            handle = FlatParamHandle(group, spec, compute_dtype=dtype, unit_name=unit_name)
            tag(handle.flat_shard, "quantized")
            self.handles[dtype] = handle
        self._slots = [[_Slot(self.handles[dtype], index) for dtype, index in slots] for slots in owners]
        self.leaves: list[NF4Tensor] = []
        self.use_sharded_views()

    # --- names and state ---------------------------------------------------------------------------
    @property
    def unit_name(self) -> str:
        return next(iter(self.handles.values())).unit_name

    @unit_name.setter
    def unit_name(self, name: str) -> None:
        for handle in self.handles.values():
            handle.unit_name = name

    @property
    def state(self) -> ShardedState:
        """The inner flat parameters move together; between their steps, GATHERING."""
        states = {h.state for h in self.handles.values()}
        return states.pop() if len(states) == 1 else ShardedState.GATHERING

    def _inner(self, weight: int, gathered: bool) -> list[torch.Tensor]:
        """The inner tensors of weight ``weight``: whole views of the gathered flats, or this
        rank's part (the carrier Parameters' 1-D shard views)."""
        if gathered:
            return [s.handle.layout.full_view(s.handle.full, s.index) for s in self._slots[weight]]
        return [s.handle.infos[s.index].param.data for s in self._slots[weight]]

    # --- the FlatHandle life cycle -----------------------------------------------------------------
    def unshard(self) -> None:
        for handle in self.handles.values():
            handle.unshard()

    def wait_for_unshard(self) -> None:
        for handle in self.handles.values():
            handle.wait_for_unshard()

    def use_unsharded_views(self, track_grads: bool = False) -> bool:
        """Put an NF4Tensor over the gathered bytes on every module holding an NF4 weight.
        Returns False: frozen weights have no gradient to expect."""
        self.leaves = []
        for weight, (info, layout) in enumerate(zip(self.infos, self.layouts)):
            rebuilt = NF4Tensor(*self._inner(weight, gathered=True), layout)
            self.leaves.append(rebuilt)
            for module, name in info.uses:
                module._parameters[name] = rebuilt
        return False

    def restore_unsharded_views(self) -> None:
        for info, rebuilt in zip(self.infos, self.leaves):
            for module, name in info.uses:
                module._parameters[name] = rebuilt

    def use_sharded_views(self) -> None:
        """Point each original NF4 parameter at this rank's byte ranges and put it back on its modules."""
        for handle in self.handles.values():
            handle.use_sharded_views()
        for weight, info in enumerate(self.infos):
            for name, piece in zip(INNER_TENSORS, self._inner(weight, gathered=False)):
                setattr(info.param, name, piece)
            for module, name in info.uses:
                module._parameters[name] = info.param

    def reshard(self) -> bool:
        freed = [handle.reshard() for handle in self.handles.values()]
        return any(freed)

    def unsharded_bytes(self) -> int:
        return sum(h.unsharded_bytes() for h in self.handles.values())

    def to_idle(self) -> None:
        self.reshard()
        self.use_sharded_views()  # (the NF4 views stay in leaves: a later backward may recompute with them)

    def reset(self) -> None:
        self.to_idle()
        self.leaves = []

    # --- whole weights and state dicts ------------------------------------------------------------
    @contextlib.contextmanager
    def full_params(self, *, writeback: bool, offload_to_cpu: bool, with_grads: bool,
                    materialize: bool) -> Iterator[None]:
        """Inside the block every NF4 weight is whole again: its original parameter's inner
        tensors are full views of the gathered codes and scales (one all-gather per inner
        flat parameter, byte for byte). NF4 weights are frozen: ``with_grads`` adds nothing.
        On exit, with ``writeback``, this rank's bytes go back into the shards; the weights
        then hold this rank's byte ranges again, also when the block raises."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.use_sharded_views)  # last out: after the inner handles' own views are back
            for handle in self.handles.values():
                stack.enter_context(handle.full_params(writeback=writeback, offload_to_cpu=offload_to_cpu,
                                                       with_grads=False, materialize=materialize))
            if materialize:
                for weight, info in enumerate(self.infos):
                    for name, slot in zip(INNER_TENSORS, self._slots[weight]):
                        setattr(info.param, name, slot.handle.infos[slot.index].param.data)
            yield

    def sharded_entry(self, index: int) -> ShardedNF4:
        """Weight ``index``'s bytes on this rank, per inner tensor (CPU copies), and its layout."""
        parts = {name: slot.handle.sharded_entry(slot.index) for name, slot in zip(INNER_TENSORS, self._slots[index])}
        return ShardedNF4(parts, _layout_fields(self.infos[index].param.nf4_layout))

    @torch.no_grad()
    def load_sharded_entry(self, index: int, value, name: str) -> None:
        """Copy a ``ShardedNF4`` saved by ``sharded_entry`` into this rank's bytes of weight ``index``.
        Raises ValueError for another entry type, another weight layout, or another rank's part."""
        expected = _layout_fields(self.infos[index].param.nf4_layout)
        if not isinstance(value, ShardedNF4):
            raise ValueError(f"{name}: an NF4 weight loads from a ShardedNF4 entry, got {type(value).__name__}; "
                             f"load a sharded state dict saved from the same QLoRA model")
        if value.layout != expected:
            raise ValueError(f"{name}: saved NF4 layout {value.layout} differs from the model's {expected}")
        for inner, slot in zip(INNER_TENSORS, self._slots[index]):
            slot.handle.load_sharded_entry(slot.index, value.parts[inner], f"{name}.{inner}")

    @torch.no_grad()
    def load_full_entry(self, index: int, value, name: str) -> None:
        """Copy this rank's bytes of the whole NF4 weight ``value`` into weight ``index``.
        Raises ValueError for a value that is not an NF4Tensor of the same layout."""
        expected = _layout_fields(self.infos[index].param.nf4_layout)
        if not isinstance(value, NF4Tensor) or _layout_fields(value.nf4_layout) != expected:
            raise ValueError(f"{name}: needs a whole NF4Tensor with layout {expected}, got {value!r}")
        for inner, slot in zip(INNER_TENSORS, self._slots[index]):
            slot.handle.load_full_entry(slot.index, getattr(value, inner), f"{name}.{inner}")


register_handle_type(NF4Tensor, NF4FlatParamHandle)
