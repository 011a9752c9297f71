"""NF4 quantization: code book, nearest code, packing, error bounds, double quantization and
the NF4Tensor subclass (F.linear, moving, saving). Its FSDP2 all-gather extension is tested in
test_nf4_all_gather.py.

References are independent of the code under test: the code book from REFERENCES.md
and from normal quantiles, brute-force nearest codes in float64, bytes written out by
hand, error bounds derived from the code book's widest gap, and plain F.linear on
dequantized weights.
"""

import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.qlora.nf4 import (
    NF4_CODEBOOK,
    build_nf4_codebook,
    dequantize_nf4_blocks,
    double_quantize_scales,
    nearest_nf4_code,
    nf4_bits_per_param,
    pack_nibbles,
    quantize_nf4_blocks,
    to_nf4,
    unpack_nibbles,
)
from fsdp_lab.qlora.nf4_tensor import NF4Tensor

# REFERENCES.md, "NF4": the 16 values as published.
PUBLISHED = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
# Half the widest gap of the code book (-1 to -0.696) is 0.15190...; 0.1520 leaves float slack.
MAX_ERR = 0.1520


def _block_absmax(x: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    flat = x.detach().double().reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % block_size)])
    return flat.view(-1, block_size).abs().amax(1)


# -- code book ------------------------------------------------------------------------
def test_codebook_matches_published_values_and_normal_quantiles():
    assert NF4_CODEBOOK.dtype == torch.float32 and NF4_CODEBOOK.shape == (16,)
    assert NF4_CODEBOOK.tolist() == torch.tensor(PUBLISHED, dtype=torch.float32).tolist()
    built = build_nf4_codebook()
    assert (built - torch.tensor(PUBLISHED, dtype=torch.float64)).abs().max() < 1e-6
    assert bool((built[1:] > built[:-1]).all())
    assert built[0].item() == -1.0 and built[-1].item() == 1.0
    assert (built == 0).sum().item() == 1 and built[7].item() == 0.0


# -- nearest code, ties, packing ---------------------------------------------------------
def test_nearest_code_matches_brute_force_float64():
    torch.manual_seed(0)
    values = torch.rand(200_000) * 2 - 1
    codebook = torch.tensor(PUBLISHED, dtype=torch.float64)
    distances = (values.double()[:, None] - codebook[None, :]).abs()
    expected = distances.argmin(dim=1)  # first minimum: the lower code on a tie
    assert torch.equal(nearest_nf4_code(values).long(), expected)


# bitsandbytes' decision thresholds (the float constants of its dQuantizeNF4), ascending: code k+1
# when x > BNB_THRESHOLDS[k], so a value equal to one takes the lower code
BNB_THRESHOLDS = [
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
]


def test_codes_at_and_just_above_bitsandbytes_thresholds():
    thresholds = torch.tensor(BNB_THRESHOLDS, dtype=torch.float32)
    assert torch.equal(nearest_nf4_code(thresholds).long(), torch.arange(15))
    just_above = torch.nextafter(thresholds, torch.tensor(2.0))
    assert torch.equal(nearest_nf4_code(just_above).long(), torch.arange(1, 16))


def test_exact_tie_goes_to_lower_code():
    cb = torch.tensor(PUBLISHED, dtype=torch.float32)
    exact_ties = 0
    for k in range(15):
        mid = ((cb[k] + cb[k + 1]) / 2).item()  # float32 midpoint
        lower, upper = cb[k].double().item(), cb[k + 1].double().item()
        if mid - lower != upper - mid:
            continue  # this midpoint is not exactly representable: no exact tie exists
        exact_ties += 1
        # A block whose absmax is 2 (a power of two: scaling is exact); mid * 2 is the tie.
        block = torch.zeros(64)
        block[0] = 2.0
        block[1] = 2 * mid
        block[2] = torch.nextafter(torch.tensor(2 * mid), torch.tensor(9.0)).item()
        packed, _ = quantize_nf4_blocks(block)
        codes = unpack_nibbles(packed)
        assert codes[1].item() == k, f"tie between codes {k} and {k + 1} went to {codes[1].item()}"
        assert codes[2].item() == k + 1
    assert exact_ties == 6  # the others' float32 sums round: those midpoints are not exactly halfway


