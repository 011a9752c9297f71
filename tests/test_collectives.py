"""fsdp_lab.collectives on real gloo process groups, checked against values worked by hand."""

import pytest
import torch

import fsdp_lab
from fsdp_lab import bandwidth, collectives
from fsdp_lab.timeline import Timeline

K = 6  # elements per rank chunk


def _collective_checks():
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    seen = [collectives.last_entered()]
    out = {}
    with Timeline() as tl:
        x = torch.arange(K, dtype=torch.float32) + 100 * rank
        gathered = torch.empty(K * n)
        collectives.all_gather_into_tensor(gathered, x)
        seen.append(collectives.last_entered())
        out["all_gather"] = gathered

        full = torch.arange(K * n, dtype=torch.float32) * (rank + 1)
        for op in ("sum", "avg", "max", "min"):
            shard = torch.empty(K)
            collectives.reduce_scatter_tensor(shard, full, op=op)
            out[f"reduce_scatter_{op}"] = shard

        shard = torch.empty(K)
        handle = collectives.reduce_scatter_tensor(shard, full, async_op=True)
        handle.wait()
        out["reduce_scatter_async"] = shard

        bf = torch.empty(K, dtype=torch.bfloat16)
        collectives.reduce_scatter_tensor(bf, full.to(torch.bfloat16))
        seen.append(collectives.last_entered())
        out["reduce_scatter_bf16"] = bf

        for op in ("sum", "avg", "max"):
            t = torch.full((3,), float(rank + 1))
            collectives.all_reduce(t, op=op)
            out[f"all_reduce_{op}"] = t

        b = torch.full((4,), float(rank))
        h = collectives.broadcast(b, src=n - 1, async_op=True)
        h.wait()
        out["broadcast"] = b
    try:
        collectives.all_gather_into_tensor(torch.empty(K * n + 1), x)
    except ValueError as e:
        out["size_error"] = str(e)
    seen.append(collectives.last_entered())
    block = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    for shape in ((6 * n,), (n, 2, 3), (2 * n, 3)):  # flat, stacked, concatenated: NCCL takes each
        into = torch.empty(shape)
        collectives.all_gather_into_tensor(into, block)
        out[f"all_gather_into {shape}"] = into
    scalars = torch.empty(n)
    collectives.all_gather_into_tensor(scalars, torch.tensor(float(rank)))
    out["all_gather_0d"] = scalars
    try:
        collectives.all_gather_into_tensor(torch.empty(3, 2 * n).t(), block)
    except ValueError as e:
        out["contiguous_error"] = str(e)
    for op in ("sum", "avg"):  # in place on gloo: the input is scratch and no receive buffer is made
        shard, scratch = torch.empty(K), full.clone()
        collectives.reduce_scatter_tensor(shard, scratch, op=op, async_op=True, input_is_scratch=True).wait()
        out[f"reduce_scatter_scratch_{op}"] = shard
    out["events"] = [(e.name, e.bytes, e.args.get("impl"), e.args.get("dtype")) for e in tl.comm_events()]
    out["seen"] = seen
    out["recorded"] = _nested_recorders()
    out.update(_subgroup_checks(rank, n))
    out.update(_checks_torch_does_itself(rank))
    return out


def _subgroup_checks(rank: int, n: int) -> dict:
    """Collectives on a group of ranks 1..n-1: a broadcast's ``src`` is a global rank, and on
    rank 0, outside the group, every collective is refused with a clear error."""
    import torch.distributed as dist

    group = dist.new_group(ranks=list(range(1, n)))  # every rank takes part in making it
    t = torch.full((2,), float(rank))
    if rank == 0:
        errors = []
        for call in (lambda: collectives.broadcast(t, src=n - 1, group=group),
                     lambda: collectives.all_reduce(t, group=group),
                     lambda: collectives.all_gather_into_tensor(torch.empty(2 * (n - 1)), t, group=group)):
            try:
                call()
            except ValueError as e:
                errors.append(str(e))
        return {"subgroup_errors": errors}
    gathered = torch.empty(2 * (n - 1))
    collectives.all_gather_into_tensor(gathered, t, group=group)
    summed = t.clone()
    collectives.all_reduce(summed, group=group)
    collectives.broadcast(t, src=n - 1, group=group)
    return {"subgroup": (gathered, summed, t)}


