"""MemoryTracker: exact bytes per category on a model whose sizes are worked out by hand."""

import contextlib
import pickle

import pytest
import torch
import torch.nn as nn

from fsdp_lab.memory import tags
from fsdp_lab.toolchain import missing_for_extension
from fsdp_lab.memory.tags import CATEGORIES
from fsdp_lab.memory.tracker import MemoryResult, MemoryTracker, format_rows, merge_ranks

F32 = 4

# Both ways of feeding the tracker must give these tests' numbers ("allocator" builds its C++
# allocation log at first use: 40 s on 2 cores, once per machine; skipped without a compiler).
MISSING_TOOLCHAIN = missing_for_extension()
ALLOCATOR = pytest.param("allocator", marks=pytest.mark.skipif(
    MISSING_TOOLCHAIN is not None, reason=f"MemoryTracker(source='allocator') needs {MISSING_TOOLCHAIN}"))
SOURCES = pytest.mark.parametrize("source", ["dispatch", ALLOCATOR])


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32, bias=False))


def nonzero(d):
    return {k: v for k, v in d.items() if v}


@SOURCES
def test_categories_exact_through_one_step(source):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    params = (64 * 128 + 128 * 32) * F32  # 49152
    with MemoryTracker(model, opt, source=source) as mt:
        assert nonzero(mt.current()) == {"params": params}
        x = torch.randn(16, 64)
        # Linear saves x (16x64), ReLU saves its output (16x128), square saves y (16x32);
        # the first Linear's output dies inside Sequential; the loss is a 4-byte scalar.
        loss = model(x).square().sum()
        acts = (16 * 64 + 16 * 128 + 16 * 32) * F32
        assert nonzero(mt.current()) == {"params": params, "activations": acts, "temporaries": F32}
        assert sum(mt.current().values()) == mt.live_bytes()
        loss.backward()
        # saved tensors released: x survives (held here) as a temporary, y and relu's output die
        assert nonzero(mt.current()) == {"params": params, "grads": params, "temporaries": 16 * 64 * F32 + F32}
        opt.step()
        # exp_avg + exp_avg_sq like each parameter, and a float32 "step" scalar per parameter
        assert nonzero(mt.current()) == {"params": params, "grads": params, "optimizer_state": 2 * params + 2 * F32,
                                         "temporaries": 16 * 64 * F32 + F32}
        assert sum(mt.current().values()) == mt.live_bytes()
    assert mt.max_by_category()["activations"] == acts
    assert sum(mt.peak().values()) == mt.peak_total() >= params * 3


@SOURCES
def test_peak_is_the_highest_moment_and_frees_are_seen(source):
    with MemoryTracker(source=source) as mt:
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a
        c = torch.empty(500)
        view = b[10:]  # a view shares b's storage: no new bytes
        assert mt.current()["temporaries"] == (2000 + 500) * F32
        del b
        assert mt.current()["temporaries"] == (2000 + 500) * F32  # the view keeps the storage alive
        del view
        assert mt.current()["temporaries"] == 500 * F32
    assert mt.peak()["temporaries"] == mt.peak_total() == 3000 * F32
    del c


