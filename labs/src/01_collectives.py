"""Lab 01: all-gather, reduce-scatter, all-reduce; bandwidth; reading a collective timeline."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 01 — Collectives: who holds what, what it costs, when it runs

    **Goals.**

    1. See all-gather, reduce-scatter and all-reduce rank by rank on small tensors.
    2. Check on real ranks that **reduce-scatter + all-gather = all-reduce** — the identity FSDP is built on.
    3. Measure bandwidth the way nccl-tests defines it (algbw, busbw), and place gloo on a laptop
       against NVLink, PCIe and InfiniBand.
    4. Record and read a collective timeline, and see communication overlap computation.
    5. Build an all-reduce from a reduce-scatter and an all-gather, and a reduce-scatter from an
       all-reduce — and see what each costs on the wire.
    """),
    code("""
    %matplotlib inline
    import os
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import bandwidth, collectives
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_collective, plot_timeline
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab_files, lab01

    files = lab_files("01_collectives")   # labs/figures/01_collectives, from labs/ or labs/solutions/
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
    after. The pictures colour each cell by the rank whose data it holds; grey cells hold a sum over all
    ranks.
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
    files.savefig(fig, "collectives_3_ranks.png", dpi=100)
    plt.show()
    """),
    md("""
    ### reduce-scatter + all-gather = all-reduce

    DDP all-reduces gradients: every rank ends with the whole sum, divided by the world size (the mean).
    FSDP's sharded strategies (FSDP1's `FULL_SHARD` and `SHARD_GRAD_OP`, FSDP2's `fully_shard`)
    reduce-scatter them instead: each rank keeps only the mean of *its shard*, the part its optimizer
    updates, and parameters are all-gathered when they are needed whole. FSDP does all-reduce in two cases:
    `NO_SHARD` is DDP (one all-reduce of the flat gradient), and `HYBRID_SHARD` / HSDP reduce-scatters inside a shard group and
    then all-reduces each shard across the replica groups (PyTorch: `_reduce_grad_no_shard` and
    `_reduce_grad` in `torch/distributed/fsdp/_runtime_utils.py`; FSDP2's `foreach_reduce`). A
    reduce-scatter and an all-gather together move the same bytes as one all-reduce — a ring all-reduce
    *is* a reduce-scatter followed by an all-gather:
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

    diffs = fsdp_lab.launch(identity_check, world_size=4)   # the round-off digits vary with the build
    print("max |all_reduce - all_gather(reduce_scatter)| below 1e-5 (float32 round-off) on every rank:",
          all(d < 1e-5 for d in diffs))
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
        algbw, busbw = bandwidth.bus_bandwidth(op, 1e9, 0.1, 8)
        print(f"{op:15s} algbw {algbw / 1e9:5.2f} GB/s   busbw {busbw / 1e9:5.2f} GB/s")
    """),
    md("""
    What is a good busbw? nccl-tests defines it so that it can be compared with the peak bandwidth
    of the link that is the bottleneck, in one direction, whatever the number of ranks
    ([nccl-tests, doc/PERFORMANCE.md](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)).
    Vendors quote these links in two ways. NVLink and PCIe figures are bytes per second in both
    directions together, so one direction is half of them; InfiniBand port speeds are bits per second
    in each direction, so one direction is the quoted rate divided by 8 bits per byte. The peaks per GPU:

    | link | as quoted | one direction | source |
    | --- | --- | --- | --- |
    | NVLink 4, H100 SXM (18 links) | 900 GB/s, both directions | 450 GB/s (halved) | [NVIDIA, NVLink and NVSwitch](https://www.nvidia.com/en-us/data-center/nvlink/); H100 datasheet |
    | NVLink 3, A100 SXM (12 links) | 600 GB/s, both directions | 300 GB/s (halved) | same page; A100 datasheet |
    | PCIe 5.0 x16 | 128 GB/s, both directions | 64 GB/s (halved) | H100 datasheet ("PCIe Gen5: 128GB/s") |
    | PCIe 4.0 x16 | 64 GB/s, both directions | 32 GB/s (halved) | A100 datasheet ("PCIe Gen4: 64GB/s") |
    | InfiniBand NDR, one port | 400 Gb/s, each direction | 50 GB/s (bits to bytes) | NVIDIA ConnectX-7 / Quantum-2 (NDR 400 Gb/s) |
    | InfiniBand HDR, one port | 200 Gb/s, each direction | 25 GB/s (bits to bytes) | NVIDIA ConnectX-6 (HDR 200 Gb/s) |

    These are the links' peaks: a ring or tree collective's busbw stays below them. On NVSwitch systems NCCL
    can run an all-reduce with NVLink SHARP, the switch doing the reduction; its busbw can then pass the
    one-way peak (NCCL's maintainers report about 480 GB/s on 8 H100s, NVIDIA/nccl-tests issue #212) and
    no longer counts bytes on the wire. Inside one node the GPUs talk over
    NVLink (or PCIe without it); between nodes a collective is bounded by the network, typically one
    InfiniBand port per GPU. gloo moves bytes over TCP on the loopback interface, driven by the CPU.
    Measured here, beside those peaks (timings vary from run to run, so this cell's output is not checked;
    the orders of magnitude do not change):
    """),
    code("""
    rows = bandwidth.benchmark("all", [1 << 16, 1 << 20, 1 << 23], world_size=2, iters=5)
    print(f"{'op':15s} {'bytes':>10s} {'time (ms)':>10s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
    for r in rows:
        print(f"{r['op']:15s} {r['bytes']:10d} {r['time_s'] * 1e3:10.3f} {r['algbw_GBps']:11.3f} {r['busbw_GBps']:11.3f}")

    # Published peaks, GB/s in one direction per GPU (sources in the table above).
    PEAK_GBPS = {"NVLink 4 (H100 SXM)": 450, "NVLink 3 (A100 SXM)": 300, "PCIe 5.0 x16": 64,
                 "InfiniBand NDR port": 50, "PCIe 4.0 x16": 32, "InfiniBand HDR port": 25}
    largest = max(r["bytes"] for r in rows)
    measured = {r["op"]: r["busbw_GBps"] for r in rows if r["bytes"] == largest}
    for op, gbps in measured.items():
        print(f"gloo {op:15s} busbw {gbps:7.3f} GB/s at {largest >> 20} MiB")
    best = max(measured.values())
    for link, gbps in PEAK_GBPS.items():
        print(f"{link:22s} {gbps:4d} GB/s = {gbps / best:8,.0f}x gloo's best here")

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for op in ["all_gather", "reduce_scatter", "all_reduce", "broadcast"]:
        pts = [(r["bytes"] / 2**20, r["busbw_GBps"]) for r in rows if r["op"] == op]
        ax.plot(*zip(*pts), marker="o", label=f"gloo {op} (measured)")
    for link, gbps in PEAK_GBPS.items():
        ax.axhline(gbps, color="grey", lw=0.8, ls="--")
        ax.text(pts[0][0], gbps * 1.08, link, fontsize=7, color="dimgrey")
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xlabel("collective size S (MiB)"); ax.set_ylabel("busbw (GB/s)")
    ax.set_title("busbw measured here (2 ranks, gloo) against published link peaks")
    ax.legend(fontsize=7, loc="lower right")
    files.savefig(fig, "busbw_vs_links.png", dpi=100, bbox_inches="tight")
    plt.show()
    """, tags=["nbval-ignore-output"]),
    md("""
    On CPU, torch's gloo backend has no real reduce-scatter: its `reduce_scatter_tensor` all-reduces the whole
    buffer and keeps one slice. A ring all-reduce moves 2(n−1)/n·S per rank where a reduce-scatter needs
    (n−1)/n·S: twice the traffic for the same result. fsdp_lab's reduce-scatter is a real one — an all-to-all
    plus a local sum — and it is the one measured as `reduce_scatter` above; its timeline events say so.

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
    hidden = ", ".join(f"rank {rank} {frac:.0%}" for rank, frac in timeline.overlap().items())
    ax = plot_timeline(timeline, title="2 async all-gathers (overlapped), then 2 synchronous ones; "
                                       f"comm time hidden under compute: {hidden}")
    files.savefig(ax.figure, "timeline_overlap.png", dpi=100, bbox_inches="tight")
    files.save("timeline_overlap.json", timeline.to_chrome_trace)   # open in https://ui.perfetto.dev
    plt.show()
    """),
    md("""
    The title gives `timeline.overlap()`: the fraction of each rank's comm time during which compute also
    ran (it changes from run to run, so it is only in the figure). The JSON written above opens in
    Perfetto or `chrome://tracing`: one process per rank, one row per lane.

    ## 5. Explore

    Pick a collective, a size and a world size: the widget measures it on fresh ranks and draws the
    timeline of the measured iterations with the achieved bus bandwidth. Widget state is not saved in the
    notebook, so a saved copy shows nothing here until the cell runs; section 4's figure is the same kind of
    timeline, from a real run.
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
        algbw, busbw = bandwidth.bus_bandwidth(op, events[0].bytes, seconds, world_size)
        ax = plot_timeline(tl, title=f"{op}, {events[0].bytes / 1024:.0f} KiB, {world_size} ranks",
                           legend_outside=True)
        return ax.figure, f"median {seconds * 1e3:.3f} ms | algbw {algbw / 1e9:.3f} GB/s | busbw {busbw / 1e9:.3f} GB/s"

    explorer = Explorer(
        {"op": widgets.Dropdown(options=["all_gather", "reduce_scatter", "all_reduce"], description="collective"),
         "size_kib": widgets.SelectionSlider(options=[64, 256, 1024, 4096], value=1024, description="KiB"),
         # a drag launches ranks once, where it stops, not for every value passed
         "world_size": widgets.IntSlider(value=2, min=2, max=4, description="world size", continuous_update=False)},
        render, title="Collective bandwidth and timeline")
    explorer.show();
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 6. Exercise: all-reduce from the two FSDP collectives

    Write `my_all_reduce(t)` that leaves the element-wise sum over ranks in `t` (and returns `t`), using
    only `collectives.reduce_scatter_tensor` and `collectives.all_gather_into_tensor` (assume `t.numel()` is
    divisible by the world size). The check runs it on 4 ranks, compares with `collectives.all_reduce`, and
    counts the bytes your collectives sent (it sees only calls made through `fsdp_lab.collectives`).
    """),
    exercise("""
    def my_all_reduce(t):
        import torch.distributed as dist
        ### BEGIN SOLUTION
        shard = torch.empty(t.numel() // dist.get_world_size(), dtype=t.dtype)
        collectives.reduce_scatter_tensor(shard, t)      # this rank: the sum of its chunk
        collectives.all_gather_into_tensor(t, shard)     # every rank: every chunk's sum
        return t
        ### END SOLUTION
        ### STUB raise NotImplementedError("reduce-scatter t into a shard, then all-gather the shards back into t")
    """),
    code("""
    lab01.check_my_all_reduce(my_all_reduce)
    """),
    md("""
    ## 7. Exercise: reduce-scatter the way gloo does it

    gloo has no reduce-scatter of its own: `torch.distributed.reduce_scatter_tensor` on gloo all-reduces
    the whole buffer and keeps a chunk. Write `my_reduce_scatter(t)` that way: return this rank's chunk
    (elements `[rank·k, (rank+1)·k)` with `k = t.numel() // world`) of the element-wise sum of every rank's
    `t`, using only `collectives.all_reduce` (on a copy: leave `t` alone). The check runs it on 4 ranks,
    rejects any other collective and any change to `t`, compares each chunk with
    `collectives.reduce_scatter_tensor` — and tells you what the shortcut costs on the wire.
    """),
    exercise("""
    def my_reduce_scatter(t):
        import torch.distributed as dist
        ### BEGIN SOLUTION
        rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
        total = t.clone()
        collectives.all_reduce(total)                    # every rank: the whole sum
        return total[rank * k:(rank + 1) * k]
        ### END SOLUTION
        ### STUB raise NotImplementedError("all-reduce a copy of t, then return this rank's chunk of it")
    """),
    code("""
    lab01.check_my_reduce_scatter(my_reduce_scatter)
    """),
    md("""
    ## Summary

    * all-gather concatenates shards, reduce-scatter sums and splits, all-reduce = both in sequence.
    * Bandwidth is reported as algbw (S/t) and busbw (algbw scaled by the traffic each rank really carries);
      busbw compares with a link's one-way peak: hundreds of GB/s on NVLink, tens on PCIe and InfiniBand
      (an all-reduce reduced inside an NVSwitch, NVLink SHARP, can pass it).
    * DDP and FSDP's `NO_SHARD` all-reduce gradients; FSDP's sharded strategies reduce-scatter them
      (`HYBRID_SHARD` then all-reduces each shard across replicas).
    * A reduce-scatter built from an all-reduce gives the right chunk for twice the traffic.
    * A timeline shows when each collective ran; async collectives overlap compute, and `overlap()`
      measures how much.

    Next: **lab 02** — where memory goes in one training step.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
