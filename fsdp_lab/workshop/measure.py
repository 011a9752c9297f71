"""What the checkers measure the same way in every lab: bytes on the wire."""

from __future__ import annotations

from typing import Iterable

# Fraction of a collective's size S that one rank sends in a ring (nccl-tests' bus factors).
WIRE_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def wire_bytes(events: Iterable) -> int:
    """Bytes one rank sends for the given timeline comm events (``Timeline.comm_events()``),
    counted as a ring does: all-reduce 2(n-1)/n·S, all-gather and reduce-scatter (n-1)/n·S,
    broadcast S, where S is the event's ``bytes`` and n its group size. Raises KeyError for
    a collective not in ``WIRE_FACTOR``."""
    return round(sum(e.bytes * WIRE_FACTOR[e.name](int(e.args.get("group_size", 1)))
                     for e in events))


def bytes_by_collective(events: Iterable) -> dict[str, tuple[int, int]]:
    """{collective name: (number of calls, total size S in bytes)} of timeline comm events."""
    out: dict[str, tuple[int, int]] = {}
    for e in events:
        calls, total = out.get(e.name, (0, 0))
        out[e.name] = (calls + 1, total + e.bytes)
    return out
