"""MemoryTracker(source="allocator"): fed by the allocators' reports instead of dispatch.

The hand-worked cases of tests/test_memory_tracker.py run with both sources. Here: the same
numbers as the dispatch tracker on a whole training step; the peak against PyTorch's profiler,
which records the same allocator reports through its own code (so ops' inner allocations,
invisible to dispatch, are in both); FSDP1 and FSDP2 on 2 ranks; and the refusals.
"""

import pytest
import torch
from torch._C._profiler import _EventType

from fsdp_lab.memory import allocation_log
from fsdp_lab.memory.tracker import MemoryTracker
from fsdp_lab.toolchain import missing_for_extension
from test_memory_tracker import _llama_step, _warmed_step

_MISSING = missing_for_extension()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"MemoryTracker(source='allocator') needs {_MISSING}")


def _profiled_peak_above_start(step) -> int:
    """The highest running sum of the allocations and frees PyTorch's profiler records in
    ``step()`` (bytes above where it started)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    reports, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:  # allocations inside a range (the optimizer's step is one) are its children
        event = todo.pop()
        if event.tag == _EventType.Allocation:
            reports.append((event.start_time_ns, event.extra_fields.alloc_size))
        todo.extend(event.children)
    running = peak = 0
    for _, nbytes in sorted(reports, key=lambda report: report[0]):
        running += nbytes
        peak = max(peak, running)
    return peak


def _by_both_sources(model, opt, step):
    """One tracked ``step()`` with each source: (the allocator's result, dispatch's result)."""
    results = {}
    for source in ("dispatch", "allocator"):
        with MemoryTracker(model, opt, source=source) as tracker:
            step()
        results[source] = tracker.result()
    return results["allocator"], results["dispatch"]


@pytest.mark.parametrize("batch_size, seq_len", [(4, 64), (1, 4)], ids=["activations-bound", "optimizer-bound"])
def test_same_numbers_as_dispatch_on_a_training_step(batch_size, seq_len):
    """Every phase boundary, the end, and the peak's moment and categories are the dispatch
    tracker's; the peak's temporaries may be a few bytes higher: the scalars an op wraps into
    tensors inside itself (AdamW's arithmetic) are allocations dispatch never sees."""
    model, opt, batch, step = _llama_step(batch_size, seq_len)
    ours, theirs = _by_both_sources(model, opt, step)
    assert ours.timeline == theirs.timeline
    assert ours.current == theirs.current
    assert ours.peak_label == theirs.peak_label
    inner = ours.peak["temporaries"] - theirs.peak["temporaries"]
    assert 0 <= inner <= 64
    assert ours.peak == dict(theirs.peak, temporaries=theirs.peak["temporaries"] + inner)


@pytest.mark.parametrize("batch_size, seq_len", [(4, 64), (1, 4)], ids=["activations-bound", "optimizer-bound"])
def test_peak_is_the_profilers_plus_the_batch(batch_size, seq_len):
    """Above the start, the peak is what the profiler's running sum reaches, plus the batch: it
    existed before the step (the profiler never sees it allocated) and counts from its first use."""
    model, opt, batch, step = _llama_step(batch_size, seq_len)
    profiled = _profiled_peak_above_start(step)
    with MemoryTracker(model, opt, source="allocator") as tracker:
        step()
    start = sum(tracker.timeline()[0][1].values())
    assert tracker.peak_total() == start + profiled + batch.input_ids.nbytes + batch.labels.nbytes


def test_qlora_step():
    """NF4 weights (a wrapper tensor type) and LoRA adapters: the end state is dispatch's but for
    ``other`` (dispatch also counts ``nf4_codec._BYTE_TO_PAIR``, the 2 KiB table dequantizing
    reads, a module global), and the peak is not below dispatch's less that ``other``."""
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.qlora import apply_lora

    model = apply_lora(Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0), rank=4, alpha=8, quantize_base=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = global_batch(512, 4, 32)
    step = _warmed_step(model, opt, batch)
    ours, theirs = _by_both_sources(model, opt, step)
    assert dict(ours.current, other=0) == dict(theirs.current, other=0)
    assert ours.current["quantized"] > 0 and ours.current["optimizer_state"] > 0
    assert ours.peak_label == theirs.peak_label
    assert ours.peak_total >= theirs.peak_total - theirs.peak["other"]


def _rank_sharded_cases(names):
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from fsdp_lab.models.data import global_batch
    from test_memory_tracker import _owned_case

    found = {}
    for name in names:
        model, opt = _owned_case(name)
        batch = global_batch(model.config.vocab_size, 2, 32, seed=torch.distributed.get_rank())
        found[name] = _by_both_sources(model, opt, _warmed_step(model, opt, batch))
    return found


def test_sharded_models_on_two_ranks():
    """FSDP1 and FSDP2, with and without CPU offload. After the step every category but ``other``
    (pre-existing tensors an op reads, which only dispatch counts) is what dispatch counts: no
    allocation outlives its free in the ledger. The peak is never below dispatch's: gloo's
    collectives allocate buffers inside themselves, which dispatch does not see; how long they
    live depends on the other rank's timing, so this peak moves from step to step (as PyTorch's
    profiler's does: up to 9% on this model), where dispatch's does not."""
    from fsdp_lab import launch

    names = ["fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload"]
    for rank, found in enumerate(launch(_rank_sharded_cases, names, world_size=2, timeout=300)):
        for name in names:
            ours, theirs = found[name]
            assert sum(ours.peak.values()) == ours.peak_total
            assert dict(ours.current, other=0) == dict(theirs.current, other=0), (rank, name)
            assert ours.current["sharded_params"] > 0 and ours.current["optimizer_state"] > 0
            assert ours.peak_total >= theirs.peak_total - theirs.peak["other"], (rank, name)


def test_it_is_a_memory_tracker_to_its_users():
    from fsdp_lab.memory.allocator_tracker import AllocatorTracker
    from fsdp_lab.oom import BudgetTracker

    tracker = MemoryTracker(source="allocator")  # made without starting it: nothing is compiled yet
    assert type(tracker) is AllocatorTracker and isinstance(tracker, MemoryTracker)
    assert isinstance(MemoryTracker(), MemoryTracker) and not isinstance(MemoryTracker(), AllocatorTracker)
    assert not isinstance(tracker, BudgetTracker)  # a subclass of MemoryTracker stays apart


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="source='profiler'.*'dispatch'.*'allocator'"):
        MemoryTracker(source="profiler")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match="FakeTensorMode.*source='dispatch'"):
            with MemoryTracker(source="allocator"):
                pass
    with MemoryTracker(source="allocator"):
        with pytest.raises(RuntimeError, match="already running.*source='dispatch'"):
            with MemoryTracker(source="allocator"):
                pass
        kept = torch.empty(100)  # the first one still logs after the refusal
    with MemoryTracker(source="allocator") as again:  # and a new one starts after it ended
        more = torch.empty(50)
    assert again.current()["temporaries"] == 200
    del kept, more
    # PyTorch's profiler listens on the same hook: neither starts while the other runs
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True):
        with pytest.raises(RuntimeError, match="profiler is running.*stop the profiler first"):
            with MemoryTracker(source="allocator"):
                pass
    with MemoryTracker(source="allocator") as last:
        with pytest.raises(RuntimeError, match="Profiler is already enabled"):
            with torch.profiler.profile(activities=activities, profile_memory=True):
                pass
        kept = torch.empty(25)
    assert last.current()["temporaries"] == 100
    _restart_a_half_prepared_profiler()


