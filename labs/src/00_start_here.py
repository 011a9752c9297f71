"""Lab 00: process groups, ranks, and launching N ranks from a notebook."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 00 — Start here: ranks, process groups and `fsdp_lab.launch`

    **Goals.** By the end of this lab you can

    1. say what a *rank*, a *world size* and a *process group* are;
    2. run a function written in this notebook on N processes with `fsdp_lab.launch`;
    3. exchange data between ranks with one collective;
    4. recognise what happens when a rank fails or two ranks disagree on a collective — an error that
       names the rank, never a notebook that hangs;
    5. write two small pieces of data-parallel code yourself: a mean over ranks that hold different
       amounts of data, and the range of elements a rank owns in a sharded tensor.

    Everything here runs on a laptop CPU (the *gloo* backend). On a machine with a GPU per rank the same
    cells run unchanged: `launch` then makes a process group that sends CUDA tensors over NCCL and the CPU
    tensors these cells build over gloo.

    **How the exercises work.** An exercise cell holds a stub, `raise NotImplementedError("…")`, under a
    statement of the task: replace the stub with your code, run the cell, then run the checking cell below
    it. The checker runs your code (on real ranks where it needs them) against an independent reference and
    says *correct*, *not solved yet*, or which mistake it sees. Solutions are in `labs/solutions/`;
    `fsdp-lab lab reset 00` rebuilds this notebook from its source, stubs back and outputs cleared
    (`--execute` runs it as well); the notebook it replaces is kept in `labs/.backup/`.
    """),
    code("""
    %matplotlib inline
    import os, platform
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import collectives
    from fsdp_lab.dist import choose_backend
    from fsdp_lab.viz import plot_collective
    from fsdp_lab.workshop import lab_files, lab00

    files = lab_files("00_start_here")   # labs/figures/00_start_here, from labs/ or labs/solutions/
    print(f"torch {torch.__version__} | python {platform.python_version()} | "
          f"GPUs: {torch.cuda.device_count()} | cores: {os.cpu_count()} | backend for 2 ranks: {choose_backend(2)}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process

    Data-parallel training runs the *same program* in N processes. Each process is a **rank** (0 … N−1);
    N is the **world size**. A **process group** is the set of ranks that take part in a collective
    (an all-gather, a reduce-scatter, an all-reduce). Every rank must enter the same collectives in the
    same order — that is the whole contract, and most distributed bugs break it.

    A plain Python process is a world of one: rank 0 of 1.
    """),
    code("""
    from fsdp_lab.dist import get_rank, get_world_size
    print("rank", get_rank(), "of", get_world_size())
    """),
    md("""
    ## 2. Run N ranks from the notebook

    `fsdp_lab.launch(fn, *args, world_size=N)` starts N fresh processes, initialises the default process
    group in each, runs `fn(*args)` on every rank and returns the results as a list indexed by rank.
    `fn` may be defined right here in the notebook: it is sent to the ranks by value. Only rank 0's prints
    reach this notebook. On Linux, CPU ranks are forked from a helper process that imports torch once: the
    first cell started it (`fsdp_lab.start_fork_server()`), so it loaded torch while you read, and no launch
    imports torch again (without that call, the first launch starts it and waits seconds for it). Each rank
    is still a new process, as the cell below shows.
    """),
    code("""
    def whoami(greeting):
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            print(f"{greeting} from rank 0 of {world}")
        return {"rank": rank, "world_size": world, "backend": dist.get_backend(), "pid": os.getpid()}

    results = fsdp_lab.launch(whoami, "hello", world_size=4)   # gloo on CPU; NCCL (+ gloo for CPU tensors) with >= 4 GPUs
    for r in results:
        print(f"rank {r['rank']} of {r['world_size']}")
    print("distinct processes:", len({r['pid'] for r in results}), "| this notebook is one of them:",
          os.getpid() in {r['pid'] for r in results})
    """),
    md("""
    ## 3. One collective: all-reduce

    Each rank holds a tensor; after `all_reduce` every rank holds the element-wise sum. All collectives in
    fsdp_lab go through `fsdp_lab.collectives`, which also records them on a timeline (lab 01).
    """),
    code("""
    def sum_of_ranks():
        import torch.distributed as dist
        rank = dist.get_rank()
        before = torch.tensor([float(rank), 10.0 * rank])
        after = before.clone()
        collectives.all_reduce(after)
        return before, after

    out = fsdp_lab.launch(sum_of_ranks, world_size=4)
    for rank, (before, after) in enumerate(out):
        print(f"rank {rank}: before {before.tolist()} -> after {after.tolist()}")
    """),
    code("""
    axes = plot_collective("all_reduce", [b for b, _ in out], [a for _, a in out])
    axes[0].figure.suptitle("all_reduce on 4 ranks: every rank ends with the sum")
    files.savefig(axes[0].figure, "all_reduce_4_ranks.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    md("""
    A collective can answer questions no single rank can. Every rank below returns the world size without
    asking for it: each contributes a 1, and the all-reduce sums one 1 per rank.
    """),
    code("""
    def count_ranks():
        t = torch.ones(1)
        collectives.all_reduce(t)
        return int(t.item())

    print("each rank counted:", fsdp_lab.launch(count_ranks, world_size=3))
    """),
    md("""
    ## 4. When a rank fails

    If one rank raises, `launch` raises `fsdp_lab.LaunchError` in the notebook: the message names the rank
    and carries its traceback, the other ranks are stopped, and no process is left behind.
    """),
    code("""
    def fails_on_rank_1():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("rank 1 found a bad batch")
        return "ok"

    try:
        fsdp_lab.launch(fails_on_rank_1, world_size=2)
    except fsdp_lab.LaunchError as error:
        print("LaunchError from rank", error.rank)
        print([line for line in str(error).splitlines() if "ValueError" in line][-1])
    """),
    md("""
    ### A hang becomes an error, too

    The classic distributed bug: one rank skips a collective the others enter. The others wait forever —
    unless something stops them (on gloo, if the skipping rank simply *exits*, its peers get a "connection
    closed" error instead, which `launch` reports like any failure; under NCCL they wait until the timeout). `launch` ends the run and reports, per rank,
    the last collective it entered, which usually points straight at the mismatch. It stops the ranks as
    soon as it sees a deadlock it can prove: every rank waits inside its collective of the *same number*
    (each rank's N-th collective, the same N on all ranks), those collectives are not all the same
    operation, and nothing changes for a short grace period; such collectives can never complete. Any
    other hang ends at `timeout=…` seconds: a rank stuck in a loop, a rank that never enters the
    collective its peers wait in, or ranks that wait in collectives of different numbers.

    In that report `#N` numbers the collectives one rank has entered since it started, **of every kind**:
    `all_gather #2` means "rank 1's second collective, which was an all-gather" (its first all-gather),
    not "the second all-gather". Rank 0 is in its second collective, an all-reduce; rank 1 is in its
    second, an all-gather: the two ranks disagree about what collective #2 is — that is the bug.
    The timeout covers the whole launch, starting the ranks included, so it is generous here; this
    deadlock is reported before it (the last line below).
    """),
    code("""
    def rank_1_skips_the_all_reduce():
        import torch.distributed as dist
        t = torch.ones(4)
        collectives.all_reduce(t)                 # every rank's collective #1: an all-reduce
        if dist.get_rank() == 0:
            collectives.all_reduce(t)             # rank 0's collective #2: an all-reduce ...
        else:                                     # ... while rank 1 skipped it: its collective #2
            collectives.all_gather_into_tensor(torch.empty(8), t)   # is the next step's all-gather
        return t

    try:
        fsdp_lab.launch(rank_1_skips_the_all_reduce, world_size=2, timeout=30)
    except fsdp_lab.LaunchTimeout as error:
        for rank, last in enumerate(error.last_collectives):
            print(f"rank {rank} last entered: {last}")
        print("stopped as a deadlock, before the timeout:", str(error).startswith("deadlock:"))
    """),
    md("""
    ## 5. Explore: world size and collective

    Pick a world size and a collective; the widget launches the ranks and draws who holds what. Widget
    state is not saved in the notebook, so a saved copy shows nothing here until the cell runs; section 3's
    figure is the same kind of drawing, for an all-reduce on 4 ranks of other numbers.
    """),
    code("""
    def run_collective(op):
        import torch.distributed as dist
        rank, n = dist.get_rank(), dist.get_world_size()
        x = torch.arange(2, dtype=torch.float32) + 10 * rank
        if op == "all_reduce":
            y = x.clone(); collectives.all_reduce(y)
        elif op == "all_gather":
            y = torch.empty(2 * n); collectives.all_gather_into_tensor(y, x)
        else:
            y = x.clone(); collectives.broadcast(y, src=0)
        return x, y

    def render(world_size, op):
        out = fsdp_lab.launch(run_collective, op, world_size=world_size)
        axes = plot_collective(op, [x for x, _ in out], [y for _, y in out])
        return axes[0].figure, f"{op} on {world_size} rank{'s' if world_size > 1 else ''}"

    from fsdp_lab.viz.widgets import Explorer
    explorer = Explorer(
        {"world_size": widgets.IntSlider(value=2, min=1, max=4, description="world size", continuous_update=False),
         "op": widgets.Dropdown(options=["all_reduce", "all_gather", "broadcast"], description="collective")},
        render, title="Launch N ranks")
    explorer.show();
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 6. Exercise: a mean over ranks that hold different amounts of data

    In data-parallel training each rank computes a loss over *its* tokens, and ranks may hold different
    numbers of tokens (sequences of different lengths, padding). Write `global_mean(values)`: it runs on
    every rank, `values` is that rank's 1-D tensor (rank r holds r + 1 values here), and it returns — on
    **every** rank — the mean of all values of all ranks, as a number. Use `collectives`; do not collect
    the values in one place. The check runs it on 3 ranks.
    """),
    exercise("""
    def global_mean(values):
        ### BEGIN SOLUTION
        totals = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=values.dtype)])
        collectives.all_reduce(totals)           # [sum of all values, number of all values]
        return (totals[0] / totals[1]).item()
        ### END SOLUTION
        ### STUB raise NotImplementedError("sum over ranks the total and the count of the values, then divide")
    """),
    code("""
    lab00.check_global_mean(global_mean)
    """),
    md("""
    ## 7. Exercise: which elements does a rank own?

    FSDP1 (lab 04) flattens a unit's parameters into one tensor of `numel` elements and splits it into
    `world` contiguous shards of equal size, padding the end so the sizes match (an all-gather needs equal
    shards). FSDP2 (lab 05) shards each parameter along its first dimension instead, by the same rule on
    rows. Write `shard_range(numel, rank, world)` returning the `(start, end)` of the elements rank `rank`
    owns (end exclusive, as in `t[start:end]`); a rank that owns only padding gets an empty range
    `(numel, numel)`. Below, 10 elements on 4 ranks as FSDP1 lays them out: each shard has 3 slots, and
    rank 3 owns element 9 and two slots of padding. The check compares with those boundaries.
    """),
    code("""
    from fsdp_lab.fsdp1 import padded_numel, shard_boundaries   # FSDP1's layout, the check's reference
    numel, world = 10, 4
    slots = padded_numel(numel, world) // world
    print(f"{numel} elements on {world} ranks: {slots} slots per rank")
    for rank in range(world):
        start, end = shard_boundaries([numel], world, rank)[0]
        print(f"rank {rank}: elements {list(range(start, end))} + {slots - (end - start)} slots of padding")
    """),
    exercise("""
    def shard_range(numel, rank, world):
        ### BEGIN SOLUTION
        per = -(-numel // world)                 # ceil(numel / world): slots per rank, padding included
        start = min(rank * per, numel)
        return start, min(start + per, numel)
        ### END SOLUTION
        ### STUB raise NotImplementedError("return (start, end) of this rank's elements")
    """),
    code("""
    lab00.check_shard_range(shard_range)
    """),
    md("""
    ## Summary

    * A rank is one process of N; the process group is who takes part in a collective; every rank must
      call the same collectives in the same order.
    * `fsdp_lab.launch(fn, world_size=N)` runs notebook code on N ranks and returns their results.
    * A failing rank is an error that names it; a mismatched collective is a `LaunchTimeout` that names
      each rank's last collective (`#N`: the rank's N-th collective of any kind), raised once every rank
      waits in its N-th collective and they differ, else at the timeout — nothing hangs.
    * A mean over ranks that hold different amounts of data needs the sum *and* the count reduced; the
      mean of the ranks' means weights every rank alike, so with different amounts it is in general not
      the mean of all the values.
    * A sharded tensor gives each rank `ceil(numel / world)` slots, the last ones padding, so every shard
      has the same size.

    Next: **lab 01** — what all-gather, reduce-scatter and all-reduce do, what they cost, and how to read
    a collective timeline.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
