"""MemoryTracker overhead: one training step of the CPU Llama with and without the tracker.

    python benchmarks/memory_tracker.py
    PYTHONPATH=. python benchmarks/memory_tracker.py --batch-size 8 --seq-len 128 --steps 10
    python benchmarks/memory_tracker.py --no-allocator   # without building the C++ ledger
    python benchmarks/memory_tracker.py --batch-size 1 --seq-len 16 --threads 1 --out benchmarks/results/memory_tracker_small_cpu.json
    python benchmarks/memory_tracker.py --config llama2-7b --n-layers 4 --batch-size 2 --seq-len 512 --steps 10 \
        --out benchmarks/results/memory_tracker_cuda_llama2-7b_4_layers.json   # on a GPU (about 25 GB)

Steps alternate (plain, do-nothing dispatch mode, PyTorch's profiler recording allocations,
tracked, tracked from the allocator, plain ...) in one process so all see the same machine load,
each after a full garbage collection (not timed) so that it collects its own garbage only; the median step time of each is reported with its ratio to the plain step (target for the
tracker <= 1.10). The
do-nothing mode is the floor: what entering a Python ``TorchDispatchMode`` for every op costs
before the tracker does any work. The profiler (``torch.profiler.profile(profile_memory=True)``,
CPU activity, no shapes or stacks) is the other way to see every allocation: in C++, without
Python per op, but recording an event per op and per allocation; its cost is shown beside ours,
and so is the same profiler recording allocations only (record functions limited to the user
scope, so no op events): what seeing allocations from C++ costs at the least, through any
instrument PyTorch ships; and that profiler as a tracker would use it (``profiler_stream``):
each saved tensor marked in its stream, the stream read back after the step. PyTorch's own
``MemTracker`` (``torch.distributed._tools.mem_tracker``, also a ``TorchDispatchMode``) runs the
same step too: its cost beside ours, and its peak beside ours (the same bytes:
tests/test_memory_tracker.py checks it). And the route that meets the target on CPU at the default
size (not on a GPU, nor on CPU for a step as small as the last command's, 16 tokens):
``MemoryTracker(source="allocator")`` (``tracked_allocator``; its C++ ledger is built at first
use, skipped with the reason where no C++ compiler is found), timed with its results read, beside
the ledger alone booking the allocators' reports (``allocation_log``, this route's floor: no
Python events, no hooks), and once more split into its
phases by the wall clock (``allocator_phase_s``: making the tracker, entering it, the step, leaving
it, reading the result, dropping it; medians); its peak, by category, is printed beside the
dispatch tracker's. The ops of one step are counted, and each instrument's cost per op printed:
a per-op instrument costs a fixed time per op, so its ratio falls as ops grow (bigger batches,
wider layers). Times are CPU time
of this process (``time.process_time``), which other processes on the machine disturb less than
wall-clock time (the wall-clock ratios of the same steps are recorded beside them: ``wall_ratio``,
``allocator_wall_ratio``); on a GPU, wall-clock time with the device synchronised. On a GPU the model runs
there and steps are synchronised before timing. It also sets the tracked step beside
``estimate`` (and, on CUDA, beside the allocator's ``torch.cuda.max_memory_allocated``): peak
bytes by category, estimated vs measured. Writes
``benchmarks/results/memory_tracker_<cpu|cuda>.json`` (the GPU's name under ``device``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.dist import current_device
from fsdp_lab.memory import allocation_log
from fsdp_lab.memory.estimate import estimate
from fsdp_lab.memory.tracker import MemoryTracker
from fsdp_lab.models.data import global_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

RESULTS = pathlib.Path(__file__).parent / "results"


ALLOCATOR_PHASES = ("make", "enter", "step", "exit", "result", "drop")


def _allocator_phases(model, optimizer, step, clock, device) -> dict[str, float]:
    """One step under ``MemoryTracker(source="allocator")``, timed phase by phase (seconds by
    ``clock``): making the tracker, entering it, the step (with the device synchronised after it),
    leaving it (the end state, the results copied out of the ledger), reading its result,
    dropping it."""
    seconds, start = {}, clock()

    def lap(name):
        nonlocal start
        now = clock()
        seconds[name], start = now - start, now

    tracker = MemoryTracker(model, optimizer, source="allocator")
    lap("make")
    tracker.__enter__()
    lap("enter")
    try:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        lap("step")
    finally:
        tracker.__exit__(None, None, None)
    lap("exit")
    tracker.result()
    lap("result")
    del tracker
    lap("drop")
    return seconds


class _DoNothingMode(TorchDispatchMode):
    """Every op through Python and straight on: the cost of any dispatch-based tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _AllocationsOnly:
    """PyTorch's profiler recording allocations but no op events (private API: absent on some
    torch versions, see ``available``)."""

    def __init__(self):
        try:
            from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
            from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope,
                                            _ExperimentalConfig)
            # ProfilerConfig(state, report_input_shapes, profile_memory, with_stack, with_flops,
            # with_modules, experimental_config)
            self._config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                                          _ExperimentalConfig())
            self._activities = {ProfilerActivity.CPU}
            self._scopes = {RecordScope.USER_SCOPE}
            self._enable, self._disable, self._prepare = _enable_profiler, _disable_profiler, _prepare_profiler
            self.available = True
        except (ImportError, AttributeError, TypeError):
            self.available = False

    def __enter__(self):
        self._prepare(self._config, self._activities)
        self._enable(self._config, self._activities, self._scopes)
        return self

    def __exit__(self, *exc):
        self.allocations = sum(1 for e in self._disable().events() if e.name() == "[memory]")
        return False