@SOURCES
def test_optimizer_state_from_before_tracking_is_followed_to_its_end(source):
    """AdamW's state (two 256-float moments and a step counter per parameter) existed before the
    tracker started; dropped while it runs, its bytes leave. (The allocator never heard those
    blocks allocated, and on CPU it cannot report their free: the tracker watches them.)"""
    model = torch.nn.Linear(16, 16, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    with MemoryTracker(model, opt, source=source) as mt:
        assert mt.current()["optimizer_state"] == 2 * 256 * F32 + F32
        opt.state.clear()
        assert mt.current()["optimizer_state"] == 0
        assert mt.current()["params"] == 256 * F32


@SOURCES
def test_storage_resize_is_accounted(source):
    with MemoryTracker(source=source) as mt:
        t = torch.empty(1000)
        storage = t.untyped_storage()
        storage.resize_(0)  # how FSDP frees an unsharded parameter without dropping the tensor
        assert mt.current()["temporaries"] == 0
        storage.resize_(6000)
        assert mt.current()["temporaries"] == 6000
    assert mt.peak_total() == 6000


@SOURCES
def test_explicit_tags_and_scope_win(source):
    model = small_model()
    tags.tag(model[0].weight, "sharded_params")
    try:
        with MemoryTracker(model, source=source) as mt:
            buf = tags.tag(torch.empty(250), "comm_buffers")  # tagged after it was allocated
            with tags.tag_scope("quantized"):
                q = torch.empty(100, dtype=torch.uint8)
        assert mt.current()["sharded_params"] == 64 * 128 * F32
        assert mt.current()["params"] == 128 * 32 * F32
        assert mt.current()["comm_buffers"] == 1000
        assert mt.current()["quantized"] == 100
        # the buffer was a temporary for a moment; the peak counts it in its final role
        assert mt.peak()["comm_buffers"] == 1000 and mt.peak()["temporaries"] == 0
    finally:
        tags.untag(model[0].weight)
    del buf, q


@SOURCES
def test_an_untagged_storage_counts_as_an_untagged_one_from_then_on(source):
    with MemoryTracker(source=source) as mt:
        buf = tags.tag(torch.empty(250), "comm_buffers")
        tags.untag(buf)
        with tags.tag_scope("quantized"):
            codes = tags.tag(torch.empty(100, dtype=torch.uint8), "comm_buffers")
            tags.untag(codes)  # inside a scope: the scope's category, as a new storage there
    assert nonzero(mt.current()) == {"temporaries": 1000, "quantized": 100}
    del buf, codes


def test_tag_takes_only_a_tensor():
    with pytest.raises(TypeError, match="tag\\(\\) marks a tensor's storage; got list"):
        tags.tag([1, 2], "grads")


@SOURCES
def test_a_tracker_that_has_not_run_has_no_results_to_give(source):
    mt = MemoryTracker(small_model(), source=source)
    for read in (mt.peak, mt.peak_total, mt.current, mt.max_by_category, mt.timeline, mt.result):
        with pytest.raises(RuntimeError, match="has not measured anything yet: run the step inside `with"):
            read()  # zeros labelled "start" before, as if a step had used no memory


@SOURCES
def test_entering_a_running_tracker_again_is_refused_and_leaves_it_running(source):
    model = small_model()
    before = torch.UntypedStorage.resize_
    with MemoryTracker(model, source=source) as mt:
        with pytest.raises(RuntimeError, match="already running: .* make a second MemoryTracker"):
            with mt:
                pass
        model(torch.randn(4, 64)).sum().backward()
    # the running measurement went on, and leaving undid everything entering did
    assert mt.current()["grads"] == (64 * 128 + 128 * 32) * F32
    assert torch.UntypedStorage.resize_ is before and not tags._listeners
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with MemoryTracker(model, source=source) as again:  # a new tracker (and the profiler) work after
        model(torch.randn(4, 64)).sum().backward()
    assert again.peak_total() > 0
    with torch.profiler.profile(profile_memory=True):
        torch.ones(3)


@SOURCES
@pytest.mark.parametrize("batch_made", ["before tracking", "inside the step"])
def test_saved_batch_counts_as_activations_wherever_it_was_made(batch_made, source):
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0)
    tokens = 2 * 16
    made_before = global_batch(model.config.vocab_size, 2, 16)
    with MemoryTracker(model, source=source) as mt:
        batch = made_before if batch_made == "before tracking" else global_batch(model.config.vocab_size, 2, 16)

        def category(t):
            if source == "dispatch":
                return mt._live[t.untyped_storage()._cdata].category
            return mt._category_at(t.untyped_storage().data_ptr())  # the allocator's are keyed by address

        out = model(batch)
        # the embedding saves the input ids, the loss its labels: 8 bytes a token each
        assert batch.input_ids.nbytes == batch.labels.nbytes == 8 * tokens
        assert category(batch.input_ids) == category(batch.labels) == "activations"
        # RoPE's tables are saved by its multiplications but stay the model's buffers
        assert all(category(b) == "other" for b in model.buffers())
        out.loss.backward()
        released = "other" if batch_made == "before tracking" else "temporaries"
        assert category(batch.input_ids) == category(batch.labels) == released


@SOURCES
def test_timeline_has_phase_boundaries(source):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryTracker(model, opt, source=source) as mt:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    labels = [label for label, _ in mt.timeline()]
    for expected in ("start", "forward 0 start", "forward 2 end", "backward 2 start", "backward 1 end",
                     "optimizer step start", "optimizer step end", "end"):
        assert expected in labels
    assert labels.index("forward 2 end") < labels.index("backward 2 start") < labels.index("optimizer step end")
    for _, snap in mt.timeline():
        assert set(snap) == set(CATEGORIES)


