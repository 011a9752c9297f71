"""Per-rank timelines of compute and communication.

An ``Event`` is ``(rank, lane, name, bytes, t_start, t_end)`` plus ``kind`` ("compute" or
"comm") and free-form ``args``; times are seconds on the host's monotonic clock, so the
events of ranks on one machine line up.

* Compute events come from module hooks (``Timeline.attach``: forward and backward of each
  unit) and from ``Timeline.span(name)`` blocks (e.g. the optimizer step).
* Comm events are opened by ``fsdp_lab.collectives`` for every collective issued while a
  timeline is active (entering the ``with`` block registers the timeline as the
  collectives' recorder; this module imports collectives, never the reverse). An async
  collective's end is taken when it completes, not when it is waited on: on CPU gloo from
  its future's completion callback (gloo work objects report no durations), on CUDA from
  CUDA events recorded on the issuing stream.

On CUDA every mark is a CUDA event; marks are turned into seconds (against one reference
event and ``perf_counter`` taken together at start) when the timeline is finalized.

``Timeline.merge`` joins the timelines returned by every rank; ``to_chrome_trace`` writes
JSON that Perfetto and chrome://tracing open; ``overlap`` is the fraction of comm time
hidden under compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import warnings
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import bandwidth, collectives

_active: list["Timeline"] = []


def active() -> "Timeline | None":
    """The innermost timeline being recorded in this process, or None."""
    return _active[-1] if _active else None


@dataclasses.dataclass
class Event:
    """One interval on one rank's lane. Times in seconds, bytes as nccl-tests counts them."""

    rank: int
    lane: str
    name: str
    bytes: int
    t_start: float
    t_end: float
    kind: str = "compute"
    args: dict = dataclasses.field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


class _Clock:
    """perf_counter on CPU; CUDA events on a CUDA device, resolved later to seconds.

    The events are ``torch.Event``s, recorded on the device's current stream from C++:
    ``torch.cuda.Event.record()`` builds a Python ``Stream`` object for every mark, a cost
    paid twice per collective on the path the timeline is meant to watch."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.device = device
            self.origin_event = torch.Event(device, enable_timing=True)
            torch.cuda.synchronize(device)
            self.origin_event.record()
        self.origin_host = time.perf_counter()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.Event(self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        return self.origin_host + self.origin_event.elapsed_time(mark) / 1e3


class CommEvent:
    """An open comm event; ``close()`` ends it (at most once)."""

    def __init__(self, timeline: "Timeline", start, name: str, nbytes: int, lane: str, args: dict):
        self._timeline, self.name, self.bytes, self.lane, self.args = timeline, name, nbytes, lane, args
        self._lock = threading.Lock()
        self._start = start  # a clock mark taken just before the collective was issued
        self._end = None
        self.abandoned = False  # still open when its timeline's `with` block ended: left out

    def close_on_completion(self, works: list) -> None:
        """On CPU, take the end time from the last work's completion callback."""
        if self._timeline._clock.cuda or not works:
            return
        try:
            future = works[-1].get_future()
        except (RuntimeError, AttributeError):
            return
        future.then(self._completed)

    def _completed(self, _future) -> None:
        with self._lock:
            if self._end is None:
                self._end = time.perf_counter()

    def close(self) -> None:
        with self._lock:
            if self._end is None:
                self._end = self._timeline._clock.mark()
            end = self._end
        self._timeline._open.pop(self, None)
        if not self.abandoned:
            self._timeline._add_raw(self.lane, self.name, self.bytes, self._start, end, "comm", self.args)


