"""NF4 quantize time and dequantize throughput: fsdp_lab vs torchao's ``to_nf4``, side by side.

    pip install torchao==0.18.0 --no-deps    # the reference; the script still runs without it
    PYTHONPATH=. python benchmarks/nf4.py    # writes benchmarks/results/nf4_cpu.json
    PYTHONPATH=. python benchmarks/nf4.py --device cuda   # writes nf4_cuda.json (adds compile and copy bandwidth)

Both libraries quantize the same 4096 x 4096 weight (block 64, double quantization with
groups of 256) and dequantize it back to the weight's dtype. Timings are medians over
repeats, ours and torchao's interleaved so that load from other processes hits both alike.
Throughput is bytes of dequantized output per second. The printed ratio is
ours / torchao for throughput (higher is better) and torchao / ours for quantize time.
Accuracy columns compare each result with the original weight.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fsdp_lab.qlora.nf4 import NF4_CODEBOOK, to_nf4, unpack_nibbles  # noqa: E402


def load_torchao():
    """torchao's to_nf4, or (None, reason) when it cannot be imported here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as ao_to_nf4
        import torchao

        return ao_to_nf4, f"torchao {torchao.__version__}"
    except Exception as exc:  # ImportError, or a compiled extension that does not load
        return None, f"torchao unavailable: {type(exc).__name__}: {exc}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: dict, device: torch.device, repeats: int) -> dict:
    """Median seconds of each callable, calls interleaved, after one warm-up call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted once, as output bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = median_times({"copy": lambda: dst.copy_(src)}, device, repeats)["copy"]
    return nbytes / t


def compare_codes(weight: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor, block_size: int = 64) -> dict:
    """Where the two libraries pick different codes, which pick is nearer in float64."""
    ours, theirs = unpack_nibbles(ours.cpu()).long(), unpack_nibbles(theirs.cpu()).long()
    differ = (ours != theirs).nonzero().view(-1)
    flat = weight.detach().cpu().double().reshape(-1)
    absmax = flat.view(-1, block_size).abs().amax(1)
    x = flat[differ] / absmax[differ // block_size]
    codebook = NF4_CODEBOOK.double()
    d_ours, d_theirs = (x - codebook[ours[differ]]).abs(), (x - codebook[theirs[differ]]).abs()
    return {
        "values": ours.numel(), "different": differ.numel(),
        "ours_nearer": int((d_ours < d_theirs).sum()), "torchao_nearer": int((d_theirs < d_ours).sum()),
    }


def run(device: torch.device, dtype: torch.dtype, shape, repeats: int, ao_to_nf4) -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g).to(dtype).to(device)
    out_bytes = weight.numel() * weight.element_size()
    ours = to_nf4(weight, compile=False)
    row = {"dtype": str(dtype).replace("torch.", ""), "shape": list(shape), "output_bytes": out_bytes}
    quant = {"ours": lambda: to_nf4(weight)}
    deq = {"ours": lambda: ours.dequantize(compile=False)}
    if device.type == "cuda":
        ours.dequantize(compile=True)  # compile once outside the timing
        deq["ours_compiled"] = lambda: ours.dequantize(compile=True)
    if ao_to_nf4 is not None:
        theirs = ao_to_nf4(weight)
        quant["torchao"] = lambda: ao_to_nf4(weight)
        deq["torchao"] = lambda: theirs.get_original_weight()
    q_times = median_times(quant, device, max(3, repeats // 3))
    d_times = median_times(deq, device, repeats)
    row["quantize_s"] = q_times
    row["dequantize_s"] = d_times
    row["dequantize_GBps"] = {k: out_bytes / t / 1e9 for k, t in d_times.items()}
    original = weight.float()
    row["max_abs_error"] = {"ours": (ours.dequantize().float() - original).abs().max().item()}
    row["mean_abs_error"] = {"ours": (ours.dequantize().float() - original).abs().mean().item()}
    if ao_to_nf4 is not None:
        back = theirs.get_original_weight().float()
        row["max_abs_error"]["torchao"] = (back - original).abs().max().item()
        row["mean_abs_error"]["torchao"] = (back - original).abs().mean().item()
        row["codes"] = compare_codes(weight, ours.packed, theirs.quantized_data.view(-1))
        row["ratio_dequantize_throughput_ours_over_torchao"] = d_times["torchao"] / d_times["ours"]
        row["ratio_quantize_speed_ours_over_torchao"] = q_times["torchao"] / q_times["ours"]
    row["storage_bytes_ours"] = ours.storage_bytes()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/nf4_<device>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    ao_to_nf4, ao_status = load_torchao()
    print(f"torch {torch.__version__}, {ao_status}, device {device}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} (other processes slow both sides alike)")
    if ao_to_nf4 is None:
        print("NOTE: torchao could not be imported; reporting fsdp_lab only (no ratio).")
    result = {
        "benchmark": "nf4", "device": str(device), "torch": torch.__version__, "torchao": ao_status,
        "threads": torch.get_num_threads(), "machine": platform.machine(),
        "load_average_1min": os.getloadavg()[0], "runs": [],
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        result["copy_bandwidth_GBps"] = copy_bandwidth(device, args.rows * args.cols * 2, args.repeats) / 1e9
    shape = (args.rows, args.cols)
    for dtype in (torch.bfloat16, torch.float32):
        row = run(device, dtype, shape, args.repeats, ao_to_nf4)
        result["runs"].append(row)
        gbps, q = row["dequantize_GBps"], row["quantize_s"]
        line = (f"{row['dtype']:>8} {shape}: dequantize ours {gbps['ours']:.2f} GB/s"
                f" | quantize ours {q['ours'] * 1e3:.0f} ms")
        if "torchao" in gbps:
            line += (f" | torchao {gbps['torchao']:.2f} GB/s, {q['torchao'] * 1e3:.0f} ms"
                     f" | ratio ours/torchao: dequantize {row['ratio_dequantize_throughput_ours_over_torchao']:.2f}x,"
                     f" quantize {row['ratio_quantize_speed_ours_over_torchao']:.2f}x")
        if "ours_compiled" in gbps:
            frac = gbps["ours_compiled"] / result["copy_bandwidth_GBps"]
            line += f" | compiled {gbps['ours_compiled']:.1f} GB/s = {frac:.0%} of copy bandwidth"
        print(line)
        errs = row["mean_abs_error"]
        print(f"{'':>8} mean |w - dequant(w)|: " + ", ".join(f"{k} {v:.5f}" for k, v in errs.items()))
        if "codes" in row:
            c = row["codes"]
            print(f"{'':>8} codes differ for {c['different']} of {c['values']} values; nearer to the value "
                  f"(float64): ours {c['ours_nearer']}, torchao {c['torchao_nearer']}")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"nf4_{device.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