@SOURCES
def test_backward_phases_end_before_the_module_before_them_starts(source):
    # one gradient ends a module's backward and starts the one before it: the end comes first
    # (written by hand from the model's order); a module that returns a dict gets its start too
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.dec(self.enc(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x):
            return {"hidden": self.inner(x)}

    model = Halves()
    model.enc = nn.Sequential(Encoder())
    model.enc.forward = lambda x: model.enc[0](x)["hidden"]
    with MemoryTracker(model, source=source, phase_modules=["enc.0", "dec"]) as mt:
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    backward = [label for label, _ in mt.timeline() if label.startswith("backward")]
    assert backward == ["backward dec start", "backward dec end", "backward enc.0 start", "backward enc.0 end"]


def test_bad_phase_module_is_named():
    with pytest.raises(ValueError, match="nope"):
        MemoryTracker(small_model(), phase_modules=["nope"])
    with pytest.raises(ValueError, match=r"phase_modules \['block'\] are not submodules"):  # not its letters
        MemoryTracker(small_model(), phase_modules="block")
    model = small_model()
    with MemoryTracker(model, phase_modules="0") as mt:  # one name alone
        model(torch.randn(2, 64))
    assert [label for label, _ in mt.timeline()] == ["start", "forward 0 start", "forward 0 end", "end"]
    with pytest.raises(ValueError, match="device='meta'.* meta tensors hold no bytes"):
        MemoryTracker(small_model(), device="meta")
    with torch.device("meta"):
        on_meta = small_model()
    with pytest.raises(ValueError, match="the model's parameters are on the meta device.*to_empty"):
        MemoryTracker(on_meta)  # device left out: it came from the parameters


@SOURCES
def test_an_optimizer_in_the_model_s_place_is_named(source):
    model = small_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got AdamW \(an optimizer: pass "
                                        r"the model first, MemoryTracker\(model, optimizer"):
        MemoryTracker(opt, source=source)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got Linear"):
        MemoryTracker(model, model[0], source=source)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process that sees no GPU")
def test_cuda_device_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="sees no CUDA GPU.*leave device out.*device='cpu'"):
        MemoryTracker(small_model(), device="cuda")


def test_result_pickles_and_merges():
    with MemoryTracker() as mt:
        keep = torch.empty(10)
    r0 = mt.result()
    r1 = pickle.loads(pickle.dumps(r0))
    r1.rank = 1
    r1.peak = dict(r1.peak, comm_buffers=8)
    rows = merge_ranks([r1, r0])
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["total"] == 40 and rows[1]["total"] == 48
    assert "comm_buffers" in format_rows(rows, unit="B")
    with pytest.raises(ValueError):
        merge_ranks([r0], which="mean")
    assert isinstance(r1, MemoryResult)
    del keep


def test_fake_tensors_are_measured_without_memory():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Linear(4096, 4096, bias=False)
        with MemoryTracker(model) as mt:
            out = model(torch.randn(8, 4096)).sum()
    assert mt.current()["params"] == 4096 * 4096 * F32
    assert mt.current()["activations"] == 8 * 4096 * F32  # the input, saved by Linear
    del out


def test_tags_set_while_tracking_fake_tensors_count_as_on_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run():  # a fake tensor's storage is on "meta": its tag must still reach the tracker
        with MemoryTracker() as mt:
            a = tags.tag(torch.empty(1000), "comm_buffers")
            b = tags.tag(torch.empty(500), "sharded_grads")
            c = torch.empty(250)
        return nonzero(mt.current()), (a, b, c)

    real, _ = run()
    with FakeTensorMode():
        fake, _ = run()
    assert real == fake == {"comm_buffers": 4000, "sharded_grads": 2000, "temporaries": 1000}


@pytest.mark.gpu
def test_cuda_allocator_stats():
    model = small_model().cuda()
    with MemoryTracker(model) as mt:
        model(torch.randn(16, 64, device="cuda")).sum().backward()
    result = mt.result()
    assert result.cuda["max_allocated"] >= mt.peak_total() > 0
    assert result.cuda["untracked_at_peak"] == result.cuda["max_allocated"] - mt.peak_total()
    assert mt.current()["grads"] == (64 * 128 + 128 * 32) * F32


