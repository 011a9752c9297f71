"""Launch and collective overheads of fsdp_lab against bare PyTorch, side by side.

Run from the repository root:

    python benchmarks/launch_and_collectives.py
    python benchmarks/launch_and_collectives.py --rounds 10 --pairs 100 --world-size 2

(a) Launch-to-return wall time of ``fsdp_lab.launch`` running a no-op against a bare
    ``torch.multiprocessing.spawn`` of the same no-op with the same world size and the same
    gloo rendezvous (a TCPStore opened by the parent); median of ``--repeats``, the two
    alternating. Target: ratio <= 1.5. On Linux fsdp_lab forks CPU ranks from a fork server
    that the first launch of a process starts (importing torch once); that first launch is
    timed apart (``first_launch_s``) and the repeats are the launches after it.
(b) All-gather of 4 MiB per rank through ``fsdp_lab.collectives.all_gather_into_tensor``
    with a ``fsdp_lab.timeline.Timeline`` recording (the instrumented path) against bare
    ``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before torch 2.13),
    inside one launch. Calls come in adjacent pairs, one of each, in alternating order
    (bare-ours, ours-bare, ...), each call started after a barrier; a call's time is the
    slowest rank's. The ratio of each pair (ours / bare) sees the same machine load, so
    load that drifts or comes in bursts cancels; the headline is the median pair ratio over
    ``--rounds`` x ``--pairs`` pairs, with its spread (quartiles, a bootstrap 95% interval of
    the median, and each round's median). Target: ratio <= 1.05.
    Two more calls beside each pair say where the difference comes from: ours with no Timeline
    recording (``untimed_ratio_median``: the wrapper's own bookkeeping) and the bare call between
    the two clock marks a Timeline takes around a collective, recorded as ours records it
    (``marks_ratio_median``: on CUDA, two CUDA events; on CPU, two ``perf_counter`` reads). Each
    is timed against its own bare call, adjacent and in alternating order, as the pairs are.
(c) The host time of one call, in this process, on torch's "fake" backend at a world of 1 (its
    all-gather is a copy; of 16 floats here, so what is left is the Python and C++ around the
    collective, not the data): bare ``torch.distributed``, ours with nothing recording, and ours
    inside a CPU ``Timeline``, each a loop of ``--calls`` calls, the three in turn for
    ``--host-rounds`` rounds (the order rotating), median per kind. This is the part of a launch-bound GPU call (NCCL at a world of 1, where
    the copy takes 2 to 3 us) that the wrapper adds to, measured without a GPU; the ratios are
    against a collective that does nothing, the most the wrapper can cost relative to any.

Writes benchmarks/results/launch_and_collectives_cpu.json (``_cuda.json`` on GPUs) with the
device (and the GPU's name), torch version, date and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_lab import bandwidth, collectives  # noqa: E402
from fsdp_lab.dist import current_device, simulated_world  # noqa: E402
from fsdp_lab.launch import launch  # noqa: E402
from fsdp_lab.timeline import Timeline  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ALL_GATHER_BYTES = 4 * 2**20  # per rank
HOST_COST_FLOATS = 16  # (c): small enough that the fake backend's copy costs nothing
# torch.distributed's own all-gather: all_gather_single from torch 2.13, all_gather_into_tensor before
BARE_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _all_gather_pairs(nbytes_per_rank: int, rounds: int, pairs: int) -> dict:
    """Seconds of each bare and instrumented all-gather on this rank, in call order, plus the
    number of events the timeline recorded."""
    device = current_device()
    world_size = dist.get_world_size()
    shard = torch.randn(nbytes_per_rank // 4, device=device)
    full = torch.empty(shard.numel() * world_size, device=device)

    def bare():
        BARE_ALL_GATHER(full, shard)

    def ours():
        collectives.all_gather_into_tensor(full, shard)

    timeline = Timeline()

    def bare_marked():  # a Timeline's cost alone: its marks around a collective it does not issue
        start = timeline.mark()
        bare()
        timeline.record_comm(start, "BARE_ALL_GATHER", full.numel() * 4, dtype="float32", group_size=world_size)

    def timed(call) -> float:
        return bandwidth.timed_on_all_ranks(call, device)[0]

    def timed_untimed() -> float:  # ours with the Timeline set aside: nothing records the call
        collectives.remove_recorder(timeline)
        try:
            return timed(ours)
        finally:
            collectives.add_recorder(timeline)

    calls = {"ours": lambda: timed(ours), "ours_untimed": timed_untimed, "bare_marked": lambda: timed(bare_marked)}
    times = {"bare": [], **{kind: [] for kind in calls}, "bare_for_untimed": [], "bare_for_marks": []}
    bare_key = {"ours": "bare", "ours_untimed": "bare_for_untimed", "bare_marked": "bare_for_marks"}
    with timeline:  # records only ours and the marked bare calls: bare calls bypass fsdp_lab.collectives
        for _ in range(5):  # warm up every path (ours unrecorded: the events counted are the timed calls')
            timed(bare)
            timed_untimed()
            timed(bare_marked)
        for i in range(rounds * pairs):
            for kind, call in calls.items():
                if i % 2 == 0:
                    times[bare_key[kind]].append(timed(bare))
                    times[kind].append(call())
                else:
                    times[kind].append(call())
                    times[bare_key[kind]].append(timed(bare))
    assert torch.equal(full.view(world_size, -1)[dist.get_rank()], shard)
    return {**times, "events": len(timeline.comm_events(name="all_gather"))}


def host_cost_per_call(calls: int, rounds: int) -> dict:
    """(c): microseconds of host time per all-gather call on the "fake" backend, by kind."""
    shard = torch.randn(HOST_COST_FLOATS)
    full = torch.empty_like(shard)
    timeline = Timeline(rank=0, device="cpu")

    def loop(call) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            call(full, shard)
        return (time.perf_counter() - start) / calls * 1e6

    def recorded(call) -> float:
        with timeline:
            return loop(call)

    kinds = {"bare": lambda: loop(BARE_ALL_GATHER),
             "ours_untimed": lambda: loop(collectives.all_gather_into_tensor),
             "ours": lambda: recorded(collectives.all_gather_into_tensor)}
    per_call = {kind: [] for kind in kinds}
    with simulated_world(world_size=1):
        for kind in kinds.values():  # warm up
            kind()
        for r in range(rounds):
            order = list(kinds)[r % 3:] + list(kinds)[:r % 3]
            for kind in order:
                per_call[kind].append(kinds[kind]())
    median = {kind: statistics.median(values) for kind, values in per_call.items()}
    return {
        "backend": "fake", "floats": HOST_COST_FLOATS, "calls_per_round": calls, "rounds": rounds,
        "bare_us": median["bare"], "ours_untimed_us": median["ours_untimed"], "ours_us": median["ours"],
        "untimed_ratio": median["ours_untimed"] / median["bare"], "ratio": median["ours"] / median["bare"],
        "events_recorded": len(timeline.comm_events(name="all_gather")),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _bootstrap_median_interval(values: list[float], samples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (fixed seed: reproducible)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(samples))
    return medians[int(0.025 * samples)], medians[int(0.975 * samples) - 1]


def _slowest(per_rank: list[dict], kind: str) -> list[float]:
    """Each call of ``kind``: the slowest rank's seconds."""
    return [max(times) for times in zip(*(r[kind] for r in per_rank))]


