"""NF4 dequantization: eager vs ``torch.compile``'d, side by side in one process.

    PYTHONPATH=. python benchmarks/nf4_compile.py     # writes benchmarks/results/nf4_compile_<device>.json

QLoRA's speed on GPUs came largely from compiling the dequantization (unpack the two 4-bit codes
of a byte, look each up in the 16-entry code book, scale by its block's absmax, cast) into one
kernel. This script dequantizes the same 4096 x 4096 NF4 weight (block 64) with fsdp_lab's eager
gather form (``dequantize_nf4_blocks``), the element-wise form (``dequantize_nf4_blocks_fused``)
run eagerly, and that form under ``torch.compile``; checks that all three give identical values,
and prints medians (interleaved repeats, so load from other processes hits all alike) and the
ratio eager / compiled (higher: compiling helps). Bytes/s are bytes of dequantized output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fsdp_lab.qlora.nf4 import (dequantize_nf4_blocks, dequantize_nf4_blocks_fused,  # noqa: E402
                                quantize_nf4_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="the weight is size x size")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/nf4_compile_<device>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    block = 64
    weight = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0)).to(device)
    packed, scales = quantize_nf4_blocks(weight.reshape(-1), block)
    dtype = torch.bfloat16

    compiled = torch.compile(dequantize_nf4_blocks_fused, dynamic=False)
    start = time.perf_counter()
    reference = dequantize_nf4_blocks(packed, scales, block, dtype=dtype)
    first = compiled(packed, scales, block, dtype)
    compile_seconds = time.perf_counter() - start
    variants = {"eager_gather": lambda: dequantize_nf4_blocks(packed, scales, block, dtype=dtype),
                "eager_elementwise": lambda: dequantize_nf4_blocks_fused(packed, scales, block, dtype),
                "compiled_elementwise": lambda: compiled(packed, scales, block, dtype)}
    for name, fn in variants.items():
        if not torch.equal(fn(), reference):
            raise SystemExit(f"{name} differs from the eager dequantization")
    assert torch.equal(first, reference)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    out_bytes = reference.numel() * reference.element_size()
    median = {name: statistics.median(v) for name, v in times.items()}
    result = {"device": device.type, "torch": torch.__version__, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "shape": [args.size, args.size], "block_size": block,
              "dtype": str(dtype), "repeats": args.repeats, "first_call_with_compile_s": compile_seconds,
              "median_s": median, "gbytes_per_s": {n: out_bytes / s / 1e9 for n, s in median.items()},
              "ratio_eager_elementwise_over_compiled": median["eager_elementwise"] / median["compiled_elementwise"],
              "ratio_eager_gather_over_compiled": median["eager_gather"] / median["compiled_elementwise"]}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for name, s in median.items():
        print(f"{name:<22} {s * 1e3:8.2f} ms  {out_bytes / s / 1e9:6.2f} GB/s")
    print(f"eager element-wise / compiled: {result['ratio_eager_elementwise_over_compiled']:.2f}x; "
          f"eager gather / compiled: {result['ratio_eager_gather_over_compiled']:.2f}x "
          f"(first call incl. compile {compile_seconds:.1f} s)")
    path = args.out or os.path.join(os.path.dirname(__file__), "results", f"nf4_compile_{device.type}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", path)


if __name__ == "__main__":
    main()