class _ProfilerStream(_AllocationsOnly):
    """The least a tracker fed by PyTorch's profiler (no compiled code of its own) must do: the
    allocations-only profiler, each tensor autograd saves marked in its stream (a user-scope
    record function, the one event Python can add there) and the stream read back after the step
    as (time, address, bytes), ready for a replay that this class does not do."""

    def __init__(self):
        super().__init__()
        if self.available:
            from torch._C._profiler import _EventType
            self._allocation = _EventType.Allocation
            self._marker_enter = torch.ops.profiler._record_function_enter_new
            self._marker_exit = torch.ops.profiler._record_function_exit._RecordFunction

    def _mark_saved(self, tensor):
        self._marker_exit(self._marker_enter("saved", None))
        return tensor

    def __enter__(self):
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._mark_saved, lambda t: t)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._saved_hooks.__exit__(*exc)
        self.stream, self.marks = [], 0
        # allocations inside a user-scope range (the optimizer's step is one) are its children
        events = list(self._disable().experimental_event_tree())
        while events:
            event = events.pop()
            if event.tag == self._allocation:
                fields = event.extra_fields
                self.stream.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            else:
                self.marks += event.name == "saved"
                events.extend(event.children)
        self.stream.sort()
        return False


class _CountOps(TorchDispatchMode):
    """Counts the ops one step dispatches (what a per-op instrument pays for)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cpu", help="a Llama config's name (fsdp_lab.models.CONFIGS)")
    parser.add_argument("--n-layers", type=int, default=None,
                        help="the config with this many blocks (a few blocks of llama2-7b: a step where a GPU computes "
                             "rather than waits for its host)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each kind (medians of these)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own choice); 1 takes the idle worker's spinning "
                             "out of a small step's CPU time")
    parser.add_argument("--no-allocator", dest="allocator", action="store_false",
                        help="skip MemoryTracker(source='allocator') (it builds a C++ extension at first use)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/memory_tracker_<cpu|cuda>.json)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = current_device()
    overrides = {} if args.n_layers is None else {"n_layers": args.n_layers}
    model = Llama(LlamaConfig.from_name(args.config, **overrides), seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = global_batch(model.config.vocab_size, args.batch_size, args.seq_len).to(device)

    def step():
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    last = {}
    phase_times = {name: [] for name in ALLOCATOR_PHASES}
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def timed(kind: str) -> tuple[float, float]:
        """One step of ``kind``: (seconds by ``clock``, seconds by the wall clock)."""
        # each kind starts with nothing left to collect, so it pays for collecting its own
        # garbage and no other kind's (the plain step comes right after PyTorch's MemTracker;
        # without this the ratios depended on the kinds' order)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, wall_start = clock(), time.perf_counter()
        if kind == "tracked":
            with MemoryTracker(model, optimizer) as tracker:
                step()
            last["result"] = tracker.result()
        elif kind == "dispatch_floor":
            with _DoNothingMode():
                step()
        elif kind == "profiler_memory":
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False):
                step()
        elif kind == "allocations_only":
            with allocations_only:
                step()
        elif kind == "profiler_stream":
            with profiler_stream:
                step()
        elif kind == "tracked_allocator":
            with MemoryTracker(model, optimizer, source="allocator") as tracker:
                step()
            last["allocator_result"] = tracker.result()
        elif kind == "allocator_phases":
            # by the wall clock: CPU time would charge a short Python phase with what torch's
            # worker threads spend spinning after the step's last parallel op
            phases = _allocator_phases(model, optimizer, step, time.perf_counter, device)
            for name, seconds in phases.items():
                phase_times[name].append(seconds)
        elif kind == "allocation_log":
            ledger = allocation_log.new_ledger(device.type)
            ledger.start()
            step()
            ledger.stop()
            last["log_reports"] = ledger.reports()
        elif kind == "torch_mem_tracker":
            reference = torch_mem_tracker()
            reference.track_external(model, optimizer, batch.input_ids, batch.labels)
            with reference:
                step()
            last["reference"] = reference
        else:
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - start, time.perf_counter() - wall_start

    load_before = os.getloadavg()[0]
    allocations_only, profiler_stream = _AllocationsOnly(), _ProfilerStream()
    kinds = ("plain", "dispatch_floor", "profiler_memory", "tracked")
    if allocations_only.available:
        kinds = kinds[:3] + ("allocations_only", "profiler_stream") + kinds[3:]
    allocator_missing = "--no-allocator"
    if args.allocator:
        try:
            allocation_log.load()  # built here, at the first run on this machine
            allocator_missing = None
            kinds += ("tracked_allocator", "allocator_phases", "allocation_log")
        except RuntimeError as error:
            allocator_missing = str(error)
            print(f"MemoryTracker(source='allocator') not measured: {error}")
    try:  # private module: absent on some torch versions
        from torch.distributed._tools.mem_tracker import MemTracker as torch_mem_tracker
        kinds += ("torch_mem_tracker",)
    except ImportError:
        torch_mem_tracker = None
    for _ in range(2):  # warm up every path
        for kind in kinds:
            timed(kind)
    for seconds in phase_times.values():
        seconds.clear()
    times = {kind: [] for kind in kinds}
    wall = {kind: [] for kind in kinds}  # the same steps by the wall clock
    for _ in range(args.steps):
        for kind in kinds:
            seconds, wall_seconds = timed(kind)
            times[kind].append(seconds)
            wall[kind].append(wall_seconds)
    median = {kind: statistics.median(t) for kind, t in times.items()}
    with _CountOps() as counter:
        step()
    ops = counter.count
    per_op_us = {kind: 1e6 * (median[kind] - median["plain"]) / ops for kind in kinds}
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "load_average_1min": load_before,
        "arguments": " ".join(sys.argv[1:]),
        "config": args.config, "n_layers": model.config.n_layers, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "steps": args.steps,
        "plain_step_s": median["plain"], "dispatch_floor_step_s": median["dispatch_floor"],
        "tracked_step_s": median["tracked"], "profiler_memory_step_s": median["profiler_memory"],
    }
    result["ratio"] = result["tracked_step_s"] / result["plain_step_s"]
    result["floor_ratio"] = result["dispatch_floor_step_s"] / result["plain_step_s"]
    result["profiler_memory_ratio"] = result["profiler_memory_step_s"] / result["plain_step_s"]
    if allocations_only.available:
        result["allocations_only_step_s"] = median["allocations_only"]
        result["allocations_only_ratio"] = median["allocations_only"] / median["plain"]
        result["allocations_per_step"] = allocations_only.allocations
        result["profiler_stream_step_s"] = median["profiler_stream"]
        result["profiler_stream_ratio"] = median["profiler_stream"] / median["plain"]
        result["profiler_stream_events"] = len(profiler_stream.stream)
        result["profiler_stream_saved_marks"] = profiler_stream.marks
    wall_median = {kind: statistics.median(t) for kind, t in wall.items()}
    if device.type == "cpu":  # the same steps by the wall clock: what a user waits for
        result["wall_ratio"] = wall_median["tracked"] / wall_median["plain"]
    if allocator_missing is None:
        result["allocator_step_s"] = median["tracked_allocator"]
        result["allocator_ratio"] = median["tracked_allocator"] / median["plain"]
        if device.type == "cpu":
            result["allocator_wall_ratio"] = wall_median["tracked_allocator"] / wall_median["plain"]
        result["allocator_phase_s"] = {name: statistics.median(t) for name, t in phase_times.items()}
        result["plain_wall_step_s"] = wall_median["plain"]
        result["allocation_log_step_s"] = median["allocation_log"]
        result["allocation_log_ratio"] = median["allocation_log"] / median["plain"]
        result["allocation_log_reports_per_step"] = last["log_reports"]
    else:
        result["allocator_missing"] = allocator_missing
    if torch_mem_tracker is not None:
        result["torch_mem_tracker_step_s"] = median["torch_mem_tracker"]
        result["torch_mem_tracker_ratio"] = median["torch_mem_tracker"] / median["plain"]
        result["torch_mem_tracker_us_added_per_op"] = per_op_us["torch_mem_tracker"]
    # the instrument's cost grows with the number of ops, the step's time with their size: a
    # step whose ops take on average this long (s) is within the 1.10 target
    result.update(ops_per_step=ops, plain_us_per_op=1e6 * median["plain"] / ops,
                  tracked_us_added_per_op=per_op_us["tracked"], floor_us_added_per_op=per_op_us["dispatch_floor"],
                  us_per_op_for_target=per_op_us["tracked"] / 0.10)
    print(f"{'':<20}{'step (ms)':>12}{'ratio':>8}")
    for kind in kinds:
        print(f"{kind:<20}{1e3 * median[kind]:>12.2f}{median[kind] / median['plain']:>8.3f}")
    print(f"ratio tracked/plain: {result['ratio']:.2f}  (target <= 1.10; a do-nothing dispatch mode alone: "
          f"{result['floor_ratio']:.2f}; PyTorch's profiler recording allocations: {result['profiler_memory_ratio']:.2f}"
          + (f", allocations only: {result['allocations_only_ratio']:.2f}, read back with saved tensors marked: "
             f"{result['profiler_stream_ratio']:.2f}" if allocations_only.available else "")
          + (f"; PyTorch's MemTracker: {result['torch_mem_tracker_ratio']:.2f}" if torch_mem_tracker else "")
          + ")")
    if allocator_missing is None:
        print(f"ratio tracked from the allocator/plain: {result['allocator_ratio']:.2f}  (target <= 1.10; "
              f"its C++ ledger alone: {result['allocation_log_ratio']:.2f})")
        print("  by phase (ms): " + ", ".join(f"{name} {1e3 * t:.2f}" for name, t in result["allocator_phase_s"].items())
              + f"  (wall clock; the plain step: {1e3 * result['plain_wall_step_s']:.2f})")
    if device.type == "cpu":
        print(f"by the wall clock instead: tracked {result['wall_ratio']:.2f}"
              + (f", from the allocator {result['allocator_wall_ratio']:.2f}" if allocator_missing is None else ""))
    print(f"{ops} ops per step, {result['plain_us_per_op']:.1f} us each on average; the tracker adds "
          f"{per_op_us['tracked']:.1f} us per op (a do-nothing dispatch mode {per_op_us['dispatch_floor']:.1f} us), "
          f"so steps whose ops average {result['us_per_op_for_target']:.0f} us or more stay within 1.10")
    measured = last["result"]
    est = estimate(model.config, world_size=1, strategy="ddp", param_dtype=torch.float32,
                   batch_size=args.batch_size, seq_len=args.seq_len, foreach=device.type == "cuda",
                   device=device.type)
    print(f"\n{'peak (bytes)':<18}{'estimate':>14}{'tracked':>14}")
    for cat, value in est.bytes.items():
        if value or measured.peak[cat]:
            print(f"{cat:<18}{value:>14,}{measured.peak[cat]:>14,}")
    print(f"{'total':<18}{est.total:>14,}{measured.peak_total:>14,}   tracked/estimate "
          f"{measured.peak_total / est.total:.3f}")
    if measured.cuda:
        print(f"{'cuda max_allocated':<18}{'':>14}{measured.cuda['max_allocated']:>14,}   allocator/estimate "
              f"{measured.cuda['max_allocated'] / est.total:.3f}")
    if "reference" in last:
        snapshot = last["reference"].get_tracker_snapshot("peak")
        reference_total = next(stats["Total"] for dev, stats in snapshot.items() if dev.type == device.type)
        result["torch_mem_tracker_total"] = reference_total
        print(f"{'PyTorch MemTracker':<18}{'':>14}{reference_total:>14,}   tracked/PyTorch's "
              f"{measured.peak_total / reference_total:.3f}")
    if "allocator_result" in last:  # the same step's peak from the allocator's reports
        from_allocator = last["allocator_result"]
        result.update(allocator_peak=from_allocator.peak, allocator_total=from_allocator.peak_total,
                      allocator_peak_label=from_allocator.peak_label, tracked_peak_label=measured.peak_label)
        print(f"\n{'peak (bytes)':<18}{'dispatch':>14}{'allocator':>14}   at {measured.peak_label!r} / "
              f"{from_allocator.peak_label!r}")
        for cat, value in measured.peak.items():
            if value or from_allocator.peak[cat]:
                print(f"{cat:<18}{value:>14,}{from_allocator.peak[cat]:>14,}")
        print(f"{'total':<18}{measured.peak_total:>14,}{from_allocator.peak_total:>14,}")
    result.update(estimate_peak=est.bytes, estimate_total=est.total, tracked_peak=measured.peak,
                  tracked_total=measured.peak_total, cuda=measured.cuda)
    RESULTS.mkdir(exist_ok=True)
    out = pathlib.Path(args.out) if args.out else RESULTS / f"memory_tracker_{device.type}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
