"""MemoryTracker overhead: one training step of the CPU Llama with and without the tracker.

    python benchmarks/memory_tracker.py
    PYTHONPATH=. python benchmarks/memory_tracker.py --batch-size 8 --seq-len 128 --steps 10

Steps alternate (plain, tracked, plain, tracked ...) in one process so both see the same
machine load; the median step time of each is reported with their ratio (target <= 1.5).
On a GPU the model runs there and steps are synchronised before timing.
It also sets the tracked step beside ``estimate`` (and, on CUDA, beside the allocator's
``torch.cuda.max_memory_allocated``): peak bytes by category, estimated vs measured.
Writes ``benchmarks/results/memory_tracker_<device>.json`` (cpu, or the GPU's name).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from fsdp_lab.dist import current_device
from fsdp_lab.memory.estimate import estimate
from fsdp_lab.memory.tracker import MemoryTracker
from fsdp_lab.models.data import global_batch
from fsdp_lab.models.llama import Llama

RESULTS = pathlib.Path(__file__).parent / "results"


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    device = current_device()
    model = Llama(args.config, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = global_batch(model.config.vocab_size, args.batch_size, args.seq_len).to(device)

    def step():
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    last = {}

    def timed(tracked: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if tracked:
            with MemoryTracker(model, optimizer) as tracker:
                step()
            last["result"] = tracker.result()
        else:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(2):  # warm up both paths
        timed(False)
        timed(True)
    plain, tracked = [], []
    for _ in range(args.steps):
        plain.append(timed(False))
        tracked.append(timed(True))
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "config": args.config, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
        "plain_step_s": statistics.median(plain), "tracked_step_s": statistics.median(tracked),
    }
    result["ratio"] = result["tracked_step_s"] / result["plain_step_s"]
    print(f"{'':<10}{'step (ms)':>12}")
    print(f"{'plain':<10}{1e3 * result['plain_step_s']:>12.2f}")
    print(f"{'tracked':<10}{1e3 * result['tracked_step_s']:>12.2f}")
    print(f"ratio tracked/plain: {result['ratio']:.2f}  (target <= 1.5)")
    measured = last["result"]
    est = estimate(model.config, world_size=1, strategy="ddp", param_dtype=torch.float32,
                   batch_size=args.batch_size, seq_len=args.seq_len, foreach=device.type == "cuda")
    print(f"\n{'peak (bytes)':<18}{'estimate':>14}{'tracked':>14}")
    for cat, value in est.bytes.items():
        if value or measured.peak[cat]:
            print(f"{cat:<18}{value:>14,}{measured.peak[cat]:>14,}")
    print(f"{'total':<18}{est.total:>14,}{measured.peak_total:>14,}   tracked/estimate "
          f"{measured.peak_total / est.total:.3f}")
    if measured.cuda:
        print(f"{'cuda max_allocated':<18}{'':>14}{measured.cuda['max_allocated']:>14,}   allocator/estimate "
              f"{measured.cuda['max_allocated'] / est.total:.3f}")
    result.update(estimate_peak=est.bytes, estimate_total=est.total, tracked_peak=measured.peak,
                  tracked_total=measured.peak_total, cuda=measured.cuda)
    RESULTS.mkdir(exist_ok=True)
    name = "cpu" if device.type == "cpu" else result["device"].replace(" ", "_").lower()
    (RESULTS / f"memory_tracker_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
