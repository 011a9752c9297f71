"""Launch and collective overheads of fsdp_lab against bare PyTorch, side by side.

Run from the repository root:

    python benchmarks/launch_and_collectives.py
    python benchmarks/launch_and_collectives.py --repeats 7 --iters 800 --world-size 2

(a) Launch-to-return wall time of ``fsdp_lab.launch`` running a no-op against a bare
    ``torch.multiprocessing.spawn`` of the same no-op with the same world size and the same
    gloo rendezvous (a TCPStore opened by the parent); median of ``--repeats``, the two
    alternating. Target: ratio <= 1.5.
(b) All-gather of 4 MiB per rank through ``fsdp_lab.collectives.all_gather_into_tensor``
    with a ``fsdp_lab.timeline.Timeline`` recording, against raw
    ``torch.distributed.all_gather_into_tensor`` (named ``all_gather_single`` from torch
    2.13); the two alternate call by call inside one launch, each call timed after a
    barrier; median per call, slowest rank. Target: overhead <= 5%. On a busy machine both numbers
    move by several percent between runs: read the load average stored in the JSON.

Writes benchmarks/results/launch_and_collectives_cpu.json (``_cuda.json`` on GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_lab import collectives  # noqa: E402
from fsdp_lab.dist import current_device  # noqa: E402
from fsdp_lab.launch import launch  # noqa: E402
from fsdp_lab.timeline import Timeline  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _noop():
    return None


def _spawn_noop(rank, port, world_size):
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    dist.barrier()  # without it a rank may exit while its peer is still connecting
    dist.destroy_process_group()


def _time_spawn(world_size: int) -> float:
    start = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    torch.multiprocessing.spawn(_spawn_noop, args=(store.port, world_size), nprocs=world_size)
    del store
    return time.perf_counter() - start


def _time_launch(world_size: int) -> float:
    start = time.perf_counter()
    launch(_noop, world_size=world_size, backend="gloo", timeout=300)
    return time.perf_counter() - start


def _all_gather_times(nbytes_per_rank: int, iters: int) -> dict:
    """Per-call seconds of raw and instrumented all-gathers on this rank."""
    device = current_device()
    world_size = dist.get_world_size()
    shard = torch.randn(nbytes_per_rank // 4, device=device)
    full = torch.empty(shard.numel() * world_size, device=device)

    def timed(call) -> float:
        return collectives.timed_on_all_ranks(call, device)[0]

    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (same collective).
    native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def raw():
        native(full, shard)

    def ours():
        collectives.all_gather_into_tensor(full, shard)

    for _ in range(3):  # warm up both paths
        timed(raw)
        timed(ours)
    times = {"raw": [], "ours": []}
    # One call of each in turn (order alternating) so load changes hit both alike. Raw calls
    # bypass fsdp_lab.collectives, so the timeline records only ours.
    with Timeline() as timeline:
        for i in range(iters):
            for name in ("raw", "ours") if i % 2 == 0 else ("ours", "raw"):
                times[name].append(timed(raw if name == "raw" else ours))
    assert torch.equal(full.view(world_size, -1)[dist.get_rank()], shard)
    return {**times, "events": len(timeline.comm_events())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    n = args.world_size

    ours_s, spawn_s = [], []
    for i in range(args.repeats):  # alternate which goes first so drift hits both alike
        pair = (_time_launch, _time_spawn) if i % 2 == 0 else (_time_spawn, _time_launch)
        for fn in pair:
            (ours_s if fn is _time_launch else spawn_s).append(fn(n))
    launch_ratio = statistics.median(ours_s) / statistics.median(spawn_s)

    nbytes = 4 * 2**20
    per_rank = launch(_all_gather_times, nbytes, args.iters, world_size=n, timeout=600)
    raw_s = max(statistics.median(r["raw"]) for r in per_rank)
    inst_s = max(statistics.median(r["ours"]) for r in per_rank)
    overhead = inst_s / raw_s - 1
    # Drift-robust second view: each instrumented call against the raw call next to it.
    paired = max(statistics.median([o / r for o, r in zip(rank["ours"], rank["raw"])])
                 for rank in per_rank) - 1
    device = "cuda" if torch.cuda.is_available() else "cpu"

    print(f"(a) launch-to-return, {n} ranks, no-op, median of {args.repeats}")
    print(f"    {'fsdp_lab.launch':<38}{statistics.median(ours_s):8.2f} s")
    print(f"    {'torch.multiprocessing.spawn':<38}{statistics.median(spawn_s):8.2f} s")
    print(f"    {'ratio':<38}{launch_ratio:8.2f}   (target <= 1.5)")
    print(f"(b) all_gather_into_tensor, 4 MiB per rank, {n} ranks, {device}, "
          f"median of {len(per_rank[0]['raw'])} calls, slowest rank")
    print(f"    {'fsdp_lab.collectives + Timeline':<38}{inst_s * 1e3:8.3f} ms"
          f"   ({per_rank[0]['events']} events recorded on rank 0)")
    print(f"    {'torch.distributed':<38}{raw_s * 1e3:8.3f} ms")
    print(f"    {'overhead':<38}{overhead * 100:+7.1f} %   (target <= 5 %)")
    print(f"    {'overhead, median of adjacent pairs':<38}{paired * 100:+7.1f} %")

    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"launch_and_collectives_{device}.json"
    out.write_text(json.dumps({
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0], "device": device,
        "world_size": n,
        "launch": {"fsdp_lab_s": ours_s, "spawn_s": spawn_s, "ratio_of_medians": launch_ratio,
                   "target_ratio": 1.5},
        "all_gather": {"bytes_per_rank": nbytes, "calls": len(per_rank[0]["raw"]),
                       "raw_median_s": raw_s, "instrumented_median_s": inst_s,
                       "overhead": overhead, "overhead_paired_median": paired,
                       "target_overhead": 0.05},
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
