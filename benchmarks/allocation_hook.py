"""What a memory tracker fed by the allocator would cost: the allocation stream seen from C++.

    with AllocationHook("cpu") as hook:   # AllocationHook.build() first: None, or why it failed
        step()
    hook.peak, hook.saved_at_peak       # bytes above the start

Used by ``benchmarks/memory_tracker.py`` beside the dispatch-based ``MemoryTracker``.
``allocation_hook.cpp`` (built once by ``torch.utils.cpp_extension.load``, about a minute)
logs every allocation and free the allocators report to the profiler's hook, as (address,
bytes) in C++. From Python, only what a tracker must see to put categories on the stream:
each tensor autograd saves, stamped with the stream's length when saved and when released.
After the step the stream is replayed: the peak above the start (bytes) and how many of them
autograd held then (``saved_at_peak``, the tracker's ``activations`` but for storages that
existed before the step). It puts no other category on the stream: a tracker built this way
would also stamp gradients, optimizer state, tags and resizes, each a few per step.
"""

from __future__ import annotations

import pathlib

import torch

SOURCE = pathlib.Path(__file__).with_name("allocation_hook.cpp")


class _Stamped:
    """A saved tensor; its death (autograd released it) is stamped on the stream."""

    __slots__ = ("tensor", "save", "releases", "position")

    def __init__(self, tensor, save, releases, position):
        self.tensor, self.save, self.releases, self.position = tensor, save, releases, position

    def __del__(self):
        self.releases.append((self.position(), self.save))


class AllocationHook:
    """Logs one step's allocations on ``device`` ("cpu", "cuda") in C++ and replays them after it
    (sizes in bytes)."""

    _extension = None

    def __init__(self, device: str = "cpu"):
        self.device = device

    @classmethod
    def build(cls) -> str | None:
        """Compile the extension (once per process; cached on disk by torch). Returns None, or
        why it could not be built (no C++ compiler, no headers)."""
        if cls._extension is None:
            from torch.utils.cpp_extension import load
            try:
                cls._extension = load("fsdp_lab_allocation_hook", [str(SOURCE)])
            except Exception as error:  # a missing compiler surfaces as several error types
                return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return None

    def __enter__(self):
        log = self._extension
        if log is None:
            raise RuntimeError("AllocationHook: the extension is not built; call AllocationHook.build() "
                               "first (it returns why, where it cannot be built)")
        saves, releases = [], []
        self._saves, self._releases = saves, releases

        def pack(t):
            save = (log.position(), t.untyped_storage().data_ptr())
            saves.append(save)
            if t.grad_fn is None:  # no cycle through autograd's graph: kept as it is, never released
                return t
            return _Stamped(t.detach(), save, releases, log.position)

        def unpack(packed):
            return packed.tensor if type(packed) is _Stamped else packed

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        log.start(self.device)
        return self

    def __exit__(self, *exc):
        addresses, deltas = self._extension.stop()
        self._hooks.__exit__(*exc)
        self.events = len(deltas)
        self.peak, self.saved_at_peak = replay(addresses.tolist(), deltas.tolist(), self._saves, self._releases)
        return False


def replay(addresses: list[int], deltas: list[int], saves: list[tuple], releases: list[tuple]) -> tuple[int, int]:
    """Walk the stream in order. ``saves``: (position, address) of each saved storage;
    ``releases``: (position, that save). A mark stamped ``position`` happened just before event
    ``position``. Returns (peak bytes above the start, bytes saved by autograd at it)."""
    live: dict[int, list[int]] = {}  # address -> [bytes, times saved]
    by_save: dict[tuple, list[int]] = {}
    marks = sorted([(save[0], 0, save) for save in saves]
                   + [(position, 1, save) for position, save in releases], key=lambda m: (m[0], m[1]))
    total = saved = peak = saved_at_peak = 0
    next_mark = 0
    for index, (address, delta) in enumerate(zip(addresses, deltas)):
        while next_mark < len(marks) and marks[next_mark][0] <= index:
            _, is_release, save = marks[next_mark]
            next_mark += 1
            record = by_save.get(save) if is_release else live.get(save[1])
            if record is None:  # a storage from before the step: not in the stream
                continue
            by_save[save] = record
            record[1] += -1 if is_release else 1
            if record[1] == (0 if is_release else 1):
                saved += -record[0] if is_release else record[0]
        if delta > 0:
            live[address] = [delta, 0]
            total += delta
            if total > peak:
                peak, saved_at_peak = total, saved
        else:
            record = live.pop(address, None)
            total += delta
            if record is not None and record[1]:
                saved -= record[0]
    return peak, saved_at_peak
