"""FSDP2 support for ``NF4Tensor``: shard by whole blocks, all-gather packed bytes.

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a tensor subclass choose
what is all-gathered through two methods, ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``; fsdp_lab's FSDP2 calls the same two, plus ``fsdp_shard`` (ours)
to cut the weight into per-rank shards. For NF4 the all-gather moves the packed codes
and the scale data, about numel/2 + numel/64 bytes, instead of 2*numel bytes of bf16.

How a weight is cut. Let the weight have N values in n_blocks = ceil(N / block_size)
blocks (row-major order, last block padded). Each of the W ranks holds
blocks_per_rank = ceil(n_blocks / W) consecutive blocks: rank r holds blocks
[r * blocks_per_rank, (r + 1) * blocks_per_rank), and the ranks at the end, whose range
runs past n_blocks, fill it with empty blocks (codes 7 = 0.0, scale 0). So rank r holds
the flat values [r * blocks_per_rank * block_size, ...) of the weight, which need not start
at a row boundary: a shard reports the nominal shape (ceil(rows / W), *rest) that FSDP2
expects of a dim-0 shard, but it has no row view; rows exist only after the all-gather.
Every rank holds the same number of packed bytes and scales, so the all-gather inputs
have equal sizes and the gathered buffers are the blocks of the weight in order (plus
the empty blocks at the end, which are dropped when dequantizing).

Double quantization groups (scaler_block_size consecutive block scales share one float32
factor) can straddle two ranks. Each rank carries the factors of every group its blocks
touch: groups_per_rank = the most groups any rank's block range touches (padded with
factor 1.0), plus the float32 mean of all scales. After the all-gather, group g's factor
is read from the rank that holds block g * scaler_block_size. This costs at most one
extra float32 per rank and keeps the gathered weight bit-identical to the original.

This module sits below ``nf4_tensor.py``, which calls it from ``NF4Tensor``'s ``fsdp_*``
methods and dispatch table: it never imports the class, and builds new weights as
``type(weight)(...)`` (or the ``cls`` the caller passes).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fsdp_lab.qlora.nf4_codec import NF4_ZERO_CODE, n_blocks_for, tag_quantized

_PAD_BYTE = (NF4_ZERO_CODE << 4) | NF4_ZERO_CODE


@dataclasses.dataclass(frozen=True)
class NF4ShardPlan:
    """How a weight's blocks are spread over ``world_size`` ranks (see the module docstring)."""

    n_blocks: int
    world_size: int
    blocks_per_rank: int
    groups_per_rank: int  # double-quant factors carried by each rank (0 without double quant)

    def first_block(self, rank: int) -> int:
        return rank * self.blocks_per_rank


