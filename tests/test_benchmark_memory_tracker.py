"""benchmarks/memory_tracker.py's ``profiler_stream``: the profiler's allocation stream read back
whole, against allocations whose sizes are known (one inside a user-scope range, as the
optimizer's step is) and saved tensors counted by hand."""

import pytest
import torch

from _benchmarks import load_benchmark

bench = load_benchmark("memory_tracker")


def test_profiler_stream_reads_allocations_inside_user_ranges_and_marks_each_saved_tensor():
    stream = bench._ProfilerStream()
    if not stream.available:
        pytest.skip("this torch lacks the profiler's private entry points")
    weight = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)
    with stream:
        outside = torch.empty(1000, dtype=torch.uint8)           # 1000 bytes
        with torch.profiler.record_function("a user range"):
            inside = torch.empty(3000, dtype=torch.uint8)        # 3000 bytes, a child of the range
        loss = (x @ weight).square().sum()                       # saves x, and x @ weight
        del outside, inside, loss
    sizes = [size for _, _, size in stream.stream]
    assert 1000 in sizes and -1000 in sizes
    assert 3000 in sizes and -3000 in sizes
    assert sum(sizes) == 0                                       # everything made inside was freed
    assert [t for t, _, _ in stream.stream] == sorted(t for t, _, _ in stream.stream)
    assert stream.marks == 2


def test_allocator_phases_time_each_phase_of_one_tracked_step():
    """The phases come from consecutive clock readings (a scripted clock: 0, 1, 3, 6, ... gives
    laps 1, 2, 3, ...), the step runs inside the tracker, and the tracker is stopped at the end
    (another allocator tracker can start)."""
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.toolchain import missing_for_extension
    missing = missing_for_extension()
    if missing:
        pytest.skip(f"needs {missing}")
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def step():
        model(torch.randn(4, 8)).square().sum().backward()
        optimizer.step()

    readings = iter([0, 1, 3, 6, 10, 15, 21])
    phases = bench._allocator_phases(model, optimizer, step, lambda: next(readings), torch.device("cpu"))
    assert list(phases) == list(bench.ALLOCATOR_PHASES)
    assert list(phases.values()) == [1, 2, 3, 4, 5, 6]
    assert not torch.equal(model.weight, before)
    with MemoryTracker(model, optimizer, source="allocator") as tracker:
        step()
    assert tracker.peak()["params"] == 8 * 8 * 4 + 8 * 4
