"""CUDA memory snapshots: record torch's allocator history around a step, save it, plot it offline.

``record(path)`` wraps ``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot``; the
pickle it writes opens in https://pytorch.org/memory_viz (drag and drop). That viewer loads its
script from the network, so ``memory_over_time`` / ``plot_snapshot`` read the same pickle and
draw allocated bytes over time with matplotlib, offline. Recording needs CUDA; reading and
plotting a saved snapshot does not.

Snapshot format used here (torch's): ``{"segments": [{"device", "blocks": [{"size", "state"}]}],
"device_traces": [[{"action", "addr", "size", "time_us"}, ...] per device]}``; actions
``alloc`` and ``free_completed`` change allocated bytes.
"""

from __future__ import annotations

import contextlib
import pathlib
import pickle
from typing import Iterator

import torch


def cuda_available() -> bool:
    """True when CUDA is usable here (snapshots can be recorded)."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def record(path: str | pathlib.Path | None = None, max_entries: int = 100_000) -> Iterator[None]:
    """Record every CUDA allocation and free inside the block (with Python stacks); on exit
    save the snapshot to ``path`` (a pickle) when given, and stop recording.

    Raises RuntimeError without CUDA (there is no allocator history to record).
    """
    if not cuda_available():
        raise RuntimeError("CUDA memory snapshots need a CUDA GPU; none is available here. "
                           "Use fsdp_lab.memory.MemoryTracker for a CPU measurement.")
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries)
    try:
        yield
    finally:
        if path is not None:
            save(path)
        torch.cuda.memory._record_memory_history(enabled=None)


def save(path: str | pathlib.Path) -> pathlib.Path:
    """Write the allocator's current snapshot (with the recorded history) to ``path``; returns it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return path


def load(path: str | pathlib.Path) -> dict:
    """Read a snapshot pickle written by :func:`save` (or by torch directly)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def memory_over_time(snapshot: dict | str | pathlib.Path, device: int = 0) -> tuple[list[float], list[int]]:
    """(times in ms from the first event, allocated bytes after each event) for ``device``.

    Allocations made before recording began are included as the starting level (recovered
    from the final segment state). Raises ValueError if the snapshot has no trace for ``device``.
    """
    if not isinstance(snapshot, dict):
        snapshot = load(snapshot)
    traces = snapshot.get("device_traces", [])
    if device >= len(traces):
        raise ValueError(f"snapshot has traces for {len(traces)} device(s); device {device} is not one. "
                         "Record with fsdp_lab.memory.snapshot.record on that device.")
    events = [e for e in traces[device] if e["action"] in ("alloc", "free_completed")]
    final = sum(block["size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == device
                for block in seg["blocks"] if block["state"] == "active_allocated")
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in events)
    level = final - net
    if not events:
        return [0.0], [level]
    t0 = events[0]["time_us"]
    times, values = [], []
    for e in events:
        level += e["size"] if e["action"] == "alloc" else -e["size"]
        times.append((e["time_us"] - t0) / 1000.0)
        values.append(level)
    return times, values


def plot_snapshot(snapshot: dict | str | pathlib.Path, ax=None, device: int = 0, title: str | None = None):
    """Allocated memory (MiB) over time (ms) from a snapshot, drawn offline; returns the Axes."""
    import matplotlib.pyplot as plt

    times, values = memory_over_time(snapshot, device)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    ax.step(times, [v / 2**20 for v in values], where="post", color="tab:blue")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.set_title(title or f"CUDA memory over time (device {device})")
    peak = max(values)
    ax.axhline(peak / 2**20, color="tab:red", ls="--", lw=0.8)
    ax.annotate(f"peak {peak / 2**20:.1f} MiB", (times[values.index(peak)], peak / 2**20),
                textcoords="offset points", xytext=(4, 4), fontsize=8, color="tab:red")
    return ax