def plan_shards(numel: int, block_size: int, scaler_block_size: int, double_quant: bool,
                world_size: int) -> NF4ShardPlan:
    """Blocks and double-quant groups per rank for a weight of ``numel`` values."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n_blocks = n_blocks_for(numel, block_size)
    per_rank = math.ceil(n_blocks / world_size)
    groups = 0
    if double_quant:
        starts = [r * per_rank for r in range(world_size)]
        groups = max((s + per_rank - 1) // scaler_block_size - s // scaler_block_size + 1 for s in starts)
    return NF4ShardPlan(n_blocks, world_size, per_rank, groups)


def all_gather_bytes(plan: NF4ShardPlan, block_size: int, double_quant: bool) -> int:
    """Bytes one all-gather of the weight writes into each rank's output buffers.

    world_size * (packed bytes + scales + [float32 factors and mean]) per rank's input.
    """
    per_rank = plan.blocks_per_rank * (block_size // 2)
    if double_quant:
        per_rank += plan.blocks_per_rank * 1 + (plan.groups_per_rank + 1) * 4
    else:
        per_rank += plan.blocks_per_rank * 4
    return plan.world_size * per_rank


def _padded(source: torch.Tensor, start: int, stop: int, length: int, fill) -> torch.Tensor:
    """source[start:stop] (clipped to source) copied into a new tensor of ``length``, rest = fill."""
    out = torch.full((length,), fill, dtype=source.dtype, device=source.device)
    piece = source[start:min(stop, source.numel())] if start < source.numel() else source[:0]
    out[: piece.numel()].copy_(piece)
    return out


def shard(weight: NF4Tensor, rank: int, world_size: int) -> NF4Tensor:
    """Rank ``rank``'s shard of a whole NF4 weight (see the module docstring for the layout).

    Raises ValueError for a shard of a shard or a rank outside [0, world_size).
    """
    lo = weight.nf4_layout
    if lo.is_shard:
        raise ValueError(f"{weight!r} is already a shard; shard the whole weight")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    plan = plan_shards(lo.numel, lo.block_size, lo.scaler_block_size, lo.double_quant, world_size)
    start = plan.first_block(rank)
    stop = min(start + plan.blocks_per_rank, plan.n_blocks)
    half = lo.block_size // 2
    packed = _padded(weight.packed, start * half, stop * half, plan.blocks_per_rank * half, _PAD_BYTE)
    scales = _padded(weight.scales, start, stop, plan.blocks_per_rank, 0)
    if lo.double_quant:
        first_group = start // lo.scaler_block_size
        factors = _padded(weight.scale_factors, first_group, first_group + plan.groups_per_rank,
                          plan.groups_per_rank, 1.0)
        mean = weight.scale_mean.clone()
    else:
        factors, mean = weight.scale_factors.clone(), weight.scale_mean.clone()
    tag_quantized(packed, scales, factors, mean)
    held = min(lo.numel, (start + plan.blocks_per_rank) * lo.block_size) - start * lo.block_size
    rows = lo.shape[0]
    layout = dataclasses.replace(
        lo, shape=(math.ceil(rows / world_size), *lo.shape[1:]), numel=max(0, held),
        first_block=start, full_shape=lo.shape, rank=rank, world_size=world_size,
    )
    return type(weight)(packed, scales, factors, mean, layout)


def unpadded(weight: NF4Tensor) -> NF4Tensor:
    """A copy of a whole (gathered) weight without the padding blocks of its shards.

    Its inner tensors have the sizes ``to_nf4`` gives the weight on one process. Raises
    ValueError on a shard.
    """
    lo = weight.nf4_layout
    if lo.is_shard:
        raise ValueError(f"{weight!r} is a shard; gather it first (fsdp_lab.fsdp2.full_tensor)")
    n_blocks = n_blocks_for(lo.numel, lo.block_size)
    out = type(weight)(weight.packed[: n_blocks * lo.block_size // 2].clone(), weight.scales[:n_blocks].clone(),
                    weight.scale_factors.clone(), weight.scale_mean.clone(), lo)
    tag_quantized(out.packed, out.scales, out.scale_factors, out.scale_mean)
    return out


def pre_all_gather(local: NF4Tensor, mesh=None) -> tuple[tuple[torch.Tensor, ...], NF4Layout]:
    """The all-gather inputs of a shard: ``(packed, scales[, factors + mean])`` and metadata.

    Each input has the same numel on every rank. Raises ValueError if ``local`` is not a
    shard or the mesh size differs from the world size the shard was cut for.
    """
    lo = local.nf4_layout
    if not lo.is_shard:
        raise ValueError(f"{local!r} is not an FSDP shard; create shards with fsdp_shard(rank, world_size)")
    shard_ranks = mesh.size(mesh.ndim - 1) if mesh is not None else lo.world_size  # HSDP: the shard dim
    if shard_ranks != lo.world_size:
        raise ValueError(f"shard was cut for world size {lo.world_size}, but the mesh shards over {shard_ranks} ranks")
    if lo.double_quant:
        return (local.packed, local.scales, torch.cat([local.scale_factors, local.scale_mean])), lo
    return (local.packed, local.scales), lo


def post_all_gather(all_gather_outputs, metadata: "NF4Layout", param_dtype, *, out=None, cls=None):
    """The whole weight from the gathered shards (each output = all ranks' inputs in rank order).

    Returns ``(NF4Tensor of the full shape in param_dtype, its inner tensors)``; the packed
    codes and scales are the all-gather outputs themselves (no copy; padding blocks stay at
    the end and are skipped when dequantizing). With ``out`` (an NF4Tensor returned by an
    earlier call) fills it in place and returns None. The gathered codes and scales keep
    the memory tag the caller gave its all-gather buffers; only the small factor and mean
    tensors made here are tagged ``quantized``. ``cls``: the class to build (the shard's own,
    ``NF4Tensor``). Raises ValueError on sizes that do not match the metadata.
    """
    lo = metadata
    full_numel = math.prod(lo.full_shape)
    plan = plan_shards(full_numel, lo.block_size, lo.scaler_block_size, lo.double_quant, lo.world_size)
    half = lo.block_size // 2
    packed, scales = all_gather_outputs[0].reshape(-1), all_gather_outputs[1].reshape(-1)
    expected = (lo.world_size * plan.blocks_per_rank * half, lo.world_size * plan.blocks_per_rank)
    if (packed.numel(), scales.numel()) != expected:
        raise ValueError(
            f"all-gather outputs hold {packed.numel()} bytes and {scales.numel()} scales; "
            f"a {list(lo.full_shape)} NF4 weight over {lo.world_size} ranks needs {expected}"
        )
    if lo.double_quant:
        per_rank = plan.groups_per_rank + 1  # factors, then the mean
        gathered = all_gather_outputs[2].reshape(lo.world_size, per_rank)
        group = torch.arange(math.ceil(plan.n_blocks / lo.scaler_block_size), device=packed.device)
        owner = group * lo.scaler_block_size // plan.blocks_per_rank
        local_group = group - owner * plan.blocks_per_rank // lo.scaler_block_size
        factors = gathered.reshape(-1).index_select(0, owner * per_rank + local_group)
        mean = gathered[0, plan.groups_per_rank:].clone()
    else:
        factors, mean = packed.new_empty(0, dtype=torch.float32), packed.new_empty(0, dtype=torch.float32)
    tag_quantized(factors, mean)
    full = dataclasses.replace(
        lo, shape=lo.full_shape, dtype=param_dtype or lo.dtype, numel=full_numel,
        first_block=0, full_shape=None, rank=0, world_size=1,
    )
    inner = (packed, scales, factors, mean)
    if out is None:
        return cls(*inner, full), inner
    if not isinstance(out, cls) or dataclasses.replace(out.nf4_layout, dtype=full.dtype) != full:
        raise ValueError(f"out must be the NF4Tensor an earlier fsdp_post_all_gather returned, got {out!r}")
    for name, new in zip(("packed", "scales", "scale_factors", "scale_mean"), inner):
        current = getattr(out, name)
        storage = current.untyped_storage()
        if storage.nbytes() and storage.data_ptr() == new.untyped_storage().data_ptr():
            continue  # out already views this all-gather output (torch's FSDP2 reuses buffers)
        if storage.nbytes() == new.numel() * new.element_size() and current.shape == new.shape:
            current.copy_(new)
        else:
            setattr(out, name, new)  # freed or different buffer: point out at the new data
    return None


# -- torch.distributed.fsdp.fully_shard compatibility ------------------------------------
# torch's FSDP2 cuts a parameter itself, by rows: torch.chunk (aten.split), new_zeros for the
# padded shard, narrow + copy_, view(-1), and as_strided on the gathered result. Row chunks
# and our block shards coincide only when the rows split evenly and every chunk holds whole
# blocks (and whole double-quant groups); those aten ops are supported for exactly that case
# (the same condition torchao imposes), so torch's FSDP2 can drive the hooks above.
# fsdp_lab's own FSDP2 calls fsdp_shard and needs none of this.
def _row_chunks_align(weight: NF4Tensor, rows_per_chunk: int) -> bool:
    lo = weight.nf4_layout
    rows = lo.shape[0]
    values = rows_per_chunk * (lo.numel // rows if rows else 0)
    unit = lo.block_size * (lo.scaler_block_size if lo.double_quant else 1)
    return rows > 0 and rows % rows_per_chunk == 0 and values % unit == 0


def _refuse(what: str, weight: NF4Tensor):
    lo = weight.nf4_layout
    if lo.is_shard:
        raise NotImplementedError(
            f"{what} on {weight!r}: this is a shard from fsdp_lab.fsdp2.fully_shard, which cuts NF4 "
            "weights by quantization blocks, not rows. For the whole weight call "
            "fsdp_lab.fsdp2.full_tensor(param) on every rank, or get_full_state_dict(model); "
            "load_full_state_dict(model, state) loads one back on any world size. (A "
            "torch.distributed.checkpoint of model.state_dict() reshards NF4 shards only where every "
            "shard's rows hold whole quantization blocks; one of fsdp_lab.fsdp2.dcp_state_dict(model) "
            "loads at any world size.)"
        )
    unit = lo.block_size * (lo.scaler_block_size if lo.double_quant else 1)
    raise NotImplementedError(
        f"{what} on {weight!r}: torch.distributed.fsdp.fully_shard cuts rows, which works for NF4 only "
        f"when the rows split evenly over the ranks and each rank's rows hold a multiple of {unit} "
        "values. fsdp_lab.fsdp2.fully_shard shards NF4 weights by blocks and has no such limit."
    )


def _split(weight: NF4Tensor, split_size: int, dim: int = 0):
    if dim != 0 or weight.is_shard or not _row_chunks_align(weight, split_size):
        _refuse(f"split(split_size={split_size}, dim={dim})", weight)
    world_size = weight.shape[0] // split_size
    return [shard(weight, rank, world_size) for rank in range(world_size)]


def _new_zeros(weight: NF4Tensor, size, dtype=None, layout=None, device=None, pin_memory=None):
    size = tuple(size)
    if weight.is_shard or size[1:] != tuple(weight.shape[1:]) or not _row_chunks_align(weight, size[0]):
        _refuse(f"new_zeros({list(size)})", weight)
    blank = shard(weight, 0, weight.shape[0] // size[0])
    blank.packed.fill_(_PAD_BYTE)
    blank.scales.zero_()
    return blank


def _alias_with_shape(weight: NF4Tensor, shape) -> NF4Tensor:
    return weight._with_inner(lambda t: t, shape=tuple(shape))


def _slice(weight: NF4Tensor, dim=0, start=None, end=None, step=1):
    rows = weight.shape[dim] if weight.dim() else 0
    start, end = start or 0, rows if end is None else min(end, rows)
    if start == 0 and end == rows and step == 1:
        return _alias_with_shape(weight, weight.shape)
    window = row_window(weight, start, end) if dim == 0 and step == 1 and weight.is_shard else None
    if window is None:
        _refuse(f"slice(dim={dim}, start={start}, end={end})", weight)
    return window


def row_window(weight: NF4Tensor, start: int, end: int) -> NF4Tensor | None:
    """Rows [start, end) of a shard as a piece that views its bytes, or None if they cut blocks.

    ``torch.distributed.checkpoint`` reshards a DTensor by narrowing rows of the saved and the
    new shards. That works for an NF4 shard whose blocks begin at its nominal first row
    (``rank * ceil(rows / world_size)``, as a row chunk would) and rows whose values start and
    end at block boundaries: the piece holds those blocks (views of the shard's codes, scales
    and double-quant factors), and ``copy_`` between pieces writes block ranges.
    """
    lo = weight.nf4_layout
    row = math.prod(lo.full_shape[1:])
    first_row = lo.rank * lo.shape[0]
    if row == 0 or lo.first_block * lo.block_size != first_row * row:
        return None
    full_numel = math.prod(lo.full_shape)
    v0, v1 = (first_row + start) * row, min((first_row + end) * row, full_numel)
    if v0 % lo.block_size or (v1 % lo.block_size and v1 != full_numel) or v1 <= v0:
        return None
    b0, b1 = v0 // lo.block_size - lo.first_block, math.ceil(v1 / lo.block_size) - lo.first_block
    half = lo.block_size // 2
    factors = weight.scale_factors
    if lo.double_quant:  # the factor slots from the piece's first group on (all true factors)
        factors = factors[(lo.first_block + b0) // lo.scaler_block_size - lo.first_block // lo.scaler_block_size:]
    layout = dataclasses.replace(lo, shape=(end - start, *lo.full_shape[1:]), numel=v1 - v0,
                                 first_block=lo.first_block + b0)
    return type(weight)(weight.packed[b0 * half:b1 * half], weight.scales[b0:b1], factors, weight.scale_mean, layout)


def copy_blocks(dst: NF4Tensor, src: NF4Tensor) -> bool:
    """Write the blocks ``src`` (a shard or a row piece) holds into ``dst`` (a shard or piece of
    the same weight, cut for any world size) where ``dst``'s block range contains them.

    Returns False (nothing written) when ``dst`` does not contain ``src``'s blocks.
    """
    a, b = dst.nf4_layout, src.nf4_layout
    if (a.full_shape, a.block_size, a.scaler_block_size, a.double_quant) != \
            (b.full_shape, b.block_size, b.scaler_block_size, b.double_quant):
        return False
    n = math.ceil(b.numel / b.block_size)  # blocks that hold values (no padding)
    offset = b.first_block - a.first_block
    half = a.block_size // 2
    if offset < 0 or (offset + n) * half > dst.packed.numel():
        return False
    dst.packed[offset * half:(offset + n) * half].copy_(src.packed[:n * half])
    dst.scales[offset:offset + n].copy_(src.scales[:n])
    if a.double_quant:
        # every group both carry a slot for (a shard carries the true factor of each group its
        # range may touch, 1.0 past the last group): the same value on both sides of a reshard
        groups = math.ceil(n_blocks_for(math.prod(a.full_shape), a.block_size) / a.scaler_block_size)
        d_first, s_first = a.first_block // a.scaler_block_size, b.first_block // a.scaler_block_size
        g0 = max(d_first, s_first)
        g1 = min(d_first + dst.scale_factors.numel(), s_first + src.scale_factors.numel(), groups)
        if g1 > g0:
            dst.scale_factors[g0 - d_first:g1 - d_first].copy_(src.scale_factors[g0 - s_first:g1 - s_first])
        dst.scale_mean.copy_(src.scale_mean)
    return True


def _view(weight: NF4Tensor, size):
    # A row-major reshape of the same values: only the reported shape changes.
    return _alias_with_shape(weight, torch.empty(weight.shape, device="meta").view(size).shape)


def _as_strided(weight: NF4Tensor, size, stride, storage_offset=0):
    if tuple(size) != tuple(weight.shape) or tuple(stride) != weight.stride() or storage_offset:
        _refuse(f"as_strided(size={list(size)}, stride={list(stride)})", weight)
    return _alias_with_shape(weight, weight.shape)


TORCH_FSDP2_OPS = {
    torch.ops.aten.split.Tensor: _split,
    torch.ops.aten.new_zeros.default: _new_zeros,
    torch.ops.aten.slice.Tensor: _slice,
    torch.ops.aten.view.default: _view,
    torch.ops.aten.as_strided.default: _as_strided,
}


# -- torch.distributed.checkpoint at any world size -----------------------------------------
# A shard's blocks are blocks [r * blocks_per_rank, ...) of the weight: exactly the rows rank r
# holds of a (n_blocks, block_size / 2) table of packed codes split as DTensor's Shard(0) splits
# (torch.chunk), and of the (n_blocks,) scales. As DTensors of those shapes, DCP reshards them
# by whole blocks for any world size, whatever the weight's rows. Double-quant factors (groups
# can straddle ranks) and the mean are small: they travel whole, gathered once.
def dcp_state(weight: NF4Tensor, mesh, placements, gather) -> dict[str, torch.Tensor]:
    """The shard's parts for ``torch.distributed.checkpoint``, by inner-tensor name.

    ``packed`` (n_blocks x block_size/2 uint8) and ``scales`` (n_blocks) are DTensors on
    ``mesh`` with ``placements`` (the parameter's, Shard(0) on the last mesh dimension) whose
    locals view this shard's bytes, so ``dcp.load`` writes into the shard; ``scale_factors``
    and ``scale_mean`` are whole plain tensors. ``gather(t)`` must return the concatenation of
    every shard rank's equal-sized 1-D ``t`` in rank order (it is called once, with double
    quantization only). Raises ValueError on a whole (unsharded) weight.
    """
    from torch.distributed.tensor import DTensor

    lo = weight.nf4_layout
    if not lo.is_shard:
        raise ValueError(f"{weight!r} is not a shard; a whole weight saves as it is")
    plan = plan_shards(math.prod(lo.full_shape), lo.block_size, lo.scaler_block_size, lo.double_quant,
                       lo.world_size)
    held = max(0, min(plan.blocks_per_rank, plan.n_blocks - lo.first_block))
    half = lo.block_size // 2
    rows = weight.packed.view(plan.blocks_per_rank, half)[:held]
    parts = {
        "packed": DTensor.from_local(rows, mesh, placements, run_check=False,
                                     shape=(plan.n_blocks, half), stride=(half, 1)),
        "scales": DTensor.from_local(weight.scales[:held], mesh, placements, run_check=False,
                                     shape=(plan.n_blocks,), stride=(1,)),
    }
    if lo.double_quant:
        slots = gather(weight.scale_factors.contiguous()).view(lo.world_size, plan.groups_per_rank)
        n_groups = math.ceil(plan.n_blocks / lo.scaler_block_size)
        factors = weight.scale_factors.new_empty(n_groups)
        for group in range(n_groups):  # read from the rank holding the group's first block
            owner = group * lo.scaler_block_size // plan.blocks_per_rank
            factors[group] = slots[owner, group - plan.first_block(owner) // lo.scaler_block_size]
        parts["scale_factors"] = factors
        parts["scale_mean"] = weight.scale_mean.clone()
    return parts


@torch.no_grad()
def load_dcp_state(weight: NF4Tensor, parts: dict[str, torch.Tensor]) -> None:
    """Copy parts that ``dcp.load`` filled (built by ``dcp_state`` on this shard) into it.

    The block tables are this shard's bytes already (copying them again is harmless); the
    factors of the groups this shard's blocks touch are taken from the whole list. Raises
    KeyError for a missing part.
    """
    lo = weight.nf4_layout
    for name in ("packed", "scales"):
        local = parts[name].to_local()
        target = weight.packed.view(-1, lo.block_size // 2) if name == "packed" else weight.scales
        if local.data_ptr() != target.data_ptr():
            target[:local.shape[0]].copy_(local)
    if lo.double_quant:
        factors = parts["scale_factors"]
        first = lo.first_block // lo.scaler_block_size
        count = max(0, min(weight.scale_factors.numel(), factors.numel() - first))
        weight.scale_factors[:count].copy_(factors[first:first + count])
        weight.scale_mean.copy_(parts["scale_mean"])
