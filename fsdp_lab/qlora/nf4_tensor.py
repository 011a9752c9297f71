"""``NF4Tensor``: a frozen 4-bit weight that looks like a float tensor to the model.

The tensor reports the original shape, dtype and device but owns no float storage;
its data are four inner tensors (see ``nf4.py`` for the format):

    packed         uint8   two codes per byte, n_blocks * block_size / 2 bytes
    scales         int8 (double quant) or float32, one per block
    scale_factors  float32, one per group of scaler_block_size scales (double quant only)
    scale_mean     float32, shape (1,) (double quant only)

Two hooks see it: ``__torch_function__`` routes ``F.linear`` to a dequantize-then-matmul
autograd function whose backward gives input gradients and no weight gradient; the
aten ops that moving and saving a weight needs (detach, clone, ``_to_copy``, ``copy_``,
pinning) are handled in ``__torch_dispatch__``, and so are the row-chunk ops PyTorch's
``fully_shard`` uses (split, new_zeros, slice, view, as_strided; see ``nf4_fsdp.py``);
every other aten op raises NotImplementedError. FSDP2 support (shard by whole blocks,
all-gather packed bytes) is in ``nf4_fsdp.py`` and exposed as the ``fsdp_*`` methods below.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from fsdp_lab.checks import check_bool
from fsdp_lab.qlora import nf4_fsdp
from fsdp_lab.qlora.nf4_codec import (
    dequantize_nf4_blocks,
    dequantize_nf4_blocks_fused,
    dequantize_scales,
    double_quantize_scales,
    quantize_nf4_blocks,
    tag_quantized,
)

aten = torch.ops.aten
_FUNCTIONAL_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
INNER_TENSORS = ("packed", "scales", "scale_factors", "scale_mean")


@dataclasses.dataclass(frozen=True)
class NF4Layout:
    """Everything but the bytes: how to read the inner tensors.

    ``numel`` is how many values this tensor holds: the product of ``shape`` for a whole
    weight; for an FSDP shard, its part of the flattened weight (see ``nf4_fsdp.py``).
    ``first_block`` is the global index of the first block held (0 unless a shard).
    ``full_shape`` is set only on shards: the shape of the whole weight.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    block_size: int
    scaler_block_size: int
    double_quant: bool
    numel: int
    first_block: int = 0
    full_shape: tuple[int, ...] | None = None
    rank: int = 0
    world_size: int = 1
    compile: bool | None = None

    @property
    def is_shard(self) -> bool:
        return self.full_shape is not None


