"""AutoMicrobatch: OOM agreement without deadlocks, on real gloo ranks.

One launch per world size runs every case and returns a dict (see ``_cases``). The reference
is a hand-written fixed-microbatch loop on a fresh model (no AutoMicrobatch involved):
a finished step must give the same parameters to float32 round-off.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

B, SEQ, BUDGET_SEQ = 8, 32, 64  # samples per rank per step; sequence lengths
STEPS = 2
TOL = 1e-6
CHECKED = ("unsharded_params", "comm_buffers", "unsharded_grads", "activations", "sharded_grads")
# (point, occurrences to let through first): each lands mid-step on the failing rank
POINTS = {"pre_forward": 1, "pre_backward": 1, "post_backward": 1, "optimizer_step": 0}


def _setup(seed=0, impl="fsdp2"):
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=seed)
    if impl == "fsdp1":
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
        from fsdp_lab.models.llama import TransformerBlock
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    else:
        import fsdp_lab.fsdp2 as fsdp2
        for layer in model.layers:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)


def _batch(step, seq=SEQ):
    import torch.distributed as dist
    r, w = dist.get_rank(), dist.get_world_size()
    return shard_batch(global_batch(512, B * w, seq, step=step), r, w)


def _full_params(model):
    """Full parameters by original name, whichever FSDP holds them."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _max_diff(model, ref):
    got = _full_params(model)
    return max((got[n] - ref[n]).abs().max().item() for n in ref)


def _inject_run(point, skip, fail_rank, ref, impl):
    from fsdp_lab.automicrobatch import AutoMicrobatch
    from fsdp_lab.oom import inject_oom, memory_budget
    model, opt = _setup(impl=impl)
    with memory_budget(None, model=model, optimizer=opt) as tracker:
        amb = AutoMicrobatch(model, opt, B)
        handle = inject_oom(point, rank=fail_rank, skip=skip) if point else None
        results = [amb.train_step(_batch(step)) for step in range(STEPS)]
        if handle is not None:
            handle.remove()
        amb.close()
        current = tracker.current()
    start = tracker.timeline()[0][1]
    return {"start": start, "sizes": [r.microbatch_size for r in results], "retries": [r.retries for r in results],
            "diff": _max_diff(model, ref), "current": current,
            "events": [(h["event"], h.get("this_rank")) for h in amb.history]}


def _errors(fail_rank):
    from fsdp_lab.automicrobatch import AutoMicrobatch, MicrobatchSearchError
    from fsdp_lab.oom import inject_oom, memory_budget
    out = {}
    for name, kwargs in (("not_divisible", dict(min_microbatch=3)), ("at_one", dict(start=1))):
        model, opt = _setup()
        with memory_budget(None, model=model, optimizer=opt):
            amb = AutoMicrobatch(model, opt, B, **kwargs)
            handle = inject_oom("pre_backward", rank=fail_rank, count=100)
            try:
                amb.train_step(_batch(0))
                out[name] = "no error"
            except MicrobatchSearchError as error:
                out[name] = str(error)
            handle.remove()
            amb.close()
    return out


def _budget(fail_rank):
    """A real, asymmetric OOM: only ``fail_rank`` has a budget, between the peaks of microbatch 4 and 8."""
    from fsdp_lab.automicrobatch import AutoMicrobatch
    from fsdp_lab.oom import memory_budget
    peaks = {}
    for size in (8, 4):
        model, opt = _setup()
        amb = AutoMicrobatch(model, opt, B, start=size)
        amb.train_step(_batch(0, BUDGET_SEQ))
        amb.close()
        with memory_budget(None, model=model, optimizer=opt) as tracker:
            amb.train_step(_batch(1, BUDGET_SEQ))
        peaks[size] = tracker.peak_total()
    budget = (peaks[8] + peaks[4]) // 2
    model, opt = _setup()
    with memory_budget(budget, rank=fail_rank, model=model, optimizer=opt) as tracker:
        amb = AutoMicrobatch(model, opt, B)
        sizes = [amb.train_step(_batch(step, BUDGET_SEQ)).microbatch_size for step in range(STEPS)]
        amb.close()
    return {"peaks": peaks, "sizes": sizes, "failures": tracker.failures, "failed_at": tracker.failed_at,
            "events": [(h["event"], h.get("this_rank")) for h in amb.history]}


def _hooks_and_thrashing(fail_rank):
    import fsdp_lab.automicrobatch as am
    from fsdp_lab import sync_points
    out = {}
    model, opt = _setup()
    amb = am.AutoMicrobatch(model, opt, B)
    out["hooks"] = []
    for step in range(4):
        amb.train_step(_batch(step))
        out["hooks"].append((amb.hooks_installed, len(sync_points._callbacks)))
    amb.after_eval()
    out["after_eval"] = amb.hooks_installed
    # thrashing: allocator retries grow on fail_rank only (as torch.cuda.memory_stats would show)
    import torch.distributed as dist
    counter = iter(range(100))
    original = am._alloc_retries
    am._alloc_retries = lambda device: next(counter) if dist.get_rank() == fail_rank else 0
    try:
        model, opt = _setup()
        amb = am.AutoMicrobatch(model, opt, B)
        out["thrash_sizes"] = [amb.train_step(_batch(step)).microbatch_size for step in range(4)]
        out["thrash_events"] = [h["event"] for h in amb.history]
    finally:
        am._alloc_retries = original
    amb.remove_hooks()
    return out


