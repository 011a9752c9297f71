"""Lab 03: build it yourself: DDP, then ZeRO-1, ZeRO-2 and ZeRO-3, on fsdp_lab.collectives."""

import inspect
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise_from, md  # noqa: E402

from fsdp_lab.workshop import zero  # noqa: E402

BASE_SOURCE = inspect.getsource(zero.DataParallel).rstrip()
HELPERS_SOURCE = inspect.getsource(zero.free_storage).rstrip() + "\n\n\n" + \
    inspect.getsource(zero.alloc_storage).rstrip()

CELLS = [
    md("""
    # Lab 03 — Build it yourself: DDP → ZeRO-1 → ZeRO-2 → ZeRO-3

    **Goals.**

    1. Measure what one data-parallel rank keeps for the model it trains — parameters, gradients, AdamW's
       optimizer state: 4 + 4 + 8 bytes per parameter in fp32 — and what each ZeRO stage shards away.
    2. Write DDP and the three ZeRO stages yourself on `fsdp_lab.collectives`: first the optimizer state is
       sharded (ZeRO-1), then the gradients (ZeRO-2), then the parameters (ZeRO-3, what FSDP's `FULL_SHARD`
       does: all-gather in a forward pre-hook, free after forward, gather again before backward,
       reduce-scatter in a post-backward hook).
    3. Check each stage three ways: the same parameters as single-process training (to 1e-5), memory per
       category against the ZeRO arithmetic, bytes on the wire against the formula — and read why ZeRO-3
       sends 1.5× DDP's bytes on its timeline.

    Sections 1–3 measure fsdp_lab's own four stages (`fsdp_lab/workshop/zero.py`: the solution, so read it
    after you have written yours); in section 4 you write them, and the checks hold yours to the same numbers.
    The stage names and the arithmetic are the ZeRO paper's (Rajbhandari et al., *ZeRO: Memory
    Optimizations Toward Training Trillion Parameter Models*, 2020); the hooks of ZeRO-3 are the pattern of
    fairscale's and PyTorch's FSDP, without their flat parameters, prefetching and mixed precision (labs 04–07).
    """),
    code("""
    %matplotlib inline
    import functools, os
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import collectives
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab_files, lab03, zero
    from fsdp_lab.workshop.lab03 import kib
    from fsdp_lab.workshop.measure import WIRE_FACTOR
    from fsdp_lab.workshop.zero import DataParallel, alloc_storage, free_storage

    files = lab_files("03_zero_by_hand")   # labs/figures/03_zero_by_hand, from labs/ or labs/solutions/
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process

    The model is a small Llama (`fsdp_lab.models.Llama`) trained with AdamW in fp32. `DataParallel` is the
    training step every stage shares (section 4 shows it); with one rank and no communication it is plain
    training. One step, measured by `MemoryTracker` per category, on a fresh rank:
    """),
    code("""
    elements, tensors = lab03.num_params()
    cfg = lab03.CONFIG
    print(f"Llama with {cfg.n_layers} blocks, dim {cfg.dim}, vocab {cfg.vocab_size}: "
          f"{elements:,} parameters in {tensors} tensors")
    alone = lab03.summary(lab03.measure(DataParallel, world_size=1))
    print(f"parameters       {kib(alone['params']):>11} = 4 B x {alone['params'] // 4:,}")
    print(f"gradients        {kib(alone['whole_grads']):>11} = 4 B x {alone['whole_grads'] // 4:,}")
    moments = alone["optimizer_state"] - 4 * tensors
    print(f"optimizer state  {kib(alone['optimizer_state']):>11} = 8 B x {moments // 8:,} "
          f"(exp_avg, exp_avg_sq) + {tensors} step counters x 4 B")
    print(f"per parameter: {(alone['params'] + alone['whole_grads'] + moments) / elements:g} B "
          "(the step counters aside)")
    """),
    md("""
    So a rank needs 16 bytes per parameter (the last line) before it stores a single activation: the ZeRO
    paper's *model states*. The paper's total is the same, its make-up is not: it trains in mixed precision, 2
    bytes of fp16 parameters, 2 of fp16 gradients and 12 of optimizer state (an fp32 copy of the parameters
    and the two moments), so its ZeRO-1 shards that fp32 copy along with the moments; here everything is fp32,
    4 + 4 + 8. Data parallelism replicates all of them on every rank. ZeRO removes the redundancy one state at
    a time, using the identity of lab 01: an all-reduce is a reduce-scatter plus an all-gather. Two "ranks" as
    a list, each with the gradient of its half of the batch:
    """),
    code("""
    grads = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 4.0, 5.0, 6.0])]   # rank 0, rank 1
    mean = sum(grads) / 2
    slices = [mean[2 * r:2 * r + 2] for r in range(2)]
    print("DDP, all-reduce (avg):        every rank holds", mean.tolist())
    print("ZeRO, reduce-scatter (avg):   rank 0 holds", slices[0].tolist(), "| rank 1 holds", slices[1].tolist())
    print("all-gather of the two slices: every rank holds", torch.cat(slices).tolist())
    """),
    md("""
    A rank that updates only its slice needs the optimizer state of that slice only (**ZeRO-1**), and only
    that slice of the averaged gradient, so the gradient can be reduce-scattered and dropped as soon as it
    exists (**ZeRO-2**); after the step the updated slices are all-gathered. **ZeRO-3** keeps only the slice
    of the parameters too, and gathers each unit (an embedding, a block, the output layer) just for its
    forward and again for its backward. Per rank, in KiB, for this model (`lab03.expected`, the paper's
    arithmetic with AdamW's step counters):
    """),
    code("""
    for world in (2, 8):
        print(f"{world} ranks  {'parameters':>12} {'gradients':>12} {'optimizer':>12} {'on the wire':>12}")
        for stage in lab03.STAGE_NAMES:
            e = lab03.expected(stage, elements, tensors, world)
            print(f"{stage:8s} {kib(e['params']):>12} {kib(e['grads']):>12} {kib(e['optimizer_state']):>12} "
                  f"{kib(e['wire']):>12}")
    """),
    md("""
    *On the wire* is what one rank sends per step in a ring: an all-reduce of S bytes sends 2(N−1)/N·S,
    an all-gather or a reduce-scatter (N−1)/N·S. ZeRO-1 and ZeRO-2 replace DDP's all-reduce by a
    reduce-scatter and an all-gather: the same bytes. ZeRO-3 gathers the parameters twice (forward, then
    backward, because it freed them in between) and reduce-scatters the gradients once: 3(N−1)/N·S,
    **1.5× DDP**.

    ## 2. Four stages on 2 ranks

    Each stage trains the same model for `lab03.STEPS` steps on 2 fresh ranks, each rank on its half of
    every batch; a step after the first (which creates AdamW's state) is measured: memory per category
    with `MemoryTracker`, collectives with a `Timeline`. The cell prints which. The reference is
    single-process training on the whole batch.
    """),
    code("""
    reference = lab03.reference(2)
    runs = {name: lab03.measure(stage, world_size=2) for name, stage in zero.STAGES.items()}
    measured = {name: lab03.summary(r) for name, r in runs.items()}
    print(f"{lab03.STEPS} steps per stage; step {lab03.MEASURED_STEP + 1} measured")

    def matches(stage_runs):
        worst = max((run.final[n] - reference.final[n]).abs().max().item()
                    for run in stage_runs for n in reference.final)
        return worst <= lab03.TOL

    print(f"{'stage':8s} {'=1 process':>10s} {'params':>11s} {'whole grads':>11s} {'grad slices':>11s} "
          f"{'optimizer':>11s} {'gathered':>11s} {'wire':>11s}  collectives")
    for name, m in measured.items():
        calls = ", ".join(f"{c} {op}" for op, (c, _) in m["collectives"].items())
        print(f"{name:8s} {str(matches(runs[name])):>10s} {kib(m['params']):>11s} {kib(m['whole_grads']):>11s} "
              f"{kib(m['grad_slices']):>11s} {kib(m['optimizer_state']):>11s} {kib(m['gathered']):>11s} "
              f"{kib(m['wire']):>11s}  {calls}")
    """),
    code("""
    for name, m in measured.items():
        e = lab03.expected(name, elements, tensors, 2)
        kept_grads = m["whole_grads"] or m["grad_slices"]
        same = (m["params"], kept_grads, m["optimizer_state"], m["wire"]) == (
            e["params"], e["grads"], e["optimizer_state"], e["wire"])
        print(f"{name:8s} measured = ZeRO arithmetic (params, grads, optimizer, wire): {same};"
              f" wire / DDP's = {m['wire'] / measured['DDP']['wire']:g}")
    """),
    md("""
    Read the table column by column: the optimizer state halves at ZeRO-1, the gradients at ZeRO-2 (the
    whole ones never outlive their hook), the parameters at ZeRO-3 — which instead holds at most a unit or
    two gathered at a time (*gathered*). The bytes on the wire stay DDP's until ZeRO-3. Every stage trains
    the same parameters as one process.
    """),
    code("""
    STATES = [("parameters", lambda m: m["params"]),
              ("gradients", lambda m: m["whole_grads"] or m["grad_slices"]),
              ("optimizer\\nstate", lambda m: m["optimizer_state"])]
    COLORS = {"DDP": "#8C8C8C", "ZeRO-1": "#C44E52", "ZeRO-2": "#55A868", "ZeRO-3": "#4C72B0"}
    OPS = {"all_reduce": "#8172B3", "reduce_scatter": "#C44E52", "all_gather": "#DD8452"}

    def draw_memory(ax, results, world):
        width = 0.8 / len(results)
        for i, (name, m) in enumerate(results.items()):
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(STATES))]
            ax.bar(xs, [f(m) / 1024 for _, f in STATES], width, color=COLORS[name], label=name)
            if m["gathered"]:
                ax.bar(xs[0], m["gathered"] / 1024, width, bottom=m["params"] / 1024, color="none",
                       edgecolor=COLORS[name], hatch="//", label=f"{name}: gathered at once")
        ddp = results.get("DDP") or next(iter(results.values()))
        for j, (_, f) in enumerate(STATES):
            ax.hlines(f(ddp) / world / 1024, j - 0.45, j + 0.45, colors="black", linestyles="dashed",
                      label=f"1/{world} of DDP" if j == 0 else None)
        ax.set_xticks(range(len(STATES)), [s for s, _ in STATES], fontsize=8)
        ax.set_ylim(0, 1.45 * max(f(m) for m in results.values() for _, f in STATES) / 1024)  # room for the legend
        ax.set_ylabel("KiB per rank"); ax.legend(fontsize=7, ncol=2, loc="upper right")
        ax.set_title(f"model states per rank, {world} ranks")

    def draw_wire(ax, results, world):
        names = list(results)
        bottom = [0.0] * len(names)
        for op, color in OPS.items():
            vals = [results[n]["collectives"].get(op, (0, 0))[1] * WIRE_FACTOR[op](world) / 1024
                    for n in names]
            ax.bar(names, vals, bottom=bottom, color=color, label=op)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ddp = results["DDP"]["wire"] / 1024 if "DDP" in results else None
        if ddp:
            ax.axhline(ddp, color="black", ls="dashed", lw=0.8, label="DDP")
            ax.axhline(1.5 * ddp, color="black", ls="dotted", lw=0.8, label="1.5 x DDP")
        ax.set_ylabel("KiB sent per rank per step"); ax.legend(fontsize=7)
        ax.set_title("bytes on the wire, by collective")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    draw_memory(left, measured, 2)
    draw_wire(right, measured, 2)
    fig.tight_layout()
    files.savefig(fig, "stages_memory_and_wire.png", dpi=90)
    plt.show()
    """),
    md("""
    The timelines of the measured step (both ranks; compute lanes show each unit's forward and backward).
    This lab's DDP and ZeRO-1 communicate after backward (PyTorch's `DistributedDataParallel` all-reduces
    buckets of gradients from autograd hooks *during* backward); ZeRO-2 reduce-scatters *during* backward,
    one gradient at a time; ZeRO-3 also all-gathers before every unit's forward and again before its backward. The durations
    vary from run to run; which collective runs when does not.
    """),
    code("""
    fig, axes = plt.subplots(4, 1, figsize=(11, 11))
    for ax, (name, r) in zip(axes, runs.items()):
        plot_timeline(Timeline.merge([run.timeline for run in r]), ax=ax, title=f"{name}: one step on 2 ranks")
        ax.get_legend().set(loc="upper left", bbox_to_anchor=(1.0, 1.0))   # beside the lanes, not on them
    fig.tight_layout()
    files.savefig(fig, "stages_timelines.png", dpi=80, bbox_inches="tight")
    plt.show()
    """),
    md("""
    ## 3. Explore: stage and world size

    Pick a stage and a world size: memory per rank beside DDP's on the same world, and the stage's
    timeline. World size 4 trains on 4 fresh ranks when first asked for (a few seconds); the 2-rank runs
    above are reused. The static figure below is the widget's default (ZeRO-3, 2 ranks): widget state is
    not saved in a notebook.
    """),
    code("""
    cache = {(name, 2): r for name, r in runs.items()}

    def stage_runs(stage, world_size):
        if (stage, world_size) not in cache:
            cache[(stage, world_size)] = lab03.measure(zero.STAGES[stage], world_size=world_size)
        return cache[(stage, world_size)]

    def render(stage, world_size):
        results = {name: lab03.summary(stage_runs(name, world_size)) for name in dict.fromkeys(["DDP", stage])}
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [2, 3]})
        draw_memory(left, results, world_size)
        plot_timeline(Timeline.merge([run.timeline for run in stage_runs(stage, world_size)]), ax=right,
                      title=f"{stage}, {world_size} ranks")
        right.get_legend().set(loc="upper center", bbox_to_anchor=(0.5, -0.18))   # below the lanes
        fig.tight_layout()
        m, e = results[stage], lab03.expected(stage, elements, tensors, world_size)
        text = (f"{stage} on {world_size} ranks: wire {kib(m['wire'])} per rank per step "
                f"(formula {kib(e['wire'])}); optimizer state {kib(m['optimizer_state'])} "
                f"(formula {kib(e['optimizer_state'])})")
        return fig, text

    fig, text = render("ZeRO-3", 2)
    print(text)
    files.savefig(fig, "widget_default_zero3.png", dpi=80, bbox_inches="tight")
    """),
    code("""
    explorer = Explorer({
        "stage": widgets.Dropdown(options=list(zero.STAGES), value="ZeRO-3", description="stage"),
        "world_size": widgets.ToggleButtons(options=[2, 4], value=2, description="world size"),
    }, render, title="ZeRO stage by stage")
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 4. Build them

    Every stage subclasses `DataParallel` (imported above from `fsdp_lab.workshop.zero`). It owns the
    training step — forward, backward, `after_backward()`, the optimizer step, zeroing the gradients,
    `after_step()` — and a few helpers: `my_slice(t)` (this rank's contiguous 1/N of `t`'s elements, a view,
    the `shard_range` of lab 00 with every size divisible by N), `new_grad_shard(shard)` and
    `param_shard(p)` (new tensors tagged for `MemoryTracker`), `units()` (what ZeRO-3 gathers as one).
    A stage keeps `self.shards[i]`, this rank's slice of `self.params[i]`, and must set `self.optimizer`
    in `setup()`:
    """),
    md("```python\n" + BASE_SOURCE + "\n\n\n" + HELPERS_SOURCE + "\n```"),
    md("""
    `free_storage` is how PyTorch's FSDP frees a parameter: the tensor stays (autograd still holds it for
    backward) but its storage shrinks to 0 bytes; `alloc_storage` gives the bytes back, to be filled by an
    all-gather. Each check below trains your class on 2 fresh ranks and compares it with single-process
    training, with the memory arithmetic of section 1 and with the bytes formula; it names the mistake it
    recognises. Use `collectives.all_reduce`, `collectives.reduce_scatter_tensor` and
    `collectives.all_gather_into_tensor` with `op="avg"` where gradients are averaged.

    ### 4.1 DDP

    Write `after_backward`: average every parameter's gradient over the ranks, in place.
    """),
    exercise_from(zero.DDP),
    code("""
    lab03.check_ddp(DDP)
    """),
    md("""
    ### 4.2 ZeRO-1: shard the optimizer state

    `setup`: `self.shards` — this rank's slice of each parameter (`self.my_slice(p.data)`, a view, made a
    leaf that requires grad so the optimizer can own it) — and `self.optimizer` over the shards only.
    `after_backward`: reduce-scatter (average) each whole gradient into its shard's `.grad`
    (`self.new_grad_shard(shard)`), then drop the whole gradient (`p.grad = None`: it would otherwise be
    added to the next step's). `after_step`: all-gather the updated slices back into each whole parameter
    (`p.data.reshape(-1)`). The shard is a view of this rank's own slot in that output: passed as it is,
    that is the in-place all-gather NCCL documents; a copy (`shard.detach().clone()`) makes no such demand
    of the backend.
    """),
    exercise_from(zero.ZeRO1),
    code("""
    lab03.check_zero1(ZeRO1)
    """),
    md("""
    ### 4.3 ZeRO-2: shard the gradients

    As ZeRO-1, but a gradient must not wait for the end of backward: in `setup` register
    `p.register_post_accumulate_grad_hook(...)` on each parameter (the hook is called with `p` once its
    gradient is complete; `functools.partial(self.reduce_gradient, shard)` passes the shard too), and in
    `reduce_gradient` reduce-scatter it into the shard's gradient and drop it at once.
    """),
    exercise_from(zero.ZeRO2),
    code("""
    lab03.check_zero2(ZeRO2)
    """),
    md("""
    ### 4.4 ZeRO-3: shard the parameters (FSDP)

    `setup`: take each parameter's shard with `self.param_shard(p)` (a copy: the parameter's own storage
    is about to be freed), keep them as `self.shards` (in `self.params`' order: `full_parameters` reads
    them there) and as `self.shard_of = {p: shard}`, free every parameter, hook each gradient as in
    ZeRO-2, build the optimizer over the shards, and give every unit in `self.units()` three hooks:
    `register_forward_pre_hook` → gather, `register_forward_hook` → free,
    `register_full_backward_pre_hook` → gather again. `gather`: for each parameter of the unit,
    `alloc_storage(p)` then all-gather the slices into `p.data.reshape(-1)`. `free`: `free_storage` each
    parameter. `reduce_gradient`: as in ZeRO-2, then free the parameter — backward is done with it.
    Nothing is gathered after the optimizer step: the next forward does it.
    """),
    exercise_from(zero.ZeRO3),
    code("""
    lab03.check_zero3(ZeRO3)
    """),
    md("""
    ## Summary

    * A data-parallel rank keeps 16 bytes per fp32 parameter with AdamW: 4 of parameters, 4 of gradients,
      8 of optimizer state. ZeRO-1, 2 and 3 shard these one after another, down to 16/N.
    * ZeRO-1 and ZeRO-2 send exactly DDP's bytes: a reduce-scatter plus an all-gather *is* an all-reduce.
      ZeRO-2's gradients are reduce-scattered from a post-accumulate-grad hook, while backward goes on.
    * ZeRO-3 — FSDP's `FULL_SHARD` — gathers each unit before its forward, frees it, gathers it again
      before its backward, and reduce-scatters each gradient: 1.5× DDP's bytes for 1/N of the parameters.
      Freeing is `storage.resize_(0)`, so the tensors autograd saved stay valid once re-gathered.
    * What this leaves out, and the next labs add: one flat buffer per unit instead of one collective per
      parameter (lab 04, FSDP1), per-parameter sharding as DTensors (lab 05, FSDP2), mixed precision
      (lab 06), and prefetching the next unit while this one computes (lab 07).
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
