"""fsdp_lab's FSDP2 vs PyTorch's ``torch.distributed.fsdp.fully_shard``, side by side.

    python benchmarks/fsdp2_vs_torch.py            # CPU, 2 ranks, gloo
    PYTHONPATH=. python benchmarks/fsdp2_vs_torch.py --world-size 1 --config cpu  # on a GPU: CUDA, world 1

Both implementations train the same Llama (every block and the root sharded, AdamW) in the
same processes; steps alternate between them so both see the same machine load. Reported
per implementation: median step time (seconds, slowest rank) and the peak of memory tracked
by ``fsdp_lab.memory.tracker.MemoryTracker`` (bytes of live tensor storages on rank 0, one
step, every category: parameters, gradients, optimizer state, activations, buffers).
Targets: time ours/torch <= 1.10, peak memory ours/torch <= 1.00.
Writes ``benchmarks/results/fsdp2_vs_torch_<cpu|cuda>.json`` (a GPU's name under ``gpu``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

import fsdp_lab

RESULTS = pathlib.Path(__file__).parent / "results"


def _bench_rank(config: str, batch_size: int, seq_len: int, warmup: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_lab.dist import current_device
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    cfg = LlamaConfig.from_name(config)

    def build(shard):
        with torch.device(device):
            model = Llama(cfg, seed=0)
        for layer in model.layers:
            shard(layer)
        shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    runs = {"ours": build(fully_shard), "torch": build(torch_fully_shard)}

    def step(name, i):
        model, opt = runs[name]
        batch = shard_batch(global_batch(cfg.vocab_size, batch_size * world, seq_len, step=i), rank, world).to(device)
        model(batch.input_ids, batch.labels).loss.backward()
        opt.step()
        opt.zero_grad()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for i in range(warmup):
        for name in runs:
            step(name, i)
    times = {name: [] for name in runs}
    for i in range(steps):
        for name in (("ours", "torch") if i % 2 == 0 else ("torch", "ours")):
            sync()
            t0 = time.perf_counter()
            step(name, warmup + i)
            sync()
            times[name].append(time.perf_counter() - t0)
    peaks = {}
    for name, (model, opt) in runs.items():
        with MemoryTracker(model, opt) as tracker:
            step(name, warmup + steps)
        peaks[name] = {"total": tracker.peak_total(), "by_category": tracker.peak()}
    return {"times": times, "peaks": peaks, "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    per_rank = fsdp_lab.launch(_bench_rank, args.config, args.batch_size, args.seq_len, args.warmup, args.steps,
                               world_size=args.world_size, timeout=1200)
    result = {"config": args.config, "world_size": args.world_size, "batch_size_per_rank": args.batch_size,
              "seq_len": args.seq_len, "steps": args.steps, "torch": torch.__version__,
              "device": per_rank[0]["device"], "memory_measure": "fsdp_lab MemoryTracker peak, rank 0"}
    for name in ("ours", "torch"):
        # a step takes as long as its slowest rank
        step_times = [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
        result[name] = {"step_time_s": statistics.median(step_times),
                        "peak_bytes": per_rank[0]["peaks"][name]["total"],
                        "peak_by_category": per_rank[0]["peaks"][name]["by_category"]}
    result["time_ratio"] = result["ours"]["step_time_s"] / result["torch"]["step_time_s"]
    result["memory_ratio"] = result["ours"]["peak_bytes"] / result["torch"]["peak_bytes"]
    result["targets"] = {"time_ratio_max": 1.10, "memory_ratio_max": 1.00}

    print(f"{'':8}{'step time (ms)':>16}{'peak tracked (MiB)':>20}")
    for name in ("ours", "torch"):
        print(f"{name:8}{1e3 * result[name]['step_time_s']:16.1f}{result[name]['peak_bytes'] / 2**20:20.2f}")
    print(f"time ratio ours/torch:   {result['time_ratio']:.3f}  (target <= 1.10)")
    print(f"memory ratio ours/torch: {result['memory_ratio']:.3f}  (target <= 1.00)")

    tag = "cpu" if result["device"] == "cpu" else "cuda"
    if tag == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"fsdp2_vs_torch_{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