class _SeenFunctions(torch.overrides.TorchFunctionMode):
    """Notes the name of every function called while it is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _checks_torch_does_itself(rank: int) -> dict:
    """Cases torch.distributed's functions handle beyond calling the process group: complex
    tensors (sent as real pairs) and a ``__torch_function__`` mode (handed each call)."""
    z = torch.tensor([complex(rank + 1, -rank), complex(0, rank)])
    gathered = torch.empty(2 * torch.distributed.get_world_size(), dtype=torch.complex64)
    collectives.all_gather_into_tensor(gathered, z)
    collectives.all_reduce(z)
    with _SeenFunctions() as seen:
        t = torch.full((2,), float(rank + 1))
        collectives.all_reduce(t, op="max")
    with _SeenFunctions() as seen_by_torch:  # torch >= 2.8 hands it its collectives (2.6 not)
        torch.distributed.all_reduce(torch.ones(2))
    handed = ["all_reduce" in names for names in (seen.names, seen_by_torch.names)]
    return {"complex": (gathered, z), "mode": (handed, t)}


class _ListRecorder:
    """The smallest recorder: any object with mark(), record_comm() and open_comm()."""

    def __init__(self):
        self.events = []

    def mark(self):
        return "start"

    def record_comm(self, start, name, nbytes, *, lane, **args):
        self.events.append((start, name, nbytes, lane, args["group_size"], args["module"]))

    def open_comm(self, start, name, nbytes, *, lane, **args):
        recorder = self

        class Event:
            def close_on_completion(self, works):
                pass

            def close(self):
                recorder.events.append((start, name, nbytes, lane, args["group_size"], args["module"]))

        return Event()


def _nested_recorders():
    outer, inner = _ListRecorder(), _ListRecorder()
    t = torch.ones(2)
    collectives.add_recorder(outer)
    collectives.all_reduce(t, meta={"module": "a"})
    collectives.add_recorder(inner)
    collectives.all_reduce(t, meta={"module": "b"}, lane="grads")
    collectives.remove_recorder(inner)
    collectives.all_reduce(t, meta={"module": "c"}, async_op=True).wait()
    collectives.remove_recorder(outer)
    collectives.all_reduce(t, meta={"module": "d"})  # nobody records this one
    return outer.events, inner.events


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    n = request.param
    return n, fsdp_lab.launch(_collective_checks, world_size=n, timeout=120)


def test_all_gather_concatenates_in_rank_order(results):
    n, per_rank = results
    expected = torch.cat([torch.arange(K, dtype=torch.float32) + 100 * r for r in range(n)])
    for out in per_rank:
        assert torch.equal(out["all_gather"], expected)


def test_all_gather_takes_any_output_shape_of_the_right_size(results):
    n, per_rank = results
    expected = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r for r in range(n)])
    for out in per_rank:
        for shape in ((6 * n,), (n, 2, 3), (2 * n, 3)):
            gathered = out[f"all_gather_into {shape}"]
            assert gathered.shape == shape and torch.equal(gathered.reshape(2 * n, 3), expected)
        assert torch.equal(out["all_gather_0d"], torch.arange(n, dtype=torch.float32))
        assert "output is not contiguous" in out["contiguous_error"]


def test_reduce_scatter_ops(results):
    n, per_rank = results
    base = torch.arange(K * n, dtype=torch.float32)
    factors = torch.arange(1, n + 1, dtype=torch.float32)  # rank r sent base * (r + 1)
    for r, out in enumerate(per_rank):
        chunk = base[r * K:(r + 1) * K]
        assert torch.equal(out["reduce_scatter_sum"], chunk * factors.sum())
        assert torch.allclose(out["reduce_scatter_avg"], chunk * factors.mean())
        assert torch.equal(out["reduce_scatter_max"], chunk * n)
        assert torch.equal(out["reduce_scatter_min"], chunk)
        assert torch.equal(out["reduce_scatter_async"], chunk * factors.sum())
        assert torch.equal(out["reduce_scatter_scratch_sum"], chunk * factors.sum())
        assert torch.allclose(out["reduce_scatter_scratch_avg"], chunk * factors.mean())
        assert out["reduce_scatter_bf16"].dtype == torch.bfloat16
        assert torch.allclose(out["reduce_scatter_bf16"].float(), chunk * factors.sum(), rtol=1e-2)


def test_all_reduce_and_broadcast(results):
    n, per_rank = results
    total = n * (n + 1) / 2
    for out in per_rank:
        assert torch.equal(out["all_reduce_sum"], torch.full((3,), total))
        assert torch.allclose(out["all_reduce_avg"], torch.full((3,), total / n))
        assert torch.equal(out["all_reduce_max"], torch.full((3,), float(n)))
        assert torch.equal(out["broadcast"], torch.full((4,), float(n - 1)))


def test_subgroups_take_global_ranks_and_refuse_outsiders(results):
    n, per_rank = results
    members = range(1, n)
    for r in members:
        gathered, summed, broadcast = per_rank[r]["subgroup"]
        assert torch.equal(gathered, torch.tensor([float(m) for m in members for _ in range(2)]))
        assert torch.equal(summed, torch.full((2,), float(sum(members))))
        assert torch.equal(broadcast, torch.full((2,), float(n - 1)))
    errors = per_rank[0]["subgroup_errors"]
    assert len(errors) == 3 and all("not a process group this rank belongs to" in e for e in errors)


def test_complex_tensors_and_function_modes_behave_as_in_torch(results):
    n, per_rank = results
    values = [torch.tensor([complex(r + 1, -r), complex(0, r)]) for r in range(n)]
    for out in per_rank:
        gathered, summed = out["complex"]
        assert torch.equal(gathered, torch.cat(values).to(torch.complex64))
        assert torch.equal(summed, sum(values).to(torch.complex64))
        (handed_ours, handed_torch), t = out["mode"]
        assert handed_ours == handed_torch  # the mode is handed the collective where torch hands it
        assert torch.equal(t, torch.full((2,), float(n)))


def test_size_mismatch_is_a_clear_error(results):
    _, per_rank = results
    assert "expected input.numel() * group size" in per_rank[0]["size_error"]


def test_timeline_events_count_bytes_like_nccl_tests(results):
    n, per_rank = results
    events = per_rank[0]["events"]
    names = [e[0] for e in events]
    assert names == ["all_gather"] + ["reduce_scatter"] * 6 + ["all_reduce"] * 3 + ["broadcast"]
    assert events[0][1] == K * n * 4            # all-gather: S = per-rank bytes x n
    assert events[1][1] == K * n * 4            # reduce-scatter: S = the full input
    assert events[1][2] == "all_to_all+local_sum"   # gloo's all-reduce emulation is not used
    assert events[6][1:] == (K * n * 2, "all_to_all+local_sum", "bfloat16")
    assert events[7][1] == 3 * 4                # all-reduce: S = the tensor
    assert events[-1][1] == 4 * 4


def test_last_entered_names_and_counts_each_collective(results):
    n, per_rank = results
    for out in per_rank:  # the hang report of fsdp_lab.launch shows these strings
        assert out["seen"] == ["none", f"all_gather #1 ({K * n * 4} B float32, group of {n})",
                               f"reduce_scatter #7 ({K * n * 2} B bfloat16, group of {n})",
                               f"broadcast #11 (16 B float32, group of {n})"]


def test_the_innermost_recorder_gets_each_event(results):
    n, per_rank = results
    outer, inner = per_rank[0]["recorded"]
    assert outer == [("start", "all_reduce", 8, "comm", n, "a"), ("start", "all_reduce", 8, "comm", n, "c")]
    assert inner == [("start", "all_reduce", 8, "grads", n, "b")]


def test_bus_bandwidth_matches_nccl_tests_formulas():
    # S = 8e9 bytes in 2 s on 4 ranks: algbw 4e9 B/s; busbw 3e9 (x3/4) or 6e9 (x2*3/4).
    assert bandwidth.bus_bandwidth("all_gather", 8e9, 2.0, 4) == (4e9, 3e9)
    assert bandwidth.bus_bandwidth("reduce_scatter", 8e9, 2.0, 4) == (4e9, 3e9)
    assert bandwidth.bus_bandwidth("all_reduce", 8e9, 2.0, 4) == (4e9, 6e9)
    assert bandwidth.bus_bandwidth("broadcast", 8e9, 2.0, 4) == (4e9, 4e9)
    with pytest.raises(ValueError, match="unknown collective"):
        bandwidth.bus_bandwidth("gather", 1, 1.0, 2)
    with pytest.raises(ValueError, match="positive"):
        bandwidth.bus_bandwidth("all_gather", 1, 0.0, 2)


def test_benchmark_rows():
    rows = bandwidth.benchmark(["all_gather", "all_reduce"], [1 << 16], world_size=2, iters=3, warmup=1)
    assert [r["op"] for r in rows] == ["all_gather", "all_reduce"]
    for r in rows:
        assert r["bytes"] == 1 << 16 and r["time_s"] > 0
        factor = 0.5 if r["op"] == "all_gather" else 1.0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
    with pytest.raises(ValueError, match="unknown collective"):
        bandwidth.benchmark("gather", [1024])


def test_each_simulated_world_is_its_own_group():
    """Groups are looked up once and kept while they live: a default group made again (a
    notebook that simulates 8 GPUs, then 4) is the new one, not the one remembered."""
    with fsdp_lab.simulated_world(world_size=8):
        collectives.all_reduce(torch.ones(2))
        assert collectives.last_entered().endswith("group of 8)")
    with fsdp_lab.simulated_world(world_size=4):
        collectives.all_reduce(torch.ones(2))
        assert collectives.last_entered().endswith("group of 4)")
    with pytest.raises(ValueError, match="no process group is initialised"):
        collectives.all_reduce(torch.ones(2))


def _nccl_checks():
    """Every collective on NCCL at a world of 1 (the process group's own methods, sync and
    async, and torch's function for a complex tensor), with a Timeline of CUDA marks."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(K, dtype=torch.float32, device=device)
    out = {"backend": str(dist.get_backend())}
    with Timeline() as tl:
        gathered = torch.empty(K, device=device)
        collectives.all_gather_into_tensor(gathered, x)
        handle_out = torch.empty(K, device=device)
        collectives.all_gather_into_tensor(handle_out, x * 2, async_op=True).wait()
        scattered = {}
        for op in ("sum", "avg", "max"):
            scattered[op] = torch.empty(K, device=device)
            collectives.reduce_scatter_tensor(scattered[op], x + 1, op=op)
        reduced = x.clone()
        collectives.all_reduce(reduced, op="avg", async_op=True).wait()
        z = torch.tensor([complex(1, -2)], device=device)
        collectives.all_reduce(z)
        b = x.clone()
        collectives.broadcast(b, src=0)
    out["values"] = [t.cpu() for t in (gathered, handle_out, *scattered.values(), reduced, b)]
    out["complex"] = z.cpu()
    out["events"] = [(e.name, e.bytes, e.duration) for e in tl.comm_events()]
    return out


@pytest.mark.gpu
def test_every_collective_on_nccl_at_a_world_of_one():
    (out,) = fsdp_lab.launch(_nccl_checks, world_size=1, timeout=300)
    assert "nccl" in out["backend"]
    x = torch.arange(K, dtype=torch.float32)
    expected = [x, x * 2, x + 1, x + 1, x + 1, x, x]
    for got, want in zip(out["values"], expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(out["complex"], torch.tensor([complex(1, -2)]))
    names = [name for name, _, _ in out["events"]]
    assert names == ["all_gather"] * 2 + ["reduce_scatter"] * 3 + ["all_reduce"] * 2 + ["broadcast"]
    assert all(duration >= 0 for _, _, duration in out["events"])


def test_a_coalescing_group_queues_the_call_as_torch_does():
    """Inside ``_coalescing_manager`` torch.distributed queues a collective to issue it with the
    others at the block's end; the wrapper hands such a call to torch's function, so it is queued
    too (the fake backend coalesces; gloo does not implement it)."""
    import torch.distributed.distributed_c10d as c10d

    with fsdp_lab.simulated_world(world_size=2):
        group = torch.distributed.group.WORLD
        try:  # torch's own call first: torch 2.6's fake backend cannot coalesce
            with torch.distributed._coalescing_manager(device=torch.device("cpu")):
                torch.distributed.all_reduce(torch.ones(2))
        except RuntimeError as e:
            pytest.skip(f"torch {torch.__version__}'s fake backend does not coalesce: {e}")
        with torch.distributed._coalescing_manager(device=torch.device("cpu")):
            collectives.all_reduce(torch.ones(2))
            collectives.all_reduce(torch.ones(3))
            queued = len(c10d._world.pg_coalesce_state.get(group, []))
    assert queued == 2
