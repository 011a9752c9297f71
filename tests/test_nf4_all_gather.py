"""NF4Tensor's FSDP2 all-gather extension: a rank's shard, the tensors it sends, and the
weight rebuilt from what every rank sent. The all-gather is first simulated by concatenating
every rank's inputs by hand, then run for real over gloo on 2 ranks.

The expected bytes are worked out from the layout rules (blocks of 64 values, one scale per
block, one factor per scale group), not from the code; the expected values are the whole
weight's own dequantization.
"""

import math

import pytest
import torch

from fsdp_lab.qlora.nf4 import to_nf4
from fsdp_lab.qlora.nf4_tensor import NF4Tensor


# -- FSDP2 all-gather extension, all-gather simulated by hand -------------------------------
def _expected_gather_bytes(numel, world_size, block_size, scaler_block_size, double_quant):
    """Bytes every rank receives, worked out from the layout rules, not from the code."""
    n_blocks = max(1, math.ceil(numel / block_size))
    per_rank = math.ceil(n_blocks / world_size)
    codes = per_rank * block_size // 2
    if not double_quant:
        return world_size * (codes + 4 * per_rank)
    # Factors a rank carries: every group its (padded) block range touches, the same count on
    # every rank (the largest), plus the float32 mean.
    touched = [len({b // scaler_block_size for b in range(r * per_rank, (r + 1) * per_rank)})
               for r in range(world_size)]
    return world_size * (codes + per_rank + 4 * (max(touched) + 1))


def _simulate_fsdp2_all_gather(weight, world_size, param_dtype=None):
    shards = [weight.fsdp_shard(rank, world_size) for rank in range(world_size)]
    pre = [s.fsdp_pre_all_gather(None, weight.shape, weight.stride(), None, None) for s in shards]
    inputs = [tensors for tensors, _ in pre]
    for per_tensor in zip(*inputs):  # all_gather_into_tensor needs equal sizes on every rank
        assert len({t.numel() for t in per_tensor}) == 1 and len({t.dtype for t in per_tensor}) == 1
    outputs = tuple(torch.cat([t.reshape(-1) for t in per_tensor]) for per_tensor in zip(*inputs))
    full, inner = shards[0].fsdp_post_all_gather(outputs, pre[0][1], param_dtype)
    return shards, inputs, outputs, full, inner


SHAPES = [(64, 64), (5, 3), (7, 64), (100, 33), (256, 4160)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("double_quant,scaler_block_size", [(True, 256), (True, 3), (False, 256)])
def test_fsdp2_shard_gather_round_trip(shape, world_size, double_quant, scaler_block_size):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    weight = to_nf4(x, scaler_block_size=scaler_block_size, double_quant=double_quant)
    shards, inputs, outputs, full, inner = _simulate_fsdp2_all_gather(weight, world_size)
    # Nominal shard shape is FSDP2's padded dim-0 chunk.
    for s in shards:
        assert s.shape == (math.ceil(shape[0] / world_size), *shape[1:]) and s.is_shard
    # No floats of the weight travel: codes are uint8, scales int8 (or float32 without double quant).
    assert outputs[0].dtype == torch.uint8
    assert outputs[1].dtype == (torch.int8 if double_quant else torch.float32)
    gathered = sum(t.numel() * t.element_size() for t in outputs)
    assert gathered == _expected_gather_bytes(x.numel(), world_size, 64, scaler_block_size, double_quant)
    assert isinstance(full, NF4Tensor) and full.shape == x.shape and full.dtype == x.dtype
    assert torch.equal(full.dequantize(), weight.dequantize())
    # The packed codes are the all-gather output itself (no copy).
    assert inner[0].data_ptr() == outputs[0].data_ptr()
    # Shards hold consecutive runs of the flattened weight.
    assert torch.equal(torch.cat([s.dequantize_flat() for s in shards]), weight.dequantize().reshape(-1))


def test_fsdp2_gathered_bytes_for_a_large_layer():
    # 256 x 4160: 16,640 blocks, 65 scale groups. Bytes are ~numel/2 + numel/64 vs 2*numel in bf16.
    x = torch.randn(256, 4160)
    weight = to_nf4(x.to(torch.bfloat16))
    _, _, outputs, _, _ = _simulate_fsdp2_all_gather(weight, 2)
    gathered = sum(t.numel() * t.element_size() for t in outputs)
    # per rank: 8,320 blocks = 266,240 code bytes + 8,320 scales + 4 * (33 factors + 1 mean)
    assert gathered == 2 * (266_240 + 8_320 + 4 * 34)
    assert gathered / (2 * x.numel()) == pytest.approx(4.127 / 16, abs=1e-3)  # 4.127 of 16 bits


def test_fsdp2_post_all_gather_param_dtype_and_out():
    x = torch.randn(100, 33)
    weight = to_nf4(x, scaler_block_size=4)
    shards, inputs, outputs, full, inner = _simulate_fsdp2_all_gather(weight, 3, torch.bfloat16)
    assert full.dtype == torch.bfloat16 and torch.equal(full.dequantize(), weight.dequantize(torch.bfloat16))
    metadata = shards[0].fsdp_pre_all_gather(None, None, None, None, None)[1]
    # Same buffers again (as torch's FSDP2 reuses them): nothing to copy, values unchanged.
    assert shards[1].fsdp_post_all_gather(outputs, metadata, torch.bfloat16, out=full) is None
    assert torch.equal(full.dequantize(), weight.dequantize(torch.bfloat16))
    # New buffers holding another weight's shards: out is refilled from them.
    other = to_nf4(torch.randn(100, 33), scaler_block_size=4)
    _, _, new_outputs, _, _ = _simulate_fsdp2_all_gather(other, 3)
    shards[2].fsdp_post_all_gather(new_outputs, metadata, torch.bfloat16, out=full)
    assert torch.equal(full.dequantize(), other.dequantize(torch.bfloat16))


def test_fsdp2_shard_errors():
    weight = to_nf4(torch.randn(10, 96))  # 15 blocks: 8 per rank, 5.33 rows
    shard = weight.fsdp_shard(1, 2)
    with pytest.raises(RuntimeError, match="inside a row"):
        shard.dequantize()
    with pytest.raises(ValueError, match="already a shard"):
        shard.fsdp_shard(0, 2)
    with pytest.raises(ValueError, match="outside"):
        weight.fsdp_shard(2, 2)
    with pytest.raises(ValueError, match="not an FSDP shard"):
        weight.fsdp_pre_all_gather(None, None, None, None, None)
    tensors, metadata = shard.fsdp_pre_all_gather(None, None, None, None, None)
    with pytest.raises(ValueError, match="needs"):
        shard.fsdp_post_all_gather(tuple(t[:-1] for t in tensors), metadata, None)


def test_row_chunk_ops_for_torch_fully_shard():
    # torch's fully_shard cuts rows with torch.chunk; aligned chunks are our block shards.
    aligned = to_nf4(torch.randn(256, 128))  # 128 rows x 128 = 16,384 values = one group per chunk
    chunks = torch.chunk(aligned, 2)
    for rank, chunk in enumerate(chunks):
        assert chunk.shape == (128, 128) and torch.equal(chunk.packed, aligned.fsdp_shard(rank, 2).packed)
    assert torch.equal(aligned.view(-1).dequantize(), aligned.dequantize().view(-1))
    with pytest.raises(NotImplementedError, match="fsdp_lab.fsdp2.fully_shard shards NF4 weights by blocks"):
        torch.chunk(to_nf4(torch.randn(6, 64)), 2)


# -- the same hooks over a real gloo all-gather on 2 ranks ---------------------------------
GLOO_CONFIGS = [((64, 64), True, 256), ((5, 3), True, 256), ((7, 64), True, 3), ((100, 33), False, 256),
                ((256, 4160), True, 256)]


def _gloo_gather_worker(configs):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for shape, double_quant, scaler_block_size in configs:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))  # same on every rank
        local = to_nf4(x, scaler_block_size=scaler_block_size, double_quant=double_quant).fsdp_shard(rank, world_size)
        inputs, metadata = local.fsdp_pre_all_gather(mesh, x.shape, x.stride(), None, None)
        outputs = []
        for t in inputs:
            out = torch.empty(world_size * t.numel(), dtype=t.dtype)
            dist.all_gather_into_tensor(out, t.reshape(-1).contiguous())
            outputs.append(out)
        full, _ = local.fsdp_post_all_gather(tuple(outputs), metadata, torch.bfloat16)
        results.append({"dtype": str(full.dtype), "shape": tuple(full.shape),
                        "values": full.dequantize(torch.float32),
                        "bytes": sum(o.numel() * o.element_size() for o in outputs)})
    return results


@pytest.fixture(scope="module")
def gloo_gather_results():
    launch = pytest.importorskip("fsdp_lab.launch").launch
    return launch(_gloo_gather_worker, GLOO_CONFIGS, world_size=2, timeout=120)


@pytest.mark.parametrize("index", range(len(GLOO_CONFIGS)))
def test_fsdp2_hooks_over_gloo_all_gather(gloo_gather_results, index):
    shape, double_quant, scaler_block_size = GLOO_CONFIGS[index]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    reference = to_nf4(x, scaler_block_size=scaler_block_size, double_quant=double_quant).dequantize()
    for per_rank in gloo_gather_results:
        result = per_rank[index]
        assert result["dtype"] == "torch.bfloat16" and result["shape"] == shape
        assert torch.equal(result["values"], reference)
        assert result["bytes"] == _expected_gather_bytes(x.numel(), 2, 64, scaler_block_size, double_quant)