def test_packing_by_hand():
    # One block holding every code value four times in order: codes 0,1,2,...,15,0,1,...
    block = torch.tensor(PUBLISHED * 4, dtype=torch.float32)
    packed, absmax = quantize_nf4_blocks(block, block_size=64)
    assert absmax.tolist() == [1.0]
    # Element 2i in the high nibble: (0,1) -> 0x01, (2,3) -> 0x23, ...
    assert packed.tolist() == [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF] * 4
    codes = torch.tensor([3, 12, 15, 0, 7, 7], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [0x3C, 0xF0, 0x77]
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


# -- error bounds and exact round trips ---------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "uniform", "heavy_tail", "outliers"])
def test_error_bound_random(kind):
    g = torch.Generator().manual_seed(1)
    n = 64 * 500 + 17  # not a multiple of the block size: the last block is padded
    x = {
        "normal": lambda: torch.randn(n, generator=g),
        "uniform": lambda: torch.rand(n, generator=g) * 6 - 3,
        "heavy_tail": lambda: torch.randn(n, generator=g) ** 3,
        "outliers": lambda: torch.randn(n, generator=g) * (1 + 1000 * (torch.rand(n, generator=g) > 0.99)),
    }[kind]()
    w = to_nf4(x, double_quant=False)
    err = (w.dequantize().double() - x.double()).abs()
    bound = MAX_ERR * _block_absmax(x).repeat_interleave(64)[:n]
    assert bool((err <= bound).all())


def test_error_bound_adversarial_is_tight():
    # Values just below the midpoint of the widest gap (-1 .. -0.696) are rounded to -0.696:
    # the error is half the gap, 0.1519 * absmax, the worst case.
    absmax = torch.tensor([1.0, 3.0, 0.01, 1234.5])
    mid = (-1.0 - 0.6961928009986877) / 2
    blocks = torch.zeros(4, 64)
    blocks[:, 0] = absmax
    blocks[:, 1:] = (mid + 1e-6) * absmax[:, None]
    w = to_nf4(blocks, double_quant=False)
    err = (w.dequantize().double() - blocks.double()).abs()
    ratio = err / absmax.double()[:, None]
    assert bool((ratio <= MAX_ERR).all())
    assert ratio.max().item() > 0.1518  # the bound is reached, so the test above can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codebook_times_absmax_round_trips_exactly(dtype):
    g = torch.Generator().manual_seed(2)
    n_blocks = 300
    cb = torch.tensor(PUBLISHED, dtype=torch.float32)
    codes = torch.randint(0, 16, (n_blocks, 64), generator=g)
    codes[:, 5] = torch.randint(0, 2, (n_blocks,), generator=g) * 15  # a +-1 in every block
    # Scales representable in dtype, so the +-1 entry makes each block's absmax exactly the
    # scale; in bfloat16, x = round(code * scale) and decoding rounds the same product.
    scales = (torch.rand(n_blocks, generator=g) * 10 + 0.01).to(dtype).float()
    x = (cb[codes] * scales[:, None]).to(dtype)
    w = to_nf4(x, double_quant=False)
    assert torch.equal(w.dequantize(), x)


def test_zero_blocks_do_not_divide_by_zero():
    x = torch.zeros(3, 64)
    x[1] = torch.linspace(-2, 2, 64)
    for dq in (False, True):
        w = to_nf4(x, double_quant=dq)
        out = w.dequantize()
        assert bool(torch.isfinite(out).all())
        assert torch.equal(out[0], torch.zeros(64)) and torch.equal(out[2], torch.zeros(64))
    assert to_nf4(torch.zeros(5, 3)).dequantize().abs().sum().item() == 0.0


@pytest.mark.parametrize("shape", [(5, 3), (7, 65), (1,), (3, 5, 7), (0, 4)])
def test_sizes_not_multiple_of_block_are_padded(shape):
    x = torch.randn(shape)
    w = to_nf4(x, scaler_block_size=4)
    assert w.shape == x.shape and w.dequantize().shape == x.shape
    n_blocks = max(1, math.ceil(x.numel() / 64))
    assert w.packed.numel() == n_blocks * 32 and w.scales.numel() == n_blocks
    assert w.scale_factors.numel() == math.ceil(n_blocks / 4)
    if x.numel() % 64:
        # The padding values are zeros: code 7 (0.0) in the tail of the last block.
        codes = unpack_nibbles(w.packed)
        assert bool((codes[x.numel():] == 7).all())


# -- double quantization ----------------------------------------------------------------
def test_double_quant_scale_error_is_bounded():
    g = torch.Generator().manual_seed(3)
    n_blocks = 256 * 20 + 37  # the last group is short
    spread = torch.rand(n_blocks, generator=g) * 3 + 0.1
    x = torch.randn(n_blocks * 64, generator=g) * spread.repeat_interleave(64)
    w = to_nf4(x, double_quant=True)
    assert w.scales.dtype == torch.int8 and w.scale_factors.numel() == 21 and w.scale_mean.shape == (1,)
    # Bound, per group with M = max|s - mean| over the group: the int8 code step is
    # 1/factor = 2M/256, so rounding errs by at most half a step, M/256. Only a value with
    # (s - mean) * factor > 127.5 (the group's positive extreme) rounds to 128 and is
    # clamped to 127, which errs by a full step, M/128.
    absmax = _block_absmax(x)
    centred = absmax - absmax.mean()
    padded = torch.cat([centred, centred.new_zeros((-centred.numel()) % 256)])
    group_max = padded.view(-1, 256).abs().amax(1).repeat_interleave(256)[:n_blocks]
    err = (w.block_scales().double() - absmax).abs()
    slack = 1e-6 * absmax.max()
    clamped = centred * (128 / group_max) > 127.5
    assert bool((err[~clamped] <= group_max[~clamped] / 256 + slack).all())
    assert bool((err <= group_max / 128 + slack).all())
    assert (err / group_max).max().item() > 1 / 1024  # a real quantization error, not zero
    q, factors, mean = double_quantize_scales(absmax.float(), 256)
    assert torch.equal(q, w.scales) and torch.equal(factors, w.scale_factors)


def test_bits_per_param_from_stored_bytes():
    x = torch.randn(2048, 2048)
    n = x.numel()
    dq, plain = to_nf4(x, double_quant=True), to_nf4(x, double_quant=False)
    stored = {name: getattr(dq, name).numel() * getattr(dq, name).element_size()
              for name in ("packed", "scales", "scale_factors", "scale_mean")}
    assert stored == {"packed": n // 2, "scales": n // 64, "scale_factors": 4 * n // (64 * 256), "scale_mean": 4}
    bits = 8 * dq.storage_bytes() / n
    formula = 4 + 8 / 64 + 32 / (64 * 256)
    assert formula == pytest.approx(4.127, abs=5e-4)
    assert bits == pytest.approx(formula + 32 / n, abs=1e-12)  # + the single float32 mean
    assert nf4_bits_per_param() == formula
    assert 8 * plain.storage_bytes() / n == 4.5 == nf4_bits_per_param(double_quant=False)


# -- NF4Tensor --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nf4tensor_reports_shape_and_dtype(dtype):
    x = torch.randn(48, 40).to(dtype)
    w = to_nf4(x)
    assert isinstance(w, NF4Tensor) and w.shape == (48, 40) and w.dtype == dtype and w.device == x.device
    plain = w.to(torch.float32) if dtype != torch.float32 else w.dequantize()
    assert type(plain) is torch.Tensor and plain.dtype == torch.float32
    # Each value is computed in float32 and rounded once to the target dtype.
    assert torch.equal(w.dequantize(torch.bfloat16), w.dequantize(torch.float32).to(torch.bfloat16))
    assert torch.equal(w.dequantize(), w.dequantize(torch.float32).to(dtype))


def test_linear_forward_and_backward_match_dequantized_reference():
    g = torch.Generator().manual_seed(4)
    w = to_nf4(torch.randn(24, 40, generator=g))
    bias = torch.randn(24, generator=g, requires_grad=True)
    x = torch.randn(3, 5, 40, generator=g, requires_grad=True)
    y = F.linear(x, w, bias)
    upstream = torch.randn(3, 5, 24, generator=g)
    y.backward(upstream)
    ref_w = w.dequantize().clone()  # a plain tensor: ordinary autograd from here on
    x_ref = x.detach().clone().requires_grad_(True)
    b_ref = bias.detach().clone().requires_grad_(True)
    y_ref = F.linear(x_ref, ref_w, b_ref)
    y_ref.backward(upstream)
    assert torch.allclose(y, y_ref, atol=1e-6)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    assert torch.allclose(bias.grad, b_ref.grad, atol=1e-6)


def test_nf4_parameter_gets_no_gradient_and_bfloat16_works():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    lin.weight = nn.Parameter(to_nf4(lin.weight.detach()), requires_grad=False)
    assert isinstance(lin.weight, nn.Parameter) and isinstance(lin.weight, NF4Tensor)
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()
    assert lin.weight.grad is None and x.grad is not None and x.grad.dtype == torch.bfloat16


def test_detach_clone_to_device_and_copy():
    x = torch.randn(33, 70)
    w = to_nf4(x)
    for other in (w.detach(), w.clone(), w.to("cpu", copy=True), w.cpu()):
        assert isinstance(other, NF4Tensor) and torch.equal(other.dequantize(), w.dequantize())
    c = w.clone()
    assert c.packed.data_ptr() != w.packed.data_ptr()
    target = to_nf4(torch.zeros(33, 70))
    target.copy_(w)  # NF4 <- NF4 of the same layout: copies bytes
    assert torch.equal(target.packed, w.packed) and torch.equal(target.scales, w.scales)
    target.copy_(x * 2)  # NF4 <- plain float: quantizes
    assert torch.equal(target.packed, to_nf4(x * 2).packed)
    with pytest.raises(ValueError, match="same shape, block sizes"):
        target.copy_(to_nf4(x, block_size=32))
    with pytest.raises(ValueError, match="cannot copy"):
        target.copy_(torch.randn(3, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory():
    w = to_nf4(torch.randn(16, 64)).pin_memory()
    assert isinstance(w, NF4Tensor) and w.is_pinned()


def test_module_dtype_and_device_conversions_never_half_convert():
    model = _model_with_nf4(0)
    weight = model[0].weight
    # A device move keeps the weight quantized (meta stands in for another device here).
    moved = _model_with_nf4(0).to("meta")
    assert isinstance(moved[0].weight, NF4Tensor) and moved[0].weight.packed.device.type == "meta"
    # A dtype change gives a plain parameter holding the dequantized values, like Tensor.to(dtype).
    model.to(torch.bfloat16)
    assert type(model[0].weight) is nn.Parameter and model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight.detach(), weight.dequantize(torch.bfloat16))


def test_unsupported_op_names_op_and_reason():
    w = to_nf4(torch.randn(8, 64))
    with pytest.raises(NotImplementedError, match=r"aten\.add.*frozen quantized weight"):
        w + 1
    with pytest.raises(NotImplementedError, match=r"aten\.t"):
        w.t()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="floating-point"):
        to_nf4(torch.arange(64))
    with pytest.raises(ValueError, match="at least one dimension"):
        to_nf4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="even"):
        to_nf4(torch.randn(64), block_size=63)
    with pytest.raises(TypeError, match="double_quant must be True or False, got 'no'"):
        to_nf4(torch.randn(64), double_quant="no")


def _model_with_nf4(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(40, 70), nn.ReLU(), nn.Linear(70, 9))
    for layer in (model[0], model[2]):
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach(), scaler_block_size=4), requires_grad=False)
    return model