def _cases(fail_rank, points, extras, impl="fsdp2"):
    from fsdp_lab.automicrobatch import split_batch
    ref_model, ref_opt = _setup(impl=impl)
    for step in range(STEPS):  # the reference: a fixed microbatch of 4, written out by hand
        batch = _batch(step)
        for begin in range(0, B, 4):
            (ref_model(split_batch(batch, begin, begin + 4)).loss * (4 / B)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = _full_params(ref_model)
    out = {point: _inject_run(point, POINTS[point], fail_rank, ref, impl) for point in points}
    out["clean"] = _inject_run(None, 0, fail_rank, ref, impl)
    if extras:
        out["errors"] = _errors(fail_rank)
        out["budget"] = _budget(fail_rank)
        out.update(_hooks_and_thrashing(fail_rank))
    return out


def _hang_without_hooks(fail_rank):
    from fsdp_lab.automicrobatch import AutoMicrobatch
    from fsdp_lab.oom import inject_oom
    model, opt = _setup()
    amb = AutoMicrobatch(model, opt, B)
    amb.remove_hooks()
    inject_oom("pre_backward", rank=fail_rank, skip=1)
    amb.train_step(_batch(0))
    return "finished"


def _protocol_invariants():
    """What keeps a rank that ran out of memory from hanging its peers: nothing on one rank may
    fail, or issue a collective of its own, between a sync point and FSDP's collective."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab import collectives, oom, process_group, sync_points
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    rank, out = dist.get_rank(), {}
    # the backend check before a first reduction in a dtype involves no other rank
    if rank == 1:
        process_group.ensure_reducible(torch.bfloat16, dist.group.WORLD)
    total = torch.tensor([float(rank + 1)])
    collectives.all_reduce(total)
    out["sum"] = total.item()
    # the ranks' flags are host memory, not the emulated device's: a budget cannot fail them
    with oom.memory_budget(1, rank=1):
        out["agreed"] = oom.agree(rank == 1)
    # no allocation between a collective's sync point and the collective being issued (FSDP's
    # calls return once it is issued): the collective's own buffers come before the point
    armed = {}

    def at_point(point, module):
        if point in sync_points.COLLECTIVE_POINTS:
            armed["point"] = f"{point} {module}"

    def disarming(collective):
        def call(*args, **kwargs):
            try:
                return collective(*args, **kwargs)
            finally:
                armed.clear()
        return call

    class Watch(MemoryTracker):
        def _add(self, info, nbytes):
            super()._add(info, nbytes)
            if armed and nbytes > 0:
                out[impl].append(armed["point"])

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
        setattr(collectives, name, disarming(getattr(collectives, name)))  # this rank's copy only

    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for impl in ("fsdp2", "fsdp1", "fsdp2 hsdp"):
        if impl == "fsdp2 hsdp":
            model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
            for layer in model.layers:
                fully_shard(layer, mesh=hsdp)
            model, opt = fully_shard(model, mesh=hsdp), None
        else:
            model, opt = _setup(impl=impl)
        out[impl] = []
        handle = sync_points.register(at_point)
        try:
            with Watch(model, opt):
                model(_batch(0)).loss.backward()
        finally:
            handle.remove()
            armed.clear()
    return out


def test_no_rank_can_fail_or_act_alone_between_a_sync_point_and_its_collective():
    results = fsdp_lab.launch(_protocol_invariants, world_size=2, timeout=150)
    for out in results:
        assert out["sum"] == 3.0  # rank 1's dtype check took no part in it
        assert out["agreed"] is True
        assert out["fsdp2"] == out["fsdp1"] == out["fsdp2 hsdp"] == []


@pytest.fixture(scope="module")
def two():
    return fsdp_lab.launch(_cases, 1, tuple(POINTS), True, world_size=2, timeout=150)


@pytest.fixture(scope="module")
def four():
    return fsdp_lab.launch(_cases, 2, ("pre_backward", "post_backward"), False, world_size=4, timeout=150)


@pytest.fixture(scope="module")
def two_fsdp1():
    return fsdp_lab.launch(_cases, 1, tuple(POINTS), False, "fsdp1", world_size=2, timeout=150)


@pytest.fixture(params=["fsdp2", "fsdp1"])
def both(request, two, two_fsdp1):
    return two if request.param == "fsdp2" else two_fsdp1


@pytest.mark.parametrize("point", list(POINTS))
def test_injected_oom_recovers_with_same_microbatch_on_all_ranks(both, point):
    for rank, out in enumerate(both):
        assert out[point]["sizes"] == [4, 4], (rank, out[point])
        assert out[point]["retries"] == [1, 0]
        assert ("oom", rank == 1) in out[point]["events"]


@pytest.mark.parametrize("point", list(POINTS))
def test_finished_step_equals_fixed_microbatch(both, point):
    for out in both:
        assert out[point]["diff"] < TOL


@pytest.mark.parametrize("point", list(POINTS))
def test_no_leaked_memory_after_recovery(both, point):
    for out in both:
        current, clean = out[point]["current"], out["clean"]["current"]
        for category in CHECKED:
            assert current[category] == 0, (category, current)
        assert current["sharded_params"] == out[point]["start"]["sharded_params"] > 0  # the sharded baseline
        assert current["optimizer_state"] == clean["optimizer_state"] > 0


def test_clean_run_keeps_the_whole_batch(both):
    for out in both:
        assert out["clean"]["sizes"] == [8, 8] and out["clean"]["retries"] == [0, 0]
        assert out["clean"]["diff"] < TOL  # the loss weighting makes microbatch 8 and 2 x 4 the same step


@pytest.mark.parametrize("point", ["pre_backward", "post_backward"])
def test_four_ranks(four, point):
    for rank, out in enumerate(four):
        assert out[point]["sizes"] == [4, 4]
        assert out[point]["diff"] < TOL
        assert ("oom", rank == 2) in out[point]["events"]
        assert all(out[point]["current"][c] == 0 for c in CHECKED)


def test_emulated_budget_asymmetric_oom(two):
    rank0, rank1 = two[0]["budget"], two[1]["budget"]
    assert rank0["peaks"][8] > rank0["peaks"][4]
    assert rank0["sizes"] == rank1["sizes"] == [4, 4]
    assert rank0["failures"] == 0 and rank1["failures"] >= 1
    assert ("oom", True) in rank1["events"] and ("oom", False) in rank0["events"]


def test_not_divisible_error_names_smallest_size(two):
    for out in two:
        message = out["errors"]["not_divisible"]
        assert "not divisible" in message and "smallest size tried 4" in message, message


def test_oom_at_microbatch_one_shows_breakdown(two):
    message = two[1]["errors"]["at_one"]
    assert "microbatch size 1" in message and "sharded_params" in message  # the breakdown at the failure
    assert "microbatch size 1" in two[0]["errors"]["at_one"]


def test_hooks_removed_after_three_clean_steps_and_back_after_eval(two):
    for out in two:
        assert out["hooks"] == [(True, 1), (True, 1), (False, 0), (False, 0)]
        assert out["after_eval"] is True


def test_thrashing_steps_down_on_all_ranks(two):
    for out in two:
        # retries grow at steps 2 and 3 on rank 1 only: after step 3 every rank halves
        assert out["thrash_sizes"] == [8, 8, 8, 4]
        assert "thrashing" in out["thrash_events"]


def test_without_sync_hooks_an_asymmetric_oom_hangs():
    with pytest.raises(fsdp_lab.LaunchTimeout) as info:
        fsdp_lab.launch(_hang_without_hooks, 1, world_size=2, timeout=20)
    message = str(info.value)
    assert "all_gather" in message and "oom_sync" in message, message
    assert message.startswith("deadlock:"), "seen as a deadlock, not left to the timeout"


def test_bad_arguments():
    from fsdp_lab.automicrobatch import AutoMicrobatch
    from fsdp_lab.oom import memory_budget
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="start"):
        AutoMicrobatch(model, opt, 8, start=16)
    with pytest.raises(ValueError, match="divides"):
        AutoMicrobatch(model, opt, 7, start=6, min_microbatch=2)
    with pytest.raises(TypeError, match="detect_thrashing must be True or False, got 'no'"):
        AutoMicrobatch(model, opt, 8, detect_thrashing="no")
    with pytest.raises(ValueError, match="stable_steps must be a positive int, got 0"):
        AutoMicrobatch(model, opt, 8, stable_steps=0)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got SGD \(an optimizer: pass the model first"):
        AutoMicrobatch(opt, model, 8)
    with pytest.raises(TypeError, match="AutoMicrobatch needs a model and an optimizer, got model=Linear, optimizer=NoneType"):
        AutoMicrobatch(model, None, 8)
    with pytest.raises(ValueError, match="positive"):
        with memory_budget(0):
            pass


def test_budget_raises_cuda_oom_type_in_one_process():
    from fsdp_lab.oom import memory_budget
    with pytest.raises(torch.OutOfMemoryError, match="budget"):
        with memory_budget(1 << 20):
            torch.zeros(1 << 19)  # 2 MiB of float32
    with memory_budget(None) as tracker:  # tracking only
        torch.zeros(1 << 19)
    assert tracker.failures == 0
