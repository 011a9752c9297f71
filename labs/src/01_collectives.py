"""Lab 01: all-gather, reduce-scatter, all-reduce; bandwidth; reading a collective timeline."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, md  # noqa: E402

CELLS = [
    md("""
    # Lab 01 — Collectives: who holds what, what it costs, when it runs

    **Goals.**

    1. See all-gather, reduce-scatter and all-reduce rank by rank on small tensors.
    2. Check on real ranks that **reduce-scatter + all-gather = all-reduce** — the identity FSDP is built on.
    3. Measure bandwidth the way nccl-tests defines it (algbw, busbw).
    4. Record and read a collective timeline, and see communication overlap computation.
    """),
    code("""
    %matplotlib inline
    import os
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    from fsdp_lab import collectives
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_collective, plot_timeline
    from fsdp_lab.viz.widgets import Explorer

    FIGURES = "figures/01_collectives"
    os.makedirs(FIGURES, exist_ok=True)
    print(f"torch {torch.__version__} | GPUs: {torch.cuda.device_count()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process

    Think of N ranks, each holding a buffer. With a list of tensors standing in for the ranks:

    * **all-gather**: every rank contributes a chunk; afterwards every rank holds all chunks, in rank order.
    * **reduce-scatter**: every rank holds a full-size buffer; afterwards rank *r* holds chunk *r* of the
      element-wise sum.
    * **all-reduce**: every rank ends with the full element-wise sum.
    """),
    code("""
    ranks = [torch.tensor([1.0, 2.0]) + 10 * r for r in range(3)]   # what each of 3 ranks holds
    all_gather = torch.cat(ranks)
    full = [torch.arange(6.0) * (r + 1) for r in range(3)]           # full-size buffers for reductions
    total = sum(full)
    print("all-gather    ->", all_gather.tolist(), "on every rank")
    print("reduce-scatter->", [total[2 * r:2 * r + 2].tolist() for r in range(3)], "(rank 0, 1, 2)")
    print("all-reduce    ->", total.tolist(), "on every rank")
    """),
    md("""
    ## 2. The same on real ranks

    Each function below runs on every rank (`fsdp_lab.launch`) and returns the rank's buffer before and
    after. The pictures colour each cell by the rank whose data it holds.
    """),
    code("""
    def run(op):
        import torch.distributed as dist
        rank, n = dist.get_rank(), dist.get_world_size()
        if op == "all_gather":
            before = torch.tensor([1.0, 2.0]) + 10 * rank
            after = torch.empty(2 * n)
            collectives.all_gather_into_tensor(after, before)
        elif op == "reduce_scatter":
            before = torch.arange(2.0 * n) * (rank + 1)
            after = torch.empty(2)
            collectives.reduce_scatter_tensor(after, before)
        else:
            before = torch.arange(2.0 * n) * (rank + 1)
            after = before.clone()
            collectives.all_reduce(after)
        return before, after

    fig, axes = plt.subplots(3, 2, figsize=(10, 6), gridspec_kw={"width_ratios": [2, 2]})
    for row, op in enumerate(["all_gather", "reduce_scatter", "all_reduce"]):
        out = fsdp_lab.launch(run, op, world_size=3)
        print(f"{op:15s}", [after.tolist() for _, after in out])
        plot_collective(op, [b for b, _ in out], [a for _, a in out], axes=axes[row])
        axes[row][0].set_ylabel(op)
    fig.tight_layout()
    fig.savefig(f"{FIGURES}/collectives_3_ranks.png", dpi=100)
    plt.show()
    """),
    md("""
    ### reduce-scatter + all-gather = all-reduce

    FSDP never all-reduces gradients: it reduce-scatters them (each rank keeps the sum of *its shard*)
    and all-gathers parameters when it needs them whole. Together the two move the same bytes as one
    all-reduce — a ring all-reduce *is* a reduce-scatter followed by an all-gather.
    """),
    code("""
    def identity_check():
        import torch.distributed as dist
        rank, n = dist.get_rank(), dist.get_world_size()
        grads = torch.randn(8 * n, generator=torch.Generator().manual_seed(rank))
        reduced = grads.clone(); collectives.all_reduce(reduced)
        shard = torch.empty(8); collectives.reduce_scatter_tensor(shard, grads)
        regathered = torch.empty(8 * n); collectives.all_gather_into_tensor(regathered, shard)
        return (reduced - regathered).abs().max().item()

    diffs = fsdp_lab.launch(identity_check, world_size=4)
    print("max |all_reduce - all_gather(reduce_scatter)| per rank:", [f"{d:.1e}" for d in diffs])
    print("equal to float32 round-off:", all(d < 1e-5 for d in diffs))
    """),
    md("""
    ## 3. What a collective costs: algbw and busbw

    nccl-tests defines, for a collective of size *S* bytes taking *t* seconds on *n* ranks:

    * **algbw** = S / t
    * **busbw** = algbw · (n−1)/n for all-gather and reduce-scatter, · 2(n−1)/n for all-reduce.

    busbw is comparable to the link's hardware bandwidth whatever *n* is: in a ring all-gather each rank
    sends (n−1)/n of the data. Worked by hand for 1 GB in 0.1 s on 8 ranks:
    """),
    code("""
    for op in ["all_gather", "reduce_scatter", "all_reduce"]:
        algbw, busbw = collectives.bus_bandwidth(op, 1e9, 0.1, 8)
        print(f"{op:15s} algbw {algbw / 1e9:5.2f} GB/s   busbw {busbw / 1e9:5.2f} GB/s")
    """),
    md("""
    Measured here (timings vary from run to run, so this cell's output is not checked):
    """),
    code("""
    rows = collectives.benchmark("all", [1 << 16, 1 << 20, 1 << 23], world_size=2, iters=5)
    print(f"{'op':15s} {'bytes':>10s} {'time (ms)':>10s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
    for r in rows:
        print(f"{r['op']:15s} {r['bytes']:10d} {r['time_s'] * 1e3:10.3f} {r['algbw_GBps']:11.3f} {r['busbw_GBps']:11.3f}")
    """, tags=["nbval-ignore-output"]),
    md("""
    On CPU, gloo has no real reduce-scatter (it all-reduces the whole buffer, twice the traffic);
    fsdp_lab's reduce-scatter is a real one — an all-to-all plus a local sum — and its timeline events say so.

    ## 4. A collective timeline from a real run

    A `Timeline` records every collective issued through `fsdp_lab.collectives` (and compute spans you
    mark). Below each rank issues an all-gather **asynchronously**, computes while it is in flight, then
    waits: the comm lane overlaps the compute lane. The second half does the same work synchronously.
    """),
    code("""
    def overlap_demo(size_mib):
        import torch.distributed as dist
        n = dist.get_world_size()
        x = torch.ones(size_mib << 18)            # size_mib MiB of float32 per rank
        out = torch.empty(n * x.numel())
        a = torch.randn(256, 256)
        with Timeline() as tl:
            for _ in range(2):                    # async: comm in flight during the matmuls
                handle = collectives.all_gather_into_tensor(out, x, async_op=True)
                with tl.span("matmuls"):
                    for _ in range(30): a @ a
                handle.wait()
            for _ in range(2):                    # sync: comm, then compute
                collectives.all_gather_into_tensor(out, x)
                with tl.span("matmuls"):
                    for _ in range(30): a @ a
        return tl

    timeline = Timeline.merge(fsdp_lab.launch(overlap_demo, 4, world_size=2))
    comm = timeline.comm_events(rank=0)
    print("collectives recorded on rank 0:", [e.name for e in comm])
    print("bytes per all-gather:", {e.bytes for e in comm}, "=", 4 << 20, "x 2 ranks")
    """),
    code("""
    print("fraction of comm time hidden under compute, per rank:",
          {rank: f"{frac:.0%}" for rank, frac in timeline.overlap().items()})
    ax = plot_timeline(timeline, title="2 async all-gathers (overlapped), then 2 synchronous ones")
    ax.figure.savefig(f"{FIGURES}/timeline_overlap.png", dpi=100, bbox_inches="tight")
    timeline.to_chrome_trace(f"{FIGURES}/timeline_overlap.json")   # open in https://ui.perfetto.dev
    plt.show()
    """, tags=["nbval-ignore-output"]),
    md("""
    The JSON written above opens in Perfetto or `chrome://tracing`: one process per rank, one row per lane.

    ## 5. Explore

    Pick a collective, a size and a world size: the widget measures it on fresh ranks and draws the
    timeline of the measured iterations with the achieved bus bandwidth.
    """),
    code("""
    def timed_collective(op, size_kib, iters=5):
        import torch.distributed as dist
        n = dist.get_world_size()
        per_rank = max(1, size_kib * 256 // n)
        small, big = torch.ones(per_rank), torch.ones(per_rank * n)
        with Timeline() as tl:
            for _ in range(iters):
                if op == "all_gather": collectives.all_gather_into_tensor(big, small)
                elif op == "reduce_scatter": collectives.reduce_scatter_tensor(small, big)
                else: collectives.all_reduce(big)
        return tl

    def render(op, size_kib, world_size):
        tl = Timeline.merge(fsdp_lab.launch(timed_collective, op, size_kib, world_size=world_size))
        events = tl.comm_events(rank=0)
        seconds = sorted(e.duration for e in events)[len(events) // 2]
        algbw, busbw = collectives.bus_bandwidth(op, events[0].bytes, seconds, world_size)
        ax = plot_timeline(tl, title=f"{op}, {events[0].bytes / 1024:.0f} KiB, {world_size} ranks")
        return ax.figure, f"median {seconds * 1e3:.3f} ms | algbw {algbw / 1e9:.3f} GB/s | busbw {busbw / 1e9:.3f} GB/s"

    explorer = Explorer(
        {"op": widgets.Dropdown(options=["all_gather", "reduce_scatter", "all_reduce"], description="collective"),
         "size_kib": widgets.SelectionSlider(options=[64, 256, 1024, 4096], value=1024, description="KiB"),
         "world_size": widgets.IntSlider(value=2, min=2, max=4, description="world size")},
        render, title="Collective bandwidth and timeline")
    explorer.show();
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 6. Exercise: all-reduce from the two FSDP collectives

    Write `my_all_reduce(t)` that leaves the element-wise sum over ranks in `t`, using only
    `collectives.reduce_scatter_tensor` and `collectives.all_gather_into_tensor` (assume `t.numel()` is
    divisible by the world size). The checking cell compares it with `collectives.all_reduce` on 4 ranks.
    """),
    code("""
    def my_all_reduce(t):
        import torch.distributed as dist
        n = dist.get_world_size()
        shard = torch.empty(t.numel() // n, dtype=t.dtype)
        collectives.reduce_scatter_tensor(shard, t)
        collectives.all_gather_into_tensor(t, shard)
        return t
    """),
    code("""
    def check():
        import torch.distributed as dist
        t = torch.randn(12, generator=torch.Generator().manual_seed(dist.get_rank()))
        expected = t.clone(); collectives.all_reduce(expected)
        return torch.allclose(my_all_reduce(t.clone()), expected, atol=1e-6)

    print("correct" if all(fsdp_lab.launch(check, world_size=4)) else "not yet: compare your result with all_reduce")
    """),
    md("""
    ## Summary

    * all-gather concatenates shards, reduce-scatter sums and splits, all-reduce = both in sequence.
    * Bandwidth is reported as algbw (S/t) and busbw (algbw scaled by the traffic each rank really carries).
    * A timeline shows when each collective ran; async collectives overlap compute, and `overlap()`
      measures how much.

    Next: **lab 02** — where memory goes in one training step.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