def test_state_dict_round_trip_is_bit_exact(tmp_path):
    source, target = _model_with_nf4(0), _model_with_nf4(1)
    assert not torch.equal(source[0].weight.packed, target[0].weight.packed)
    target.load_state_dict(source.state_dict())
    path = tmp_path / "nf4.pt"
    torch.save(source.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    third = _model_with_nf4(2)
    third.load_state_dict(loaded)
    for model in (target, third):
        for name in ("packed", "scales", "scale_factors", "scale_mean"):
            assert torch.equal(getattr(model[0].weight, name), getattr(source[0].weight, name))
            assert torch.equal(getattr(model[2].weight, name), getattr(source[2].weight, name))
        assert isinstance(model[0].weight, NF4Tensor) and not model[0].weight.requires_grad
    buffer = io.BytesIO()
    torch.save(source[0].weight, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True).dequantize(), source[0].weight.dequantize())


def test_storages_are_tagged_quantized():
    tags = pytest.importorskip("fsdp_lab.memory.tags")
    w = to_nf4(torch.randn(16, 64))
    for name in ("packed", "scales", "scale_factors", "scale_mean"):
        assert tags.category_of(getattr(w, name).untyped_storage()) == "quantized"


@pytest.mark.slow  # ~30 s of compiling on a 2-core CPU
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_dequantize_matches_eager():
    from fsdp_lab.toolchain import missing_for_torch_compile
    missing = missing_for_torch_compile()
    if missing:
        pytest.skip(f"torch.compile on CPU needs {missing}")
    w = to_nf4(torch.randn(96, 64).to(torch.bfloat16))
    assert torch.equal(w.dequantize(compile=True), w.dequantize(compile=False))


def test_dequantize_blocks_functional_core():
    packed = torch.tensor([0xF0, 0x7E], dtype=torch.uint8)  # codes 15, 0, 7, 14
    out = dequantize_nf4_blocks(packed, torch.tensor([2.0]), block_size=4)
    assert out.tolist() == [2.0, -2.0, 0.0, 2 * torch.tensor(PUBLISHED[14]).item()]