def test_cuda_stats_reads_the_counters_torch_cuda_reads(monkeypatch):
    """``cuda_stats`` reads one statistics dictionary; each figure is the one torch.cuda's own
    ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved`` and ``max_memory_reserved``
    give from that same dictionary (runs without a GPU: the allocator's dictionary is stood in)."""
    from fsdp_lab.memory.results import cuda_stats
    stats = {"allocated_bytes.all.current": 1000, "allocated_bytes.all.peak": 5000,
             "reserved_bytes.all.current": 2048, "reserved_bytes.all.peak": 8192,
             "allocated_bytes.small_pool.peak": 7, "num_alloc_retries": 3}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda.memory, "memory_stats", lambda device=None: dict(stats))
    ours = cuda_stats(torch.device("cuda", 0), tracked_peak=4096)
    assert ours == {"allocated": torch.cuda.memory_allocated(0),
                    "max_allocated": torch.cuda.max_memory_allocated(0),
                    "reserved": torch.cuda.memory_reserved(0),
                    "max_reserved": torch.cuda.max_memory_reserved(0),
                    "num_alloc_retries": 3, "untracked_at_peak": 5000 - 4096}
    assert ours["max_allocated"] == 5000 and ours["reserved"] == 2048


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch.compile's
def test_a_compiled_function_under_the_tracker_runs_through_it():
    """A ``torch.compile``d function called while tracking gives eager's values, and the tracker
    still sees each of its ops' outputs (relu's, then the product's)."""
    def relu_twice(x):
        return torch.relu(x) * 2

    compiled = torch.compile(relu_twice)
    x = torch.randn(256)
    with MemoryTracker() as mt:
        out = compiled(x)
    assert torch.equal(out, relu_twice(x))
    # relu's output (256 floats) dies after the multiplication made the output (256 floats)
    assert mt.peak()["temporaries"] == 2 * 256 * F32
    assert mt.current()["temporaries"] == 256 * F32


@SOURCES
def test_tracking_does_not_change_gradients(source):
    """Saved tensors pass through the tracker's hooks: backward must give the same gradients."""
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama, apply_activation_checkpointing

    batch = global_batch(512, 2, 16)
    grads = []
    for tracked in (False, True):
        model = apply_activation_checkpointing(Llama("cpu", seed=0))
        model.layers[0].checkpoint_activations = False  # one plain block, the rest checkpointed
        if tracked:
            with MemoryTracker(model, source=source):
                model(batch).loss.backward()
        else:
            model(batch).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, tracked in zip(*grads):
        torch.testing.assert_close(tracked, plain, rtol=0, atol=0)


