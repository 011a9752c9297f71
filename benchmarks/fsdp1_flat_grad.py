"""FSDP1 fp32 gradient accumulation: one flat buffer ("flat") vs per-parameter copies + cat ("concat").

    python benchmarks/fsdp1_flat_grad.py          # CPU, 2 ranks
    python benchmarks/fsdp1_flat_grad.py --world-size 4

Same model (the "cpu" Llama, one FSDP1 unit so gradient buffers dominate), bf16 compute,
fp32 reduce, FULL_SHARD, same data. Per mode and rank 0: losses of 3 steps (must be
identical), the peak of FSDP's gradient buffers (tagged full-size gradients, reduce-scatter
inputs and reduced shards, sampled after every op), the tracker's whole-step peak, and on
CUDA ``torch.cuda.max_memory_reserved``. Each mode runs in its own launch (fresh processes). Writes benchmarks/results/fsdp1_flat_grad_<cpu|cuda>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib

import torch

RESULTS = pathlib.Path(__file__).parent / "results"


def _measure(mode: str, steps: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from fsdp_lab.dist import current_device
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, MixedPrecision
    from fsdp_lab.memory.buffer_peak import GradBufferPeak
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama

    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(Llama("cpu", seed=0), mixed_precision=policy, grad_accumulation=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks, tracker_peaks = [], [], []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps):
        data = shard_batch(global_batch(512, batch, seq, step=step), rank, world).to(device)
        with MemoryTracker(model, opt) as mt, GradBufferPeak() as gp:
            loss = model(data).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        peaks.append(gp.peak)
        tracker_peaks.append(mt.peak_total())
        del mt
    out = {"losses": losses, "grad_buffer_peak_bytes": max(peaks), "tracker_peak_bytes": max(tracker_peaks)}
    if device.type == "cuda":
        out["cuda_max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    del model, opt
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()

    from fsdp_lab import launch

    # each mode in fresh processes, so nothing of one run is alive in the other's measurement
    result = {mode: launch(_measure, mode, args.steps, args.batch, args.seq, world_size=args.world_size,
                           timeout=600)[0] for mode in ("concat", "flat")}
    flat, concat = result["flat"], result["concat"]
    summary = {
        "world_size": args.world_size, "model": "Llama cpu, one FSDP1 unit, bf16 params, fp32 reduce",
        "identical_losses": flat["losses"] == concat["losses"],
        "grad_buffer_peak_ratio_flat_over_concat": flat["grad_buffer_peak_bytes"] / concat["grad_buffer_peak_bytes"],
        "tracker_peak_ratio_flat_over_concat": flat["tracker_peak_bytes"] / concat["tracker_peak_bytes"],
        "note": "the flat gradient is reduced in place (no receive buffer on gloo either), so the "
                "gradient-buffer saving shows in the whole-step peak",
        "flat": flat, "concat": concat,
    }
    if "cuda_max_memory_reserved_bytes" in flat:
        summary["cuda_reserved_ratio_flat_over_concat"] = (flat["cuda_max_memory_reserved_bytes"]
                                                           / concat["cuda_max_memory_reserved_bytes"])
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    summary["device"] = kind
    if kind == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fsdp1_flat_grad_{kind}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"identical losses: {summary['identical_losses']}")
    for mode in ("concat", "flat"):
        r = result[mode]
        print(f"{mode:>6}: grad buffers peak {r['grad_buffer_peak_bytes'] / 2**20:.2f} MiB, "
              f"tracker peak {r['tracker_peak_bytes'] / 2**20:.2f} MiB")
    print(f"flat / concat: grad buffers {summary['grad_buffer_peak_ratio_flat_over_concat']:.3f}, "
          f"whole step {summary['tracker_peak_ratio_flat_over_concat']:.3f}  -> {path}")


if __name__ == "__main__":
    main()
