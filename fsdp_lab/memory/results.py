"""What a MemoryTracker measured, as plain picklable data, and the per-rank table of it."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from fsdp_lab.memory.tags import CATEGORIES


@dataclasses.dataclass
class MemoryResult:
    """What a tracker measured; plain data, so it pickles back from ``fsdp_lab.launch``.

    Byte counts are in bytes. ``peak``/``current`` map every name in CATEGORIES to bytes;
    ``timeline`` is a list of ``(label, {category: bytes})``; ``cuda`` holds the allocator's
    view (``allocated``, ``max_allocated``, ``reserved``, ``max_reserved``,
    ``num_alloc_retries``, ``untracked_at_peak``) on CUDA and is empty elsewhere.
    """

    rank: int
    device: str
    peak: dict[str, int]
    peak_label: str
    current: dict[str, int]
    timeline: list[tuple[str, dict[str, int]]]
    max_by_category: dict[str, int] = dataclasses.field(default_factory=dict)
    cuda: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def peak_total(self) -> int:
        return sum(self.peak.values())


def merge_ranks(results: Iterable[MemoryResult], which: str = "peak") -> list[dict]:
    """One row per rank: {"rank", every category, "total", plus CUDA stats when present}.

    ``which`` is "peak" or "current". Raises ValueError for anything else.
    """
    if which not in ("peak", "current"):
        raise ValueError(f"which must be 'peak' or 'current', got {which!r}")
    if isinstance(results, MemoryResult):  # one rank's
        results = [results]
    rows = []
    for result in sorted(results, key=lambda r: r.rank):
        values = getattr(result, which)
        row = {"rank": result.rank, **{c: values.get(c, 0) for c in CATEGORIES}}
        row["total"] = sum(values.values())
        row.update(result.cuda)
        rows.append(row)
    return rows


# bytes per unit, for every table and plot of memory
# binary units (what allocators and these tables count in) and decimal ones (what spec sheets print)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def unit_scale(unit: str) -> float:
    """Bytes in one ``unit`` (a key of ``UNITS``). Raises ValueError for any other name."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    return UNITS[unit]


def format_rows(rows: list[dict], unit: str = "MiB", skip_zero: bool = True) -> str:
    """A fixed-width text table of ``merge_ranks`` rows (or any rows of byte counts) in ``unit``
    (a key of ``UNITS``: B, KiB, MiB, GiB, KB, MB, GB). Raises ValueError for another unit."""
    scale = unit_scale(unit)
    if not rows:
        raise ValueError("format_rows needs at least one row, e.g. merge_ranks(results) of the ranks' MemoryResults")
    keys = [k for k in rows[0] if k != "rank"]
    if skip_zero:
        keys = [k for k in keys if any(r.get(k, 0) for r in rows)]
    header = "rank  " + "  ".join(f"{k:>16}" for k in keys)
    lines = [header + f"   ({unit})"]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, 0)
            cells.append(f"{v:>16d}" if k == "num_alloc_retries" else f"{v / scale:>16.3f}")
        lines.append(f"{r['rank']:>4}  " + "  ".join(cells))
    return "\n".join(lines)


def cuda_stats(device: torch.device, tracked_peak: int) -> dict[str, int]:
    """The CUDA allocator's counters for ``device`` (bytes; retries a count) and the gap
    between its peak and the tracked peak (allocator rounding, untracked workspaces)."""
    torch.cuda.synchronize(device)
    # one read of the counters: each of torch.cuda.memory_allocated, max_memory_allocated, ...
    # builds and flattens the allocator's whole statistics dictionary again
    stats = torch.cuda.memory_stats(device)
    max_allocated = stats.get("allocated_bytes.all.peak", 0)
    return {
        "allocated": stats.get("allocated_bytes.all.current", 0),
        "max_allocated": max_allocated,
        "reserved": stats.get("reserved_bytes.all.current", 0),
        "max_reserved": stats.get("reserved_bytes.all.peak", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        # allocator peak minus tracked peak: allocator rounding, untracked allocations (workspaces)
        "untracked_at_peak": max_allocated - max(tracked_peak, 0),
    }