def _pair_ratios(per_rank: list[dict], kind: str, bare_kind: str) -> list[float]:
    """Each call of ``kind`` over its adjacent bare call, each the slowest rank's time."""
    return [o / b for o, b in zip(_slowest(per_rank, kind), _slowest(per_rank, bare_kind))]


def all_gather_overhead(per_rank: list[dict], rounds: int, pairs: int) -> dict:
    """Pair ratios (ours / bare, slowest rank per call) and their summary."""
    bare, ours = _slowest(per_rank, "bare"), _slowest(per_rank, "ours")
    ratios = _pair_ratios(per_rank, "ours", "bare")
    round_medians = [statistics.median(ratios[k * pairs:(k + 1) * pairs]) for k in range(rounds)]
    low, high = _bootstrap_median_interval(ratios)
    return {
        "bytes_per_rank": ALL_GATHER_BYTES, "rounds": rounds, "pairs_per_round": pairs,
        "bare_median_s": statistics.median(bare), "instrumented_median_s": statistics.median(ours),
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [_quantile(ratios, 0.25), _quantile(ratios, 0.75)],
        "ratio_median_ci95": [low, high],
        "ratio_of_medians": statistics.median(ours) / statistics.median(bare),
        "round_median_ratios": round_medians,
        "events_recorded_rank0": per_rank[0]["events"],
        "target_ratio": 1.05,
        # where the difference comes from (each against its own adjacent bare calls)
        "untimed_ratio_median": statistics.median(_pair_ratios(per_rank, "ours_untimed", "bare_for_untimed")),
        "marks_ratio_median": statistics.median(_pair_ratios(per_rank, "bare_marked", "bare_for_marks")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="launch timings of each kind")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of all-gather pairs")
    parser.add_argument("--pairs", type=int, default=100, help="all-gather pairs per round")
    parser.add_argument("--calls", type=int, default=2000, help="calls per loop of the host-time part (c)")
    parser.add_argument("--host-rounds", type=int, default=15, help="rounds of the host-time part (c)")
    args = parser.parse_args()
    n = args.world_size
    load_before = os.getloadavg()[0]

    first_launch_s = _time_launch(n)
    ours_s, spawn_s = [], []
    for i in range(args.repeats):  # alternate which goes first so drift hits both alike
        pair = (_time_launch, _time_spawn) if i % 2 == 0 else (_time_spawn, _time_launch)
        for fn in pair:
            (ours_s if fn is _time_launch else spawn_s).append(fn(n))
    launch_ratio = statistics.median(ours_s) / statistics.median(spawn_s)

    per_rank = launch(_all_gather_pairs, ALL_GATHER_BYTES, args.rounds, args.pairs, world_size=n,
                      timeout=1800)
    ag = all_gather_overhead(per_rank, args.rounds, args.pairs)
    host = host_cost_per_call(args.calls, args.host_rounds)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    print(f"(a) launch-to-return, {n} ranks, no-op, median of {args.repeats}")
    print(f"    {'fsdp_lab.launch, first in the process':<38}{first_launch_s:8.2f} s")
    print(f"    {'fsdp_lab.launch':<38}{statistics.median(ours_s):8.2f} s")
    print(f"    {'torch.multiprocessing.spawn':<38}{statistics.median(spawn_s):8.2f} s")
    print(f"    {'ratio':<38}{launch_ratio:8.2f}   (target <= 1.5)")
    print(f"(b) all-gather, 4 MiB per rank, {n} ranks, {device}, {args.rounds} x {args.pairs} "
          "adjacent pairs, slowest rank per call")
    print(f"    {'fsdp_lab.collectives + Timeline':<38}{ag['instrumented_median_s'] * 1e3:8.3f} ms (median)"
          f"   ({ag['events_recorded_rank0']} events recorded on rank 0)")
    print(f"    {'torch.distributed':<38}{ag['bare_median_s'] * 1e3:8.3f} ms (median)")
    q1, q3 = ag["ratio_quartiles"]
    lo, hi = ag["ratio_median_ci95"]
    print(f"    {'ratio, median of pairs':<38}{ag['ratio_median']:8.4f}   (target <= 1.05)")
    print(f"    {'  quartiles':<38}{q1:8.4f} .. {q3:.4f}")
    print(f"    {'  95% interval of the median':<38}{lo:8.4f} .. {hi:.4f}")
    print(f"    {'  per round':<38}" + " ".join(f"{r:.3f}" for r in ag["round_median_ratios"]))
    print(f"    {'fsdp_lab.collectives, no Timeline':<38}{ag['untimed_ratio_median']:8.4f}   (median of pairs)")
    print(f"    {'bare call inside Timeline marks':<38}{ag['marks_ratio_median']:8.4f}   (median of pairs)")
    print(f"(c) host time per all-gather call of {HOST_COST_FLOATS} floats, torch's fake backend, median of "
          f"{args.host_rounds} rounds of {args.calls}")
    print(f"    {'torch.distributed':<38}{host['bare_us']:8.2f} us")
    print(f"    {'fsdp_lab.collectives, no Timeline':<38}{host['ours_untimed_us']:8.2f} us   "
          f"({host['untimed_ratio']:.2f}x)")
    print(f"    {'fsdp_lab.collectives + Timeline':<38}{host['ours_us']:8.2f} us   ({host['ratio']:.2f}x)")

    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"launch_and_collectives_{device}.json"
    out.write_text(json.dumps({
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_average_1min": load_before,
        "load_average_1min_after": os.getloadavg()[0], "device": device, "world_size": n,
        **({"gpu": torch.cuda.get_device_name()} if device == "cuda" else {}),
        "launch": {"first_launch_s": first_launch_s, "fsdp_lab_s": ours_s, "spawn_s": spawn_s,
                   "ratio_of_medians": launch_ratio,
                   "target_ratio": 1.5},
        "all_gather": ag,
        "host_per_call": host,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
