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
not a usable weight on its own). The handle is frozen: no gradient hooks, no reduce-scatter;
like other frozen handles it is resharded once the gradients of its unit's inputs are computed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from fsdp_lab.fsdp1.flat_param import FlatParamHandle, ParamInfo
from fsdp_lab.memory.tags import tag
from fsdp_lab.qlora.nf4_tensor import INNER_TENSORS, NF4Tensor


class NF4FlatParamHandle:
    """The NF4 weights of one FSDP1 unit: one frozen ``FlatParamHandle`` per inner dtype.

    ``infos``: the unit's NF4 parameters (``ParamInfo`` whose ``param`` is an ``NF4Tensor``
    parameter). ``compute_dtype``: the dtype the rebuilt weights report and dequantize to
    (MixedPrecision.param_dtype or the weight's own). Same methods as ``FlatParamHandle``
    for what ``FullyShardedDataParallel`` calls on a frozen handle.
    Raises ValueError for a parameter that is not an NF4Tensor or is an FSDP2 shard.
    """

    requires_grad = False

    def __init__(self, infos: list[ParamInfo], *, unit_name: str, shard_group, shard_rank: int,
                 shard_size: int, device: torch.device, compute_dtype: torch.dtype | None, offload: bool):
        self.infos = infos
        self.device = device
        self.layouts = []
        by_dtype: dict[torch.dtype, list[ParamInfo]] = {}
        self._slots: list[list[tuple[torch.dtype, int]]] = []  # per weight: (inner dtype, index) per inner tensor
        for info in infos:
            weight = info.param
            if not isinstance(weight, NF4Tensor) or weight.is_shard:
                raise ValueError(f"{info.fqn}: NF4FlatParamHandle takes whole NF4Tensor parameters, got {weight!r}")
            layout = weight.nf4_layout
            self.layouts.append(dataclasses.replace(layout, dtype=compute_dtype or layout.dtype))
            slots = []
            for name in INNER_TENSORS:
                inner = getattr(weight, name).detach()
                members = by_dtype.setdefault(inner.dtype, [])
                carrier = nn.Parameter(inner, requires_grad=False)
                members.append(ParamInfo(f"{info.fqn}.{name}", inner.shape, inner.numel(), 0, carrier, []))
                slots.append((inner.dtype, len(members) - 1))
            self._slots.append(slots)
        self.handles: dict[torch.dtype, FlatParamHandle] = {}
        for dtype, members in by_dtype.items():
            offset = 0
            for m in members:
                m.offset, offset = offset, offset + m.numel
            handle = FlatParamHandle(members, unit_name=unit_name, shard_group=shard_group, shard_rank=shard_rank,
                                     shard_size=shard_size, device=device, compute_dtype=dtype, offload=offload)
            tag(handle.flat_shard, "quantized")
            self.handles[dtype] = handle
        self.compute_dtype = compute_dtype
        self.numel = sum(h.numel for h in self.handles.values())  # bytes-or-elements of all inner tensors
        self.leaves: list[torch.Tensor] = []
        self.use_sharded_views()

    @classmethod
    def for_unit(cls, unit, infos: list[ParamInfo], unit_name: str) -> "NF4FlatParamHandle":
        """The handle for the NF4 parameters ``infos`` of the FullyShardedDataParallel ``unit``."""
        import torch.distributed as dist

        for info in infos:
            info.param._fsdp1_unit = unit
        group = unit.shard_group
        return cls(infos, unit_name=unit_name, shard_group=group,
                   shard_rank=dist.get_rank(group) if group is not None else 0,
                   shard_size=dist.get_world_size(group) if group is not None else 1,
                   device=unit.compute_device, compute_dtype=unit.mixed_precision.param_dtype,
                   offload=unit.cpu_offload.offload_params)

    @property
    def unit_name(self) -> str:
        return next(iter(self.handles.values())).unit_name

    @unit_name.setter
    def unit_name(self, name: str) -> None:
        for handle in self.handles.values():
            handle.unit_name = name

    def _inner(self, slots, gathered: bool) -> list[torch.Tensor]:
        out = []
        for dtype, index in slots:
            handle = self.handles[dtype]
            info = handle.infos[index]
            out.append(handle.full[info.offset:info.offset + info.numel].view(info.shape) if gathered
                       else info.param.data)
        return out

    # --- the FlatParamHandle interface used for frozen handles ------------------------------------
    def unshard(self) -> None:
        for handle in self.handles.values():
            handle.unshard()

    def wait_unshard(self) -> None:
        for handle in self.handles.values():
            handle.wait_unshard()

    def use_unsharded_views(self, track_grads: bool = False) -> None:
        """Put an NF4Tensor over the gathered bytes on every module holding an NF4 weight."""
        self.leaves = []
        for info, layout, slots in zip(self.infos, self.layouts, self._slots):
            weight = NF4Tensor(*self._inner(slots, gathered=True), layout)
            self.leaves.append(weight)
            for module, name in info.uses:
                module._parameters[name] = weight

    def restore_leaf_views(self) -> None:
        for info, weight in zip(self.infos, self.leaves):
            for module, name in info.uses:
                module._parameters[name] = weight

    def use_sharded_views(self) -> None:
        """Point each original NF4 parameter at this rank's byte ranges and put it back on its modules."""
        for handle in self.handles.values():
            handle.use_sharded_views()
        for info, slots in zip(self.infos, self._slots):
            for name, piece in zip(INNER_TENSORS, self._inner(slots, gathered=False)):
                setattr(info.param, name, piece)
            for module, name in info.uses:
                module._parameters[name] = info.param

    def reshard(self) -> None:
        for handle in self.handles.values():
            handle.reshard()

    def unsharded_bytes(self) -> int:
        return sum(h.unsharded_bytes() for h in self.handles.values())

    def gather_full_precision(self):
        raise NotImplementedError(
            "full state dicts of NF4 weights are not supported under fsdp_lab's FSDP1; the base weights are "
            "frozen: save the LoRA adapters only, or use fsdp_lab.fsdp2 for a full state dict")