class NF4Tensor(torch.Tensor):
    """A frozen NF4-quantized weight (torchao's ``NF4Tensor``, with padding and our FSDP hooks).

    Build one with ``to_nf4(t)``. ``dequantize(dtype)`` and ``.to(dtype)`` give a plain
    tensor; ``.to(device)``, ``detach``, ``clone``, ``copy_`` and pickling keep it
    quantized. Use it as a parameter with ``nn.Parameter(nf4, requires_grad=False)``.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    scale_factors: torch.Tensor
    scale_mean: torch.Tensor
    nf4_layout: NF4Layout

    @staticmethod
    def __new__(cls, packed, scales, scale_factors, scale_mean, layout: NF4Layout):
        return torch.Tensor._make_wrapper_subclass(
            cls, layout.shape, dtype=layout.dtype, device=packed.device, requires_grad=False
        )

    def __init__(self, packed, scales, scale_factors, scale_mean, layout: NF4Layout):
        self.packed = packed
        self.scales = scales
        self.scale_factors = scale_factors
        self.scale_mean = scale_mean
        self.nf4_layout = layout

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_float(cls, tensor: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256,
                   double_quant: bool = True, compile: bool | None = None) -> "NF4Tensor":
        """Quantize ``tensor`` (see ``to_nf4``). Raises ValueError on a non-float or 0-d input."""
        if isinstance(tensor, NF4Tensor):
            raise ValueError("tensor is already an NF4Tensor; dequantize() it first to re-quantize")
        if not tensor.is_floating_point():
            raise ValueError(f"to_nf4 needs a floating-point tensor, got {tensor.dtype}")
        if tensor.dim() == 0:
            raise ValueError("to_nf4 needs at least one dimension; reshape a scalar to (1,)")
        packed, absmax = quantize_nf4_blocks(tensor, block_size)
        if double_quant:
            scales, factors, mean = double_quantize_scales(absmax, scaler_block_size)
        else:
            scales, factors, mean = absmax, absmax.new_empty(0), absmax.new_empty(0)
        tag_quantized(packed, scales, factors, mean)
        layout = NF4Layout(tuple(tensor.shape), tensor.dtype, block_size, scaler_block_size,
                           double_quant, tensor.numel(), compile=compile)
        return cls(packed, scales, factors, mean, layout)

    def _with_inner(self, fn, **layout_changes) -> "NF4Tensor":
        """A new NF4Tensor whose inner tensors are ``fn(inner)``."""
        inner = [fn(getattr(self, name)) for name in INNER_TENSORS]
        return NF4Tensor(*inner, dataclasses.replace(self.nf4_layout, **layout_changes))

    # -- reading --------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.nf4_layout.block_size

    @property
    def scaler_block_size(self) -> int:
        return self.nf4_layout.scaler_block_size

    @property
    def double_quant(self) -> bool:
        return self.nf4_layout.double_quant

    @property
    def is_shard(self) -> bool:
        return self.nf4_layout.is_shard

    def storage_bytes(self) -> int:
        """Bytes held by the inner tensors (codes, scales, factors, mean)."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in INNER_TENSORS)

    def block_scales(self) -> torch.Tensor:
        """The float32 scale of every block that holds values (decoded if double-quantized).

        Padding blocks (an FSDP shard's tail, or those kept after an all-gather) are left out.
        """
        n_blocks = math.ceil(self.nf4_layout.numel / self.block_size)
        if not self.double_quant:
            return self.scales[:n_blocks].float()
        return dequantize_scales(self.scales[:n_blocks], self.scale_factors, self.scale_mean,
                                 self.scaler_block_size, self.nf4_layout.first_block)

    def dequantize_flat(self, dtype: torch.dtype | None = None, compile: bool | None = None) -> torch.Tensor:
        """The values this tensor holds, 1-D, padding dropped (works on shards too)."""
        dtype = dtype or self.dtype
        n_blocks = math.ceil(self.nf4_layout.numel / self.block_size)
        scales = self.block_scales()
        packed = self.packed[: n_blocks * self.block_size // 2]
        use_compile = compile if compile is not None else self.nf4_layout.compile
        if use_compile is None:
            use_compile = self.device.type == "cuda"
        if use_compile:
            flat = _compiled_dequantize()(packed, scales, self.block_size, dtype)
        else:
            flat = dequantize_nf4_blocks(packed, scales, self.block_size, dtype=dtype)
        return flat[: self.nf4_layout.numel]

    def dequantize(self, dtype: torch.dtype | None = None, compile: bool | None = None) -> torch.Tensor:
        """A plain tensor of this tensor's shape, in ``dtype`` (default: this tensor's dtype).

        Each value is computed in float32 (code value times block scale) and rounded once
        to ``dtype``. ``compile``: use the ``torch.compile``d kernel (default: on CUDA).
        On an FSDP shard: the rows it holds, ``(rows, *rest)``, when its blocks hold whole
        rows (a weight whose row count splits evenly and whose rows per rank hold whole
        blocks). Raises RuntimeError on a shard whose blocks cut through rows, naming
        ``dequantize_flat()`` (its values, 1-D) and ``fsdp_lab.fsdp2.full_tensor`` (the whole weight).
        """
        if self.is_shard:
            lo = self.nf4_layout
            row = math.prod(lo.full_shape[1:])
            start = lo.first_block * lo.block_size
            if row and start % row == 0 and lo.numel % row == 0:
                return self.dequantize_flat(dtype, compile).view(lo.numel // row, *lo.full_shape[1:])
            raise RuntimeError(
                f"this NF4Tensor is rank {lo.rank}'s FSDP shard of a {list(lo.full_shape)} weight: it "
                f"holds quantization blocks {lo.first_block}.. of the flattened weight, which start or end "
                "inside a row, so it has no row view. Call dequantize_flat() for the values it holds, or "
                "fsdp_lab.fsdp2.full_tensor(param) on every rank for the whole weight (.dequantize() that)."
            )
        return self.dequantize_flat(dtype, compile).view(self.shape)

    def fsdp_unpadded(self) -> "NF4Tensor":
        """A compact copy of a gathered weight: the padding blocks FSDP shards carry dropped.

        Equal, byte for byte, to ``to_nf4`` of the weight on one process. Raises ValueError on a shard.
        """
        return nf4_fsdp.unpadded(self)

    def __repr__(self, *, tensor_contents=None) -> str:
        lo = self.nf4_layout
        shard = f", shard {lo.rank}/{lo.world_size} of {list(lo.full_shape)}" if lo.is_shard else ""
        return (f"NF4Tensor(shape={list(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"block_size={lo.block_size}, double_quant={lo.double_quant}, "
                f"bytes={self.storage_bytes()}{shard})")

    # -- subclass protocol ----------------------------------------------------------
    def __tensor_flatten__(self):
        return list(INNER_TENSORS), self.nf4_layout

    @staticmethod
    def __tensor_unflatten__(inner_tensors, layout, outer_size, outer_stride):
        return NF4Tensor(*(inner_tensors[name] for name in INNER_TENSORS), layout)

    def __reduce_ex__(self, protocol):
        # Plain tuples and tensors only, so torch.load(weights_only=True) can read it once
        # _rebuild_nf4 is allow-listed (done at the bottom of this file).
        inner = tuple(getattr(self, name) for name in INNER_TENSORS)
        fields = tuple(getattr(self.nf4_layout, f.name) for f in dataclasses.fields(NF4Layout))
        return _rebuild_nf4, (inner, fields)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return nf4_linear(*args, **kwargs)
        if func is torch._has_compatible_shallow_copy_type:
            # Module._apply (model.to, .float(), ...) would otherwise assign the converted tensor
            # to param.data, leaving a wrapper that claims a new dtype over the old bytes. With
            # False it replaces the parameter: NF4 -> NF4 for a device move, plain for a dtype change.
            return False
        if func is torch.Tensor.data_ptr:
            # safetensors (and so model.save_pretrained) reads numel * itemsize bytes from here:
            # there are no such bytes, and a 0 would only give an unexplained error later
            raise TypeError(f"{args[0]!r}: {_NO_FLOAT_DATA}")
        if func in (torch.Tensor.untyped_storage, torch.Tensor.storage):
            # A wrapper subclass has no storage of its own (data_ptr raises "invalid python
            # storage"). Code that asks for one (safetensors' and transformers' tied-weight
            # checks) wants an identity for the bytes: the packed codes are those bytes.
            return args[0].packed.untyped_storage()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _DISPATCH.get(func)
        if handler is None and func is _FUNCTIONAL_ALL_GATHER and isinstance(args[0], NF4Tensor) and args[0].is_shard:
            raise NotImplementedError(
                f"DTensor.full_tensor() cannot gather {args[0]!r}: fsdp_lab.fsdp2.fully_shard cuts NF4 "
                "weights by quantization blocks, not rows. Call fsdp_lab.fsdp2.full_tensor(param) on every "
                "rank (a whole NF4Tensor; .dequantize() it for floats), or get_full_state_dict(model)."
            )
        if handler is None:
            raise NotImplementedError(
                f"NF4Tensor does not support {func}: it is a frozen quantized weight. "
                "Call .dequantize() for a plain tensor, or use it through F.linear."
            )
        return handler(*args, **kwargs)

    # -- FSDP2 all-gather extension (see nf4_fsdp.py) -------------------------------
    def fsdp_shard(self, rank: int, world_size: int) -> "NF4Tensor":
        """This rank's shard: whole blocks of the flattened weight, padded to equal size."""
        return nf4_fsdp.shard(self, rank, world_size)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """``(tensors to all-gather, metadata)``: packed codes and scale data, no floats of the weight."""
        return nf4_fsdp.pre_all_gather(self, mesh)

    def fsdp_dcp_state(self, mesh, placements, gather) -> dict:
        """This shard's parts for ``torch.distributed.checkpoint``, reshardable to any world size."""
        return nf4_fsdp.dcp_state(self, mesh, placements, gather)

    def fsdp_load_dcp_state(self, parts: dict) -> None:
        """Take this shard's blocks and factors from parts that ``dcp.load`` filled."""
        nf4_fsdp.load_dcp_state(self, parts)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """``(unsharded NF4Tensor, inner tensors)`` from the gathered bytes, or fill ``out``."""
        return nf4_fsdp.post_all_gather(all_gather_outputs, metadata, param_dtype, out=out, cls=type(self))


_NO_FLOAT_DATA = (
    "an NF4Tensor has no float data to point at (it stores 4-bit codes and their scales), so "
    "safetensors and a plain model.save_pretrained cannot write it. For a QLoRA model use "
    "fsdp_lab.hf.save_pretrained(model, directory) (base weights written dequantized), "
    "fsdp_lab.hf.save_pretrained(model, directory, nf4='packed') (the NF4 bytes, read back by "
    "fsdp_lab.hf.from_pretrained) or "
    "fsdp_lab.hf.export_peft_adapters(model, directory) (the adapters alone, PEFT's format); "
    "fsdp_lab.qlora.merge_lora(model) gives plain weights first; torch.save(model.state_dict()) "
    "keeps the NF4 bytes."
)


def to_nf4(
    tensor: torch.Tensor,
    block_size: int = 64,
    scaler_block_size: int = 256,
    double_quant: bool = True,
    compile: bool | None = None,
) -> NF4Tensor:
    """Quantize a floating-point tensor to an ``NF4Tensor`` (torchao's ``to_nf4`` with padding).

    The result reports ``tensor``'s shape, dtype and device and stores packed codes plus
    (double-quantized) scales. ``compile``: dequantize with a ``torch.compile``d kernel;
    None means yes on CUDA, no elsewhere. Raises ValueError for a non-float or 0-d
    tensor or a bad block size, TypeError for a ``double_quant`` that is not a bool.
    """
    check_bool("double_quant", double_quant)
    return NF4Tensor.from_float(tensor, block_size=block_size, scaler_block_size=scaler_block_size,
                                double_quant=double_quant, compile=compile)


def _rebuild_nf4(inner, fields) -> NF4Tensor:
    return NF4Tensor(*inner, NF4Layout(*fields))


_compiled = None


def _compiled_dequantize():
    global _compiled
    if _compiled is None:
        # Default dynamic=None: a second shape recompiles once with dynamic sizes, so a model
        # with many layer shapes does not compile once per shape.
        _compiled = torch.compile(dequantize_nf4_blocks_fused)
    return _compiled


# -- F.linear ------------------------------------------------------------------------
class _NF4Linear(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly, in forward and again in backward.

    Only the NF4Tensor is kept for backward (no float copy of W stays alive); the weight
    is frozen, so backward returns no weight gradient.
    """

    @staticmethod
    def forward(ctx, x, weight: NF4Tensor, bias):
        ctx.weight = weight
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        return F.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_out @ ctx.weight.dequantize(grad_out.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.bias_needs_grad else None
        return grad_x, None, grad_bias


def nf4_linear(input: torch.Tensor, weight: NF4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with an NF4 weight (dequantized to ``input.dtype``); no weight gradient."""
    if not isinstance(weight, NF4Tensor):
        raise TypeError(f"nf4_linear needs an NF4Tensor weight, got {type(weight).__name__}")
    return _NF4Linear.apply(input, weight, bias)


# -- aten ops --------------------------------------------------------------------------
def _detach(self: NF4Tensor) -> NF4Tensor:
    return self._with_inner(lambda t: t)


def _clone(self: NF4Tensor, memory_format=None) -> NF4Tensor:
    out = self._with_inner(torch.clone)
    tag_quantized(out.packed, out.scales, out.scale_factors, out.scale_mean)
    return out


def _to_copy(self: NF4Tensor, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    if layout not in (None, torch.strided):
        raise NotImplementedError(f"NF4Tensor cannot be converted to layout {layout}")
    if dtype is not None and dtype != self.dtype:
        # A new dtype means a plain tensor: the float values of the weight.
        plain = self.dequantize(dtype)
        return plain.to(device, non_blocking=non_blocking) if device is not None else plain
    device = device if device is not None else self.device
    out = self._with_inner(lambda t: t.to(device, non_blocking=non_blocking, copy=True))
    if pin_memory:
        out = out._with_inner(torch.Tensor.pin_memory)
    tag_quantized(out.packed, out.scales, out.scale_factors, out.scale_mean)
    return out


def _copy_(dst: NF4Tensor, src, non_blocking=False) -> NF4Tensor:
    lo = dst.nf4_layout
    whole_shape = lo.full_shape if dst.is_shard else lo.shape
    if not isinstance(src, NF4Tensor):
        if tuple(src.shape) != tuple(whole_shape):
            raise ValueError(f"cannot copy a {list(src.shape)} tensor into {dst!r}")
        src = NF4Tensor.from_float(src.to(dst.device), lo.block_size, lo.scaler_block_size, lo.double_quant)
    if dst.is_shard and not src.is_shard and tuple(src.shape) == tuple(whole_shape):
        # A whole weight copied into a shard: the shard takes its own blocks of it.
        src = nf4_fsdp.shard(src, lo.rank, lo.world_size)
    if dst.is_shard and src.is_shard and (src.nf4_layout.world_size != lo.world_size or
                                          src.nf4_layout.shape[0] != lo.shape[0]):
        # pieces of shards cut for other world sizes (a DCP reshard): write the blocks src holds
        if nf4_fsdp.copy_blocks(dst, src):
            return dst
    target = dataclasses.replace(dst.nf4_layout, dtype=src.dtype, compile=src.nf4_layout.compile)
    if dst.is_shard and src.is_shard:
        # A shard copied into another shard's buffer takes the source's place in the weight.
        position = {k: getattr(src.nf4_layout, k) for k in ("first_block", "rank", "numel")}
        target = dataclasses.replace(target, **position)
    if target != src.nf4_layout or any(getattr(dst, n).shape != getattr(src, n).shape for n in INNER_TENSORS):
        if dst.is_shard and src.is_shard and src.nf4_layout.world_size != lo.world_size:
            raise ValueError(
                f"{dst!r} cannot take {src!r}: a shard saved on {src.nf4_layout.world_size} ranks, whose blocks "
                f"do not line up with rows. Checkpoint with fsdp_lab.fsdp2.dcp_state_dict(model) (and load with "
                f"load_dcp_state_dict), which loads at any world size, or with get_full_state_dict(model)"
            )
        raise ValueError(
            f"copy_ between NF4Tensors needs the same shape, block sizes and double_quant: "
            f"{dst!r} <- {src!r}; re-quantize with to_nf4(src.dequantize(), ...) instead"
        )
    for name in INNER_TENSORS:
        getattr(dst, name).copy_(getattr(src, name), non_blocking=non_blocking)
    dst.nf4_layout = dataclasses.replace(target, dtype=dst.nf4_layout.dtype, compile=dst.nf4_layout.compile)
    return dst


def _is_pinned(self: NF4Tensor, device=None) -> bool:
    return all(getattr(self, n).is_pinned() for n in INNER_TENSORS if getattr(self, n).numel())


def _pin_memory(self: NF4Tensor, device=None) -> NF4Tensor:
    return self._with_inner(torch.Tensor.pin_memory)


_DISPATCH = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
}

_DISPATCH.update(nf4_fsdp.TORCH_FSDP2_OPS)  # the row-chunk ops torch's own fully_shard uses

# torch.load(weights_only=True) refuses unknown callables; these two are safe to rebuild.
torch.serialization.add_safe_globals([_rebuild_nf4, NF4Tensor])


def nf4_parts(tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A whole NF4 weight's bytes as plain tensors ({"packed": uint8 codes, "scales", "scale_factors",
    "scale_mean"}) for formats that store plain dtypes only (safetensors); None for any other tensor."""
    if not isinstance(tensor, NF4Tensor):
        return None
    return {name: getattr(tensor, name) for name in INNER_TENSORS}


def nf4_from_parts(parts: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The NF4 weight whose bytes are ``parts`` (as ``nf4_parts`` gives them), with the layout of
    ``like`` (an NF4 weight of the same shape and block sizes). Raises ValueError naming what
    does not fit."""
    if not isinstance(like, NF4Tensor):
        raise ValueError(f"nf4_from_parts needs an NF4 weight to take the layout from, got {type(like).__name__}")
    for name in INNER_TENSORS:
        have, want = parts[name], getattr(like, name)
        if have.dtype != want.dtype or have.shape != want.shape:
            raise ValueError(f"{name}: {tuple(have.shape)} {have.dtype} given, the weight {like!r} holds "
                             f"{tuple(want.shape)} {want.dtype}")
    return NF4Tensor(*(parts[name] for name in INNER_TENSORS), like.nf4_layout)


def is_nf4_shard(tensor: torch.Tensor) -> bool:
    """True for an NF4 weight that holds only this rank's blocks (FSDP2's local shard)."""
    return isinstance(tensor, NF4Tensor) and tensor.is_shard


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in plain floating-point form: an NF4 weight dequantized to its nominal dtype
    (a copy), any other tensor as it is (not copied)."""
    return tensor.dequantize(tensor.dtype) if isinstance(tensor, NF4Tensor) else tensor


__all__ = ["NF4Tensor", "NF4Layout", "nf4_linear", "is_nf4_shard", "plain_tensor", "nf4_parts", "nf4_from_parts"]