class Timeline:
    """Records compute and comm events of this rank. Use as a context manager.

    ``Timeline(rank=None, device=None)``: rank defaults to the process group rank (0
    without one), device to CUDA's current device when the default process group uses
    NCCL or CUDA is initialised, else CPU. An asynchronous collective issued inside the block
    is recorded when its handle is waited on; one still not waited on when the block ends is
    left out, with a warning, and named in ``unwaited`` (collective names, in issue order). Raises TypeError for a rank that is not an int, ValueError for a
    negative one or a CUDA device where this process sees no GPU.
    """

    def __init__(self, rank: int | None = None, device: torch.device | str | None = None):
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"Timeline(rank=...) takes a rank number (an int), got {rank!r}")
        if rank < 0:
            raise ValueError(f"Timeline(rank=...) takes a rank number >= 0, got {rank}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if (
                torch.cuda.is_available() and torch.cuda.is_initialized()) else torch.device("cpu")
        self.rank = rank
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"Timeline(device={str(device)!r}) but this process sees no CUDA GPU; leave "
                             "device out (it follows the process group's device) or pass device='cpu'")
        self._open: dict[CommEvent, None] = {}  # asynchronous collectives not waited on yet, in issue order
        self.unwaited: list[str] = []  # those still open when the block ended, by name
        self._clock: _Clock | None = None
        self._raw: list[tuple] = []
        self._events: list[Event] = []
        self._hooks: list = []

    # -- recording -------------------------------------------------------------------------
    def __enter__(self) -> "Timeline":
        if self._clock is None:
            self._clock = _Clock(self.device)
        _active.append(self)
        collectives.add_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        collectives.remove_recorder(self)
        _active.remove(self)
        unfinished, self._open = list(self._open), {}
        for event in unfinished:
            event.abandoned = True  # the timeline does not change after its block
        self.unwaited = [e.name for e in unfinished]
        if unfinished and exc[0] is None:
            names = ", ".join(sorted({e.name for e in unfinished}))
            warnings.warn(f"{len(unfinished)} asynchronous collective(s) ({names}) issued inside this Timeline "
                          "were not waited on before its `with` block ended and are left out of it: wait on "
                          "their handles inside the block", stacklevel=2)
        self.finalize()

    def mark(self):
        """A clock mark for a collective about to be issued (called by fsdp_lab.collectives)."""
        return self._clock.mark()

    def record_comm(self, start, name: str, nbytes: int, *, lane: str = "comm", **args) -> None:
        """Record a synchronous collective, issued at ``start`` and completed now (called by
        fsdp_lab.collectives)."""
        self._raw.append((lane, name, nbytes, start, self._clock.mark(), "comm", args))

    def open_comm(self, start, name: str, nbytes: int, *, lane: str = "comm", **args) -> CommEvent:
        """The comm event of a collective issued since ``start = self.mark()`` (called by
        fsdp_lab.collectives)."""
        event = CommEvent(self, start, name, nbytes, lane, args)
        self._open[event] = None
        return event

    def _add_raw(self, lane, name, nbytes, start, end, kind, args) -> None:
        self._raw.append((lane, name, nbytes, start, end, kind, args))

    @contextlib.contextmanager
    def span(self, name: str, lane: str = "compute", **args) -> Iterator[None]:
        """Record the enclosed block as one compute event (e.g. "optimizer_step")."""
        if self._clock is None:
            raise RuntimeError("Timeline.span used outside `with Timeline():`")
        start = self._clock.mark()
        try:
            yield
        finally:
            self._add_raw(lane, name, 0, start, self._clock.mark(), "compute", args)

    def attach(self, model: nn.Module, modules: Iterable[tuple[str, nn.Module]] | None = None) -> "Timeline":
        """Record forward and backward of each unit of ``model`` as compute events.

        ``modules``: (name, module) pairs; default: the model's children, with
        ModuleList/Sequential containers opened one level (``layers.0``, ``layers.1`` …).
        In backward, module hooks fire before an FSDP unit's own, so on a sharded model a unit's
        backward span holds its blocking all-gather: for ``overlap()`` of FSDP units use
        ``unit_timing.attach_units``.
        Hooks stay until ``detach()`` or the end of the ``with`` block. A model without children
        is one unit itself. Raises TypeError when ``model`` is not an ``nn.Module`` or ``modules``
        not (name, module) pairs; RuntimeError outside its ``with`` block.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"Timeline.attach needs the model (an nn.Module), got {type(model).__name__}")
        if modules is None:
            modules = default_units(model) or [(type(model).__name__, model)]  # a leaf: itself
        modules = list(modules)
        wrong = [pair for pair in modules if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                                                  and isinstance(pair[1], nn.Module))]
        if wrong:
            raise TypeError(f"Timeline.attach: modules must be (name, nn.Module) pairs, e.g. "
                            f"[('layers.0', model.layers[0])]; got {wrong[:3]}")
        if self not in _active:
            raise RuntimeError("Timeline.attach outside its `with` block: attach inside "
                               "`with Timeline() as tl:` (its hooks go at the end of the block)")
        # The first unit (an embedding) takes integer ids, so PyTorch warns that its backward hook
        # fires when its output gradient arrives. That moment is the event we record; the warning
        # would only print a machine-specific path into every lab that times a step.
        warnings.filterwarnings("ignore", message=_NO_INPUT_GRAD_WARNING)
        for name, module in modules:
            self._hooks += _time_module(self, name, module)
        return self

    def detach(self) -> None:
        """Remove the module hooks added by ``attach``."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def finalize(self) -> None:
        """Resolve clock marks into seconds (synchronises CUDA once) and drop hooks."""
        self.detach()
        if not self._raw:
            return
        if self._clock.cuda:
            torch.cuda.synchronize(self._clock.device)
        for lane, name, nbytes, start, end, kind, args in self._raw:
            self._events.append(Event(self.rank, lane, name, nbytes, self._clock.seconds(start),
                                      self._clock.seconds(end), kind, dict(args)))
        self._raw.clear()
        self._events.sort(key=lambda e: (e.rank, e.t_start))

    @property
    def events(self) -> list[Event]:
        self.finalize()
        return self._events

    def __getstate__(self) -> dict:
        # Sent back from ranks by fsdp_lab.launch: only plain events travel.
        self.finalize()
        return {"rank": self.rank, "device": str(self.device), "_events": self._events, "unwaited": self.unwaited}

    def __setstate__(self, state: dict) -> None:
        # a recorded timeline is only read here: no device check (one from GPU ranks loads anywhere)
        self.__init__(state["rank"], "cpu")
        self.device = torch.device(state["device"])
        self._events = state["_events"]
        self.unwaited = state.get("unwaited", [])

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def merge(cls, timelines: Iterable["Timeline"]) -> "Timeline":
        """One timeline holding the events of all given timelines (e.g. one per rank)."""
        merged = cls(rank=0, device="cpu")
        for tl in timelines:
            if not isinstance(tl, Timeline):
                raise TypeError(f"Timeline.merge takes Timelines (e.g. one per rank), got {type(tl).__name__}")
            merged._events.extend(tl.events)
        merged._events.sort(key=lambda e: (e.rank, e.t_start))
        return merged

    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def comm_events(self, rank: int | None = None, name: str | None = None) -> list[Event]:
        """Comm events, optionally of one rank and/or one collective name."""
        return [e for e in self.events if e.kind == "comm" and (rank is None or e.rank == rank)
                and (name is None or e.name == name)]

    def compute_events(self, rank: int | None = None) -> list[Event]:
        return [e for e in self.events if e.kind == "compute" and (rank is None or e.rank == rank)]

    def overlap(self) -> dict[int, float]:
        """Per rank: the fraction of comm time during which compute was also running.

        Both sides are first merged into unions of intervals (nested compute spans and
        concurrent collectives count once); a rank with no comm gets 0.0. Backward spans from
        ``attach`` contain a sharded unit's blocking all-gather (module hooks fire before FSDP's
        there), so on an FSDP model that counts as hidden; time FSDP units with
        ``fsdp_lab.unit_timing.attach_units`` (what ``compare`` does) to measure overlap.
        """
        result = {}
        for rank in self.ranks():
            comm = _union([(e.t_start, e.t_end) for e in self.comm_events(rank)])
            compute = _union([(e.t_start, e.t_end) for e in self.compute_events(rank)])
            total = sum(b - a for a, b in comm)
            result[rank] = _intersection_length(comm, compute) / total if total > 0 else 0.0
        return result

    def phase_summary(self) -> dict[int, dict[str, float]]:
        """Per rank, seconds spent in each phase of the recorded window.

        forward / backward: union of compute events whose ``phase`` arg says so (module hooks
        set it); optimizer: spans recorded with ``phase="optimizer"``; other_compute: the
        remaining compute; exposed_comm: comm time not hidden under any compute; idle: the
        rest of the window [first event start, last event end]. The six add up to the window.
        """
        result = {}
        for rank in self.ranks():
            compute = self.compute_events(rank)
            by_phase = {name: _union([(e.t_start, e.t_end) for e in compute if e.args.get("phase") == name])
                        for name in ("forward", "backward", "optimizer")}
            all_compute = _union([(e.t_start, e.t_end) for e in compute])
            comm = _union([(e.t_start, e.t_end) for e in self.comm_events(rank)])
            everything = _union(all_compute + comm)
            start = min(a for a, _ in everything)
            window = max(b for _, b in everything) - start
            # Phases can nest (a block's forward inside the model's); count each instant once,
            # giving precedence optimizer > backward > forward.
            claimed: list[tuple[float, float]] = []
            row = {}
            for name in ("optimizer", "backward", "forward"):
                row[name] = _length(by_phase[name]) - _intersection_length(by_phase[name], _union(claimed))
                claimed += by_phase[name]
            row["other_compute"] = _length(all_compute) - _intersection_length(all_compute, _union(claimed))
            row["exposed_comm"] = _length(comm) - _intersection_length(comm, all_compute)
            row["idle"] = window - _length(everything)
            row["window"] = window
            result[rank] = row
        return result

    def collective_summary(self, rank: int | None = None) -> list[dict]:
        """One row per comm event: rank, name, bytes, seconds, algbw and busbw (bytes/s)."""
        rows = []
        for e in self.comm_events(rank):
            n = int(e.args.get("group_size", 1))
            algbw, busbw = (bandwidth.bus_bandwidth(e.name, e.bytes, e.duration, n)
                            if e.duration > 0 and n > 1 and e.name in ("all_gather", "reduce_scatter",
                                                                        "all_reduce", "broadcast")
                            else (0.0, 0.0))
            rows.append({"rank": e.rank, "name": e.name, "bytes": e.bytes, "seconds": e.duration,
                         "algbw": algbw, "busbw": busbw, **{k: v for k, v in e.args.items()
                                                           if k in ("module", "impl", "staged")}})
        return rows

    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace JSON (one process per rank, one thread per lane); written to
        ``path`` when given. Times are microseconds from the earliest event."""
        events = self.events
        t0 = min((e.t_start for e in events), default=0.0)
        lanes = sorted({(e.rank, e.lane) for e in events})
        tids = {key: i for i, key in enumerate(lanes)}
        trace = []
        for rank in sorted({r for r, _ in lanes}):
            trace.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                          "args": {"name": f"rank {rank}"}})
        for (rank, lane), tid in tids.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        for e in events:
            trace.append({"ph": "X", "pid": e.rank, "tid": tids[(e.rank, e.lane)], "name": e.name,
                          "cat": e.kind, "ts": (e.t_start - t0) * 1e6, "dur": e.duration * 1e6,
                          "args": {"bytes": e.bytes, **e.args}})
        doc = {"traceEvents": trace, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's children, opening ModuleList/Sequential containers one level."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [(f"{name}.{sub}", m) for sub, m in child.named_children()]
        else:
            units.append((name, child))
    return units


_NO_INPUT_GRAD_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"


def _time_module(tl: Timeline, name: str, module: nn.Module) -> list:
    """Hooks that record ``name`` forward and ``name`` backward as compute events."""
    starts: dict[str, object] = {}

    def pre_forward(_m, _args):
        starts["fwd"] = tl._clock.mark()

    def post_forward(_m, _args, _out):
        if "fwd" in starts:
            tl._add_raw("compute", f"{name} forward", 0, starts.pop("fwd"), tl._clock.mark(), "compute",
                        {"phase": "forward", "module": name})

    def pre_backward(_m, _grad_out):
        starts["bwd"] = tl._clock.mark()

    def post_backward(_m, _grad_in, _grad_out):
        if "bwd" in starts:
            tl._add_raw("compute", f"{name} backward", 0, starts.pop("bwd"), tl._clock.mark(), "compute",
                        {"phase": "backward", "module": name})

    return [module.register_forward_pre_hook(pre_forward), module.register_forward_hook(post_forward),
            module.register_full_backward_pre_hook(pre_backward),
            module.register_full_backward_hook(post_backward)]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists (a sweep)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
