"""AutoMicrobatch once settled vs a fixed microbatch of the same size set by hand, side by side.

    python benchmarks/automicrobatch.py           # CPU, 2 ranks, gloo
    PYTHONPATH=. python benchmarks/automicrobatch.py --world-size 1              # on one GPU

Both train the same FSDP2-sharded Llama (AdamW) in the same processes. AutoMicrobatch starts at
the whole batch under an emulated memory budget (``fsdp_lab.oom.memory_budget``, set between the
measured peaks of microbatch 8 and 4) on the last rank, runs out of memory, agrees with the
other ranks and settles on 4; after 3 clean steps its sync hooks are gone. Then timed steps
alternate between it and a hand-written loop with a fixed microbatch of 4 (no budget tracker in
either: the budget only drives the search). Reported: median step time of the slowest rank and
throughput (samples/s over all ranks). Target: throughput auto/fixed >= 0.95.
Writes ``benchmarks/results/automicrobatch_<cpu|cuda>.json`` (a GPU's name under ``gpu``).
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


def _bench_rank(batch_size: int, seq_len: int, steps: int) -> dict:
    import torch.distributed as dist

    from fsdp_lab.automicrobatch import AutoMicrobatch, split_batch
    from fsdp_lab.dist import current_device
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.oom import memory_budget

    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device()
    config = LlamaConfig.from_name("cpu", n_layers=2)

    def setup():
        model = Llama(config, seed=0).to(device)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(step):
        b = shard_batch(global_batch(config.vocab_size, batch_size * world, seq_len, step=step), rank, world)
        return type(b)(b.input_ids.to(device), b.labels.to(device))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    peaks = {}
    for size in (batch_size, batch_size // 2):  # calibrate the budget from measured peaks
        model, opt = setup()
        amb = AutoMicrobatch(model, opt, batch_size, start=size)
        amb.train_step(batch(0))
        amb.close()
        with memory_budget(None, model=model, optimizer=opt) as tracker:
            amb.train_step(batch(1))
        peaks[size] = tracker.peak_total()
    budget = (peaks[batch_size] + peaks[batch_size // 2]) // 2

    auto_model, auto_opt = setup()
    amb = AutoMicrobatch(auto_model, auto_opt, batch_size)
    with memory_budget(budget, rank=world - 1, model=auto_model, optimizer=auto_opt):
        for step in range(4):  # OOM at the whole batch, then 3 clean steps: hooks dropped
            amb.train_step(batch(step))
    size = amb.microbatch_size
    fixed_model, fixed_opt = setup()

    def fixed_step(b):
        for begin in range(0, batch_size, size):
            (fixed_model(split_batch(b, begin, begin + size)).loss * (size / batch_size)).backward()
        fixed_opt.step()
        fixed_opt.zero_grad(set_to_none=True)

    fixed_step(batch(0))  # warm-up
    times = {"auto": [], "fixed": []}
    for step in range(steps):
        b = batch(step)
        for name in ("auto", "fixed") if step % 2 == 0 else ("fixed", "auto"):
            sync()
            start = time.perf_counter()
            amb.train_step(b) if name == "auto" else fixed_step(b)
            sync()
            times[name].append(time.perf_counter() - start)
    hooks = amb.hooks_installed
    amb.close()
    return {"times": times, "microbatch": size, "hooks_after_settling": hooks, "budget": budget, "peaks": peaks,
            "events": [h["event"] for h in amb.history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    ranks = fsdp_lab.launch(_bench_rank, args.batch_size, args.seq_len, args.steps, world_size=args.world_size,
                            timeout=600)
    median = {name: statistics.median(max(r["times"][name][i] for r in ranks) for i in range(args.steps))
              for name in ("auto", "fixed")}
    samples = args.batch_size * args.world_size
    throughput = {name: samples / median[name] for name in median}
    ratio = throughput["auto"] / throughput["fixed"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"device": device, "world_size": args.world_size, "batch_size_per_rank": args.batch_size,
              "seq_len": args.seq_len, "steps": args.steps, "microbatch": ranks[0]["microbatch"],
              "budget_bytes": ranks[0]["budget"], "peaks_bytes": ranks[0]["peaks"],
              "hooks_after_settling": ranks[0]["hooks_after_settling"], "events": ranks[-1]["events"],
              "median_step_s": median, "samples_per_s": throughput, "throughput_ratio_auto_over_fixed": ratio,
              "target": ">= 0.95"}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"automicrobatch_{device}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"settled microbatch {result['microbatch']} (events on rank {args.world_size - 1}: {result['events']})")
    print(f"{'':8}{'step s':>10}{'samples/s':>12}")
    for name in ("auto", "fixed"):
        print(f"{name:8}{median[name]:10.4f}{throughput[name]:12.1f}")
    print(f"throughput auto/fixed = {ratio:.3f} (target >= 0.95) -> {path}")


if __name__ == "__main__":
    main()