def _restart_a_half_prepared_profiler():
    """torch 2.6 and 2.11 leave the profiler's trace half-prepared after a start refused as above,
    and every later start in the process fails (docs/memory.md says so); starting and stopping it
    once, below the public API, clears it, so the tests after this one in the same worker can
    profile. torch 2.13 recovers by itself, and then this does nothing."""
    from torch._C._autograd import _disable_profiler, _enable_profiler
    from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, _ExperimentalConfig

    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            pass
    except RuntimeError as error:
        if "Can't disable Kineto profiler" not in str(error):
            raise
        # (state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental)
        config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig())
        _enable_profiler(config, {ProfilerActivity.CPU})
        _disable_profiler()


def test_to_the_rest_of_torch_the_log_is_a_profiler_switched_off():
    """PyTorch reads whatever holds the profiler's slot as a profiler's state. While the log runs,
    its readers answer "no profiler" (a log that was not a profiler's state crashed
    ``_profiler_type()``). In a child process, so that a crash fails this test alone."""
    import pathlib
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from fsdp_lab.memory.tracker import MemoryTracker\n"
        "with MemoryTracker(source='allocator') as tracker:\n"
        "    print(torch.autograd._profiler_enabled(), torch._C._autograd._profiler_type())\n"
        "    kept = torch.empty(10)\n"
        "print(tracker.current()['temporaries'])\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False", "ActiveProfilerType.NONE", "40"]


def test_saved_tensors_of_a_graph_the_collector_frees_are_released():
    """Autograd's saved tensors are held by the ledger's own objects (no Python per tensor): a
    graph kept only by a reference cycle and freed by the collector while tracking lets go of its
    saved tensor, whose bytes count as activations before and as temporaries after (it is still
    alive); the graph's output is freed. Results read after the tracker exits stay as they were
    when it exited, though the graph still held there is freed later."""
    import gc

    w = torch.ones(256, requires_grad=True)
    with MemoryTracker(source="allocator") as tracker:
        x = torch.ones(256) + 1  # 1 KiB, saved for backward by the product below
        y = x * w
        before = tracker.current()
        cycle = [y]
        cycle.append(cycle)
        del y, cycle
        gc.collect()
        after = tracker.current()
        kept = (x * w).sum()  # still holds x saved when the tracker exits
    at_exit = tracker.current()
    del kept  # lets go of x, saved: the ledger, frozen at exit, books nothing of it
    assert (before["activations"], before["temporaries"]) == (1024, 1024)
    assert (after["activations"], after["temporaries"]) == (0, 1024)
    assert at_exit["activations"] == 1024 and tracker.current() == at_exit
    assert tracker._category_at(x.untyped_storage().data_ptr()) == "activations"


def test_a_failed_build_names_the_fix(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'fsdp_lab_allocation_log': g++: not found")

    monkeypatch.setattr(allocation_log, "_loaded", None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with pytest.raises(RuntimeError, match=r"g\+\+: not found.*ninja.*source='dispatch'"):
        with MemoryTracker(source="allocator"):
            pass


@pytest.mark.gpu
def test_cuda_step():
    """On a GPU the caching allocator reports its blocks (rounded up to 512 bytes) to the same
    hook: what stays after the step (the model's parameters, AdamW's state) is what dispatch
    counts, the peak is not below dispatch's, and not above what the allocator held at most."""
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = global_batch(model.config.vocab_size, 4, 64).to("cuda")
    step = _warmed_step(model, opt, batch)
    ours, theirs = _by_both_sources(model, opt, step)
    for category in ("params", "optimizer_state"):
        assert ours.current[category] == theirs.current[category] > 0, category
    assert ours.peak_total >= theirs.peak_total - theirs.peak["other"]
    assert ours.peak_total <= ours.cuda["max_allocated"]