@SOURCES
def test_peak_categories_do_not_depend_on_reused_addresses(source):
    """A temporary alive at the peak and freed before backward must not turn into a gradient in
    ``peak()`` because a later gradient's storage happens to reuse its address."""
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    for _ in range(8):  # the allocator reuses addresses most of the time, not always
        model = Llama("cpu", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        batch = global_batch(model.config.vocab_size, 4, 128)
        for tracked in (False, True):  # the first step creates AdamW's state
            with MemoryTracker(model, opt, source=source) if tracked else contextlib.nullcontext() as mt:
                model(batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert mt.result().peak_label.startswith("forward")  # activations peak before any gradient
        assert mt.peak()["grads"] == 0


def _owned_case(name: str):
    """A sharded model, its optimizer and one step (``name``: fsdp1/fsdp2, optionally +offload)."""
    from fsdp_lab.models.llama import Llama, TransformerBlock

    model = Llama("cpu", seed=0)
    if name.startswith("fsdp2"):
        from fsdp_lab.fsdp2 import CPUOffloadPolicy, OffloadPolicy, fully_shard
        policy = CPUOffloadPolicy(pin_memory=False) if "offload" in name else OffloadPolicy()
        for block in model.layers:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    else:
        from fsdp_lab.fsdp1 import CPUOffload, FullyShardedDataParallel, ModuleWrapPolicy
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                         cpu_offload=CPUOffload(offload_params="offload" in name))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _tracked_step(model, opt):
    from fsdp_lab.models.data import global_batch

    def step(i):
        batch = global_batch(model.config.vocab_size, 2, 32, seed=torch.distributed.get_rank(), step=i)
        model(batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    with MemoryTracker(model, opt) as mt:
        step(1)
    return mt.result()


def _rank_owned_storages_only(names):
    """Each case measured first, then again after every case was built, stepped and dropped while
    kept alive by a reference cycle (collector off), with another sharded model alive meanwhile."""
    import gc

    def measure(name):
        model, opt = _owned_case(name)
        r = _tracked_step(model, opt)
        return r.peak, r.peak_total, r.current

    first = {name: measure(name) for name in names}
    gc.collect()
    gc.disable()
    try:
        for name in names:  # dropped, but held by a cycle until the collector runs
            model, opt = _owned_case(name)
            _tracked_step(model, opt)
            model._kept_alive_by = (model, opt)
            del model, opt
        alive, alive_opt = _owned_case(names[0])  # another model, alive while we measure
        _tracked_step(alive, alive_opt)
        again = {name: measure(name) for name in names}
    finally:
        gc.enable()
    return first, again


def test_tracker_counts_only_the_tracked_models_storages():
    """FSDP1 and FSDP2, with and without CPU offload, on 2 ranks: the per-category bytes (peak
    and at the end) equal those of the same run before any other model existed."""
    from fsdp_lab import launch

    names = ["fsdp2", "fsdp2+offload", "fsdp1", "fsdp1+offload"]
    for rank, (first, again) in enumerate(launch(_rank_owned_storages_only, names, world_size=2, timeout=300)):
        for name in names:
            assert again[name] == first[name], f"rank {rank}, {name}: {again[name]} != {first[name]}"


def _warmed_step(model, opt, batch):
    """``step()``: forward, backward and the optimizer on ``batch``, run once already, so the
    optimizer state exists, as in every later step."""
    def step():
        model(batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


def _llama_step(batch_size, seq_len):
    """The CPU Llama, AdamW (one tensor at a time), a batch, and its warmed-up ``step``."""
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batch = global_batch(model.config.vocab_size, batch_size, seq_len)
    return model, opt, batch, _warmed_step(model, opt, batch)


@pytest.mark.parametrize("batch_size, seq_len", [(4, 64), (1, 4)], ids=["activations-bound", "optimizer-bound"])
def test_peak_matches_pytorchs_own_mem_tracker(batch_size, seq_len):
    """PyTorch's MemTracker (torch.distributed._tools) is an independent implementation: the peak
    of the same training step is the same number of bytes, and so are its parameters and
    gradients. Their other categories are drawn differently: PyTorch's "activations" are whatever
    forward allocates (ours: what autograd saved) and its "optimizer states" include what AdamW's
    step allocates (ours: temporaries), so only their sum agrees (it follows from the two totals)."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    model, opt, batch, step = _llama_step(batch_size, seq_len)
    reference = mem_tracker.MemTracker()
    reference.track_external(model, opt, batch.input_ids, batch.labels)  # we count the batch too
    with reference:
        step()
    theirs = {getattr(k, "name", k): v for k, v in reference.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    with MemoryTracker(model, opt) as tracker:
        step()
    ours = tracker.peak()
    assert tracker.peak_total() == theirs["Total"]
    assert ours["params"] == theirs["PARAM"] and ours["grads"] == theirs["GRAD"]
    assert ours["optimizer_state"] <= theirs["OPT"]


@SOURCES
def test_a_dropped_tracker_and_model_free_the_models_storages_without_the_collector(source):
    """The tracker holds its model; nothing may hold the tracker in a cycle after it exits, or
    dropping both keeps the model's memory until the garbage collector runs."""
    import gc
    import weakref

    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    def tracked_then_dropped():
        model = Llama("cpu", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = global_batch(model.config.vocab_size, 2, 16)
        for _ in range(2):  # the first step builds AdamW's state (and warms PyTorch's caches)
            with MemoryTracker(model, opt, source=source) as mt:
                model(batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert mt.peak_total() > 0
        storages = [p.untyped_storage() for p in model.parameters()]
        storages += [t.untyped_storage() for state in opt.state.values() for t in state.values()]
        refs = [weakref.ref(st) for st in storages]
        del model, opt, batch, mt, storages
        return refs

    tracked_then_dropped()
    gc.collect()
    gc.disable()
    try:
        refs = tracked_then_dropped()
        assert sum(r() is not None for r in refs) == 0
    finally:
        gc.enable()


def test_fsdp2_gradients_are_unsharded_grads_from_the_moment_autograd_writes_them():
    # the root's gradient waits for the root's post-backward at the end of backward, a block's for
    # its own; before, a tracker's timeline filed both as temporaries until then (FSDP1 tags on arrival)
    import fsdp_lab
    from fsdp_lab.fsdp2 import fully_shard

    width = 128
    block_bytes = (width * width + width) * F32  # a Linear's weight and bias, whole

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
            self.head = nn.Linear(width, width)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with fsdp_lab.simulated_world(2):
        torch.manual_seed(0)
        model = Net()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, width)
        for tracked in (False, True):
            with MemoryTracker(model, opt) if tracked else contextlib.nullcontext() as mt:
                model(x).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    at = dict(mt.timeline())
    # the head (the root's) has run its backward; no block has: its gradient alone, whole
    assert at["backward layers.2 start"]["unsharded_grads"] == block_bytes
    # while the blocks run backward, the root's whole gradient stays beside theirs
    backward = [snap["unsharded_grads"] for label, snap in mt.timeline() if label.startswith("backward layers")]
    assert min(backward) >= block_bytes and max(backward) >= 2 * block_bytes
    assert at["optimizer step start"]["unsharded_grads"] == 0  # every one reduced by then
