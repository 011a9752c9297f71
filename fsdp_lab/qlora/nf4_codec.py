"""NF4 (4-bit NormalFloat) quantization: the code book and the functional core.

A weight is flattened in row-major order and cut into blocks of ``block_size`` values
(64 by default). Each block is divided by its absolute maximum (its *scale*), so its
values land in [-1, 1]; each value is replaced by the index of the nearest of 16 code
values (``NF4_CODEBOOK``), and two 4-bit indices are packed into one byte. With double
quantization the float32 block scales are themselves quantized to int8 in groups of
``scaler_block_size`` (256) scales, which brings the storage from 4.5 to about 4.127
bits per parameter.

This file is plain functions on plain tensors (read it top to bottom) and imports nothing
else of the package but the memory tags; ``NF4Tensor``, the tensor subclass that carries
these pieces through a model, is in ``nf4_tensor.py``, and ``nf4.py`` gathers both (with
``to_nf4``, the name torchao uses) under one name.

Padding: a tensor whose size is not a multiple of ``block_size`` gets zeros appended to
its last block (a zero is code 7, exactly 0.0), and a number of blocks that is not a
multiple of ``scaler_block_size`` leaves the last double-quantization group short
(it simply has fewer scales). torchao refuses both; we pad and drop the padding when
dequantizing.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from fsdp_lab.memory.tags import tag

# QLoRA paper, Appendix E; bitsandbytes uses the same 16 values (ascending), torchao rounds them
# to 4 decimals.
NF4_CODEBOOK = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)
NF4_ZERO_CODE = 7  # index of the exact 0.0; also what padding values quantize to

# A value goes to code k when midpoint[k-1] < value <= midpoint[k] (midpoints computed in
# float32), so a value exactly halfway between two codes goes to the lower one, as
# bitsandbytes does.
_MIDPOINTS = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2

# Dequantizing looks up both nibbles of a byte at once: row b of this table holds
# (code of b's high nibble, code of b's low nibble).
_BYTE_TO_PAIR = torch.stack(
    [NF4_CODEBOOK.repeat_interleave(16), NF4_CODEBOOK.repeat(16)], dim=1
).contiguous()


def build_nf4_codebook(offset: float = 0.9677083) -> torch.Tensor:
    """Derive the 16 NF4 code values from quantiles of the standard normal distribution.

    The QLoRA recipe: 8 positive values are the normal quantiles at
    ``linspace(offset, 0.5, 9)`` without its last point (0.5, which would be 0), 7 negative
    values are minus the quantiles at ``linspace(offset, 0.5, 8)`` without its last point,
    plus an exact 0; all divided by the largest so the ends are exactly -1 and +1. The
    asymmetry (8 positive, 7 negative) buys an exact zero with 16 codes. ``offset`` is the
    midpoint of the two 'outermost' quantiles the paper uses, (1 - 1/(2*15) + 1 - 1/(2*16))/2.
    Returns a float32 tensor of 16 ascending values (float64 arithmetic, then rounded).
    """
    normal = NormalDist()

    def linspace(start: float, stop: float, n: int) -> list[float]:
        return [start + (stop - start) * i / (n - 1) for i in range(n)]

    positive = [normal.inv_cdf(p) for p in linspace(offset, 0.5, 9)[:-1]]
    negative = [-normal.inv_cdf(p) for p in linspace(offset, 0.5, 8)[:-1]]
    values = sorted(positive + [0.0] + negative)
    top = max(values)
    return torch.tensor([v / top for v in values], dtype=torch.float32)


def nearest_nf4_code(normalized: torch.Tensor) -> torch.Tensor:
    """Index (uint8, 0..15) of the nearest NF4 code for each value in [-1, 1].

    Code k is chosen when midpoint[k-1] < value <= midpoint[k], with the midpoints of
    neighbouring codes computed in float32 (bitsandbytes' thresholds), so a value on a midpoint
    goes to the lower code, even where float32 rounding left that midpoint nearer the upper one.
    ``normalized`` is any float tensor; values outside [-1, 1] go to the end codes.
    Same shape as the input.
    """
    midpoints = _MIDPOINTS.to(normalized.device)
    # bucketize(right=False) counts the midpoints strictly below each value.
    return torch.bucketize(normalized.float(), midpoints, right=False).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte: element 2i in the high nibble, 2i+1 in the low nibble.

    ``codes``: uint8 values 0..15 with an even number of elements (any shape; row-major
    order). Returns a 1-D uint8 tensor of numel/2 bytes. Raises ValueError on an odd count.
    """
    if codes.numel() % 2:
        raise ValueError(f"pack_nibbles needs an even number of codes, got {codes.numel()}")
    pairs = codes.reshape(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 bytes -> uint8 codes (1-D, twice as many)."""
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1)


def _as_blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flatten row-major, pad with zeros to whole blocks (at least one), view as (n_blocks, block_size)."""
    flat = values.detach().reshape(-1).float()
    padding = n_blocks_for(flat.numel(), block_size) * block_size - flat.numel()
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(-1, block_size)


def quantize_nf4_blocks(values: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a tensor to NF4 codes, one float32 absmax scale per block.

    ``values`` is flattened row-major and padded with zeros to a whole number of blocks
    (an empty tensor becomes one zero block). Each block is divided by its absmax (a
    block of zeros keeps scale 0 and codes 7, without dividing by zero), mapped to the
    nearest code (a value on a float32 midpoint goes to the lower code) and packed two codes per byte, even-index
    element in the high nibble.
    Returns ``(packed, absmax)``: uint8 of n_blocks*block_size/2 bytes and float32 of
    n_blocks scales. Raises ValueError if ``block_size`` is not a positive even number.
    """
    _check_block_size(block_size)
    blocks = _as_blocks(values, block_size)
    absmax = blocks.abs().amax(dim=1)
    # A zero block divides by 1 instead of 0: its values are zeros and stay code 7.
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = nearest_nf4_code(blocks / divisor[:, None])
    return pack_nibbles(codes), absmax


def dequantize_nf4_blocks(
    packed: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 64,
    numel: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode packed NF4 codes: value = code_value * scale of its block (float32), cast to dtype.

    ``packed``: uint8 bytes of n_blocks whole blocks; ``scales``: float32 of n_blocks.
    ``numel`` keeps only the first values (drops padding). Returns a 1-D tensor.
    Vectorised: one 256-entry lookup gives both codes of a byte, then one in-place
    multiply by the block scales and one cast.
    """
    n_blocks = scales.numel()
    if packed.numel() * 2 != n_blocks * block_size:
        raise ValueError(
            f"{packed.numel()} packed bytes do not hold {n_blocks} blocks of {block_size} values"
        )
    table = _BYTE_TO_PAIR.to(packed.device)
    # Viewing each (high, low) pair of float32 as one int64 makes this a 1-D gather.
    pairs = table.view(torch.int64).view(256).index_select(0, packed.reshape(-1).int())
    values = pairs.view(torch.float32).view(n_blocks, block_size).mul_(scales.float()[:, None])
    out = values.view(-1).to(dtype)
    return out if numel is None else out[:numel]


def dequantize_nf4_blocks_fused(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Same result as ``dequantize_nf4_blocks`` written as element-wise ops only.

    This form is what ``torch.compile`` fuses into one kernel (unpack, look up, scale,
    cast); the eager version above is faster on CPU without compiling.
    """
    codebook = NF4_CODEBOOK.to(packed.device)
    codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1, block_size)
    values = codebook[codes.long()] * scales.float()[:, None]
    return values.to(dtype).reshape(-1)


def double_quantize_scales(
    scales: torch.Tensor, scaler_block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float32 block scales to int8 in groups of ``scaler_block_size``.

    The linear scheme torchao uses: subtract the mean of all scales, then per group
    ``factor = 256 / (2 * max|s - mean|)`` and ``q = clamp(round((s - mean) * factor),
    -128, 127)``; decoding is ``q / factor + mean``. bitsandbytes instead maps the
    centred scales through its *dynamic* 8-bit code (a sign bit, a run of zeros that acts
    as a per-value exponent, and linear fraction bits), which spends more codes near zero;
    the linear code here spends them evenly across [-max, max].
    A group whose centred scales are all zero gets factor 1 (q = 0 decodes to the mean).
    The last group may be short. Returns ``(q, factors, mean)``: int8 of n scales, float32
    of ceil(n / scaler_block_size) factors, float32 of shape (1,).
    Raises ValueError if ``scaler_block_size`` < 1.
    """
    if scaler_block_size < 1:
        raise ValueError(f"scaler_block_size must be >= 1, got {scaler_block_size}")
    scales = scales.float().reshape(-1)
    mean = scales.mean().reshape(1)
    centred = scales - mean
    padding = (-centred.numel()) % scaler_block_size
    groups = torch.cat([centred, centred.new_zeros(padding)]).view(-1, scaler_block_size)
    group_absmax = groups.abs().amax(dim=1)
    factors = torch.where(group_absmax > 0, 256 / (2 * group_absmax), torch.ones_like(group_absmax))
    q = (groups * factors[:, None]).round().clamp(-128, 127).to(torch.int8)
    # a copy when the last group was padded, so the storage holds exactly one byte per scale
    q = q.view(-1)[: scales.numel()].clone() if padding else q.view(-1)
    return q, factors, mean


def dequantize_scales(
    q: torch.Tensor,
    factors: torch.Tensor,
    mean: torch.Tensor,
    scaler_block_size: int = 256,
    first_block: int = 0,
) -> torch.Tensor:
    """Decode int8 block scales: ``q / factor_of_its_group + mean`` (float32, 1-D).

    ``first_block`` is the global index of ``q[0]`` when ``q`` is a slice of a larger
    tensor's scales (an FSDP shard); ``factors[0]`` is then the factor of the group that
    holds block ``first_block``.
    """
    blocks = torch.arange(q.numel(), device=q.device) + first_block
    group = blocks // scaler_block_size - first_block // scaler_block_size
    return q.float() / factors.index_select(0, group) + mean


def nf4_bits_per_param(block_size: int = 64, scaler_block_size: int = 256, double_quant: bool = True) -> float:
    """Storage in bits per parameter from the formula (large-tensor limit).

    Without double quantization: 4 + 32/block_size (a float32 scale per block).
    With it: 4 + 8/block_size + 32/(block_size*scaler_block_size) (an int8 scale per block
    and a float32 factor per group; the single float32 mean is negligible).
    """
    if double_quant:
        return 4 + 8 / block_size + 32 / (block_size * scaler_block_size)
    return 4 + 32 / block_size


def nf4_storage_bytes(numel: int, block_size: int = 64, scaler_block_size: int = 256,
                      double_quant: bool = True) -> int:
    """Exact bytes ``to_nf4`` stores for a tensor of ``numel`` values (all four inner tensors).

    n_blocks = ceil(numel / block_size) (at least 1); codes take n_blocks * block_size / 2
    bytes. With double quantization: an int8 scale per block, a float32 factor per group of
    ``scaler_block_size`` scales and one float32 mean, i.e.
    ``n_blocks*block_size/2 + n_blocks + 4*ceil(n_blocks/scaler_block_size) + 4``;
    without it, a float32 scale per block. Raises ValueError for a negative numel or bad sizes.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    _check_block_size(block_size)
    if scaler_block_size < 1:
        raise ValueError(f"scaler_block_size must be >= 1, got {scaler_block_size}")
    n_blocks = n_blocks_for(numel, block_size)
    codes = n_blocks * block_size // 2
    if double_quant:
        return codes + n_blocks + 4 * math.ceil(n_blocks / scaler_block_size) + 4
    return codes + 4 * n_blocks


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be a positive even integer (two codes per byte), got {block_size!r}")


def n_blocks_for(numel: int, block_size: int) -> int:
    """Number of blocks that hold ``numel`` values (at least one, padding the last)."""
    return max(1, math.ceil(numel / block_size))


def tag_quantized(*tensors: torch.Tensor) -> None:
    """Count these storages as ``quantized`` in fsdp_lab's memory accounting (empty ones skipped)."""
    for t in tensors:
        if t.numel():
            tag(t, "quantized")
