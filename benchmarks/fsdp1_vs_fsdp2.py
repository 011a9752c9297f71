"""Our FSDP1 (FULL_SHARD) vs our FSDP2 (and PyTorch's FSDP1 on GPU) on the same model.

    python benchmarks/fsdp1_vs_fsdp2.py                 # CPU, 2 ranks
    python benchmarks/fsdp1_vs_fsdp2.py --world-size 4 --steps 8

Each transformer block is a unit and the root holds the rest, in every implementation. Per
implementation, on the same ranks and data: step time (median of the timed steps, slowest
rank), peak memory (the tracker's whole-step peak on rank 0; on CUDA also
``torch.cuda.max_memory_allocated``), and collectives per step (count and bytes, from the
timeline). Target on CPU: our FSDP1 step time <= 1.10x our FSDP2. On GPU: our FSDP1 peak
<= PyTorch FSDP1's. Writes benchmarks/results/fsdp1_vs_fsdp2_<cpu|cuda>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics

import torch

RESULTS = pathlib.Path(__file__).parent / "results"


def _wrap(kind: str, model):
    from fsdp_lab.models.llama import TransformerBlock

    if kind == "ours_fsdp1":
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    if kind == "ours_fsdp2":
        from fsdp_lab.fsdp2 import fully_shard
        for block in model.layers:
            fully_shard(block)
        return fully_shard(model)
    if kind == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                        device_id=torch.cuda.current_device(), use_orig_params=True)
    raise ValueError(kind)


def _run(kinds: list[str], steps: int, warmup: int, batch: int, seq: int) -> dict:
    import torch.distributed as dist

    from fsdp_lab.bandwidth import timed_on_all_ranks
    from fsdp_lab.dist import current_device
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama
    from fsdp_lab.timeline import Timeline

    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    out = {}
    for kind in kinds:
        model = _wrap(kind, Llama("cpu", seed=0).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i):
            data = shard_batch(global_batch(512, batch, seq, step=i), rank, world).to(device)
            loss = model(data).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        times = []
        for i in range(warmup + steps):
            seconds, loss = timed_on_all_ranks(lambda: step(i), device)
            if i >= warmup:
                times.append(seconds)
        with Timeline() as tl:
            step(warmup + steps)
        comms = tl.comm_events()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with MemoryTracker(model, opt) as mt:
            step(warmup + steps + 1)
        row = {"step_time_s": statistics.median(times), "last_loss": loss.item(),
               "tracker_peak_bytes": mt.peak_total(),
               "collectives_per_step": len(comms), "collective_bytes_per_step": sum(e.bytes for e in comms),
               "by_collective": {n: sum(1 for e in comms if e.name == n) for n in sorted({e.name for e in comms})}}
        if device.type == "cuda":
            row["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out[kind] = row
        del model, opt, mt, tl
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    from fsdp_lab import launch

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size
    kinds = ["ours_fsdp1", "ours_fsdp2"] + (["torch_fsdp1"] if gpu else [])
    per_rank = launch(_run, kinds, args.steps, args.warmup, args.batch, args.seq,
                      world_size=args.world_size, timeout=600)
    rows = per_rank[0]
    for kind in kinds:  # step time of the slowest rank
        rows[kind]["step_time_s"] = max(r[kind]["step_time_s"] for r in per_rank)
    ratio = rows["ours_fsdp1"]["step_time_s"] / rows["ours_fsdp2"]["step_time_s"]
    summary = {"world_size": args.world_size, "model": "Llama cpu, one unit per block + root",
               "global_batch": args.batch, "seq_len": args.seq, "device": "cuda" if gpu else "cpu",
               "step_time_ratio_ours_fsdp1_over_ours_fsdp2": ratio,
               "target_cpu_step_time_ratio_max": 1.10, "rows": rows}
    if "torch_fsdp1" in rows:
        summary["peak_ratio_ours_fsdp1_over_torch_fsdp1"] = (rows["ours_fsdp1"]["cuda_max_memory_allocated_bytes"]
                                                             / rows["torch_fsdp1"]["cuda_max_memory_allocated_bytes"])
    if gpu:
        summary["gpu"] = torch.cuda.get_device_name(0)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fsdp1_vs_fsdp2_{'cuda' if gpu else 'cpu'}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(f"{'implementation':<12} {'step ms':>8} {'peak MiB':>9} {'colls':>6} {'coll MiB':>9}")
    for kind, r in rows.items():
        print(f"{kind:<12} {r['step_time_s'] * 1e3:8.1f} {r['tracker_peak_bytes'] / 2**20:9.2f} "
              f"{r['collectives_per_step']:6d} {r['collective_bytes_per_step'] / 2**20:9.2f}")
    print(f"step time ours FSDP1 / ours FSDP2 = {ratio:.3f} (target <= 1.10 on CPU) -> {path}")


if __name__ == "__main__":
    main()
