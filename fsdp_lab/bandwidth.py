"""Collective bandwidth, as nccl-tests defines it: algbw and busbw of a timed collective, and
:func:`benchmark`, which times fsdp_lab's collectives on fresh ranks (``fsdp-lab bench``, lab 01).

Sits above ``fsdp_lab.collectives`` (whose collectives it times) and ``fsdp_lab.launch``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from fsdp_lab import collectives
from fsdp_lab.dist import current_device
from fsdp_lab.launch import launch

_BUS_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/second for a collective of size ``nbytes`` that took ``seconds``.

    algbw = S / t; busbw = algbw·(n−1)/n for all-gather and reduce-scatter, ·2(n−1)/n for
    all-reduce, ·1 for broadcast (nccl-tests' PERFORMANCE.md). Raises ValueError for an
    unknown op or non-positive time.
    """
    if op not in _BUS_FACTOR:
        raise ValueError(f"unknown collective {op!r}; use one of {sorted(_BUS_FACTOR)}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    algbw = nbytes / seconds
    return algbw, algbw * _BUS_FACTOR[op](world_size)


def timed_on_all_ranks(call: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Run ``call()`` once, started together on every rank, and time it on this rank.

    A barrier lines the ranks up first; on CUDA the device is synchronised before and after,
    so the time covers the kernels, not just their launch. Returns ``(seconds, call())``.
    """
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, value


def measured_bytes(size: int, world_size: int) -> int:
    """The size :func:`benchmark` measures for a requested ``size`` (bytes): whole float32
    elements per rank, at least one."""
    return max(1, size // (4 * world_size)) * 4 * world_size


def _bench_rank(ops: list[str], sizes: list[int], warmup: int, iters: int) -> list[dict]:
    n = dist.get_world_size()
    device = current_device()
    rows = []
    for op in ops:
        for size in sizes:
            per_rank = measured_bytes(size, n) // (4 * n)
            small = torch.ones(per_rank, device=device)
            big = torch.ones(per_rank * n, device=device)
            run = {
                "all_gather": lambda: collectives.all_gather_into_tensor(big, small),
                "reduce_scatter": lambda: collectives.reduce_scatter_tensor(small, big),
                "all_reduce": lambda: collectives.all_reduce(big),
                "broadcast": lambda: collectives.broadcast(big, 0),
            }[op]
            times = []
            for i in range(warmup + iters):
                seconds, _ = timed_on_all_ranks(run, device)
                if i >= warmup:
                    times.append(seconds)
            times.sort()
            rows.append({"op": op, "bytes": big.numel() * 4, "time_s": times[len(times) // 2]})
    return rows


def benchmark(op: str | list[str], sizes: list[int], world_size: int = 2, *, backend: str = "auto",
              warmup: int = 2, iters: int = 10, timeout: float = 300.0) -> list[dict]:
    """Measure collective bandwidth on ``world_size`` fresh ranks.

    ``op``: "all_gather", "reduce_scatter", "all_reduce", "broadcast", a list of them or
    "all". ``sizes``: collective sizes S in bytes (float32 payload), each rounded down to whole
    float32 elements per rank (a multiple of 4·world_size bytes, at least one element per rank;
    a row's ``bytes`` is the size measured). Returns one row per
    (op, size): op, bytes, world_size, time_s (median over ``iters``, slowest rank),
    algbw_GBps, busbw_GBps (10^9 bytes/s). Raises ValueError for an unknown op.
    """
    ops = list(_BUS_FACTOR) if op == "all" else ([op] if isinstance(op, str) else list(op))
    for name in ops:
        if name not in _BUS_FACTOR:
            raise ValueError(f"unknown collective {name!r}; use one of {sorted(_BUS_FACTOR)} or 'all'")
    per_rank = launch(_bench_rank, ops, list(sizes), warmup, iters,
                      world_size=world_size, backend=backend, timeout=timeout)
    rows = []
    for i, row in enumerate(per_rank[0]):
        seconds = max(rank_rows[i]["time_s"] for rank_rows in per_rank)
        algbw, busbw = bus_bandwidth(row["op"], row["bytes"], seconds, world_size)
        rows.append({**row, "world_size": world_size, "time_s": seconds,
                     "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9})
    return rows
