"""Lab 03: FSDP1, flat parameters: flatten -> pad -> shard, hooks, strategies, wrapping, gradients."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, md  # noqa: E402

CELLS = [
    md("""
    # Lab 03 — FSDP1: one flat parameter per unit

    **Goals.**

    1. Flatten → pad → shard a transformer block by hand, and see which rank owns which slice of
       which original parameter (including one that straddles two ranks).
    2. Watch the hooks: when a unit is gathered and freed in forward and backward (timeline + memory).
    3. Compare the sharding strategies (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD) and the
       wrapping granularity: memory against traffic.
    4. Two improvements over PyTorch's FSDP1: fp32 gradients accumulated in one flat buffer, and frozen
       units freed in backward as soon as they are no longer needed.
    5. Compute a rank's shard boundaries yourself and check them against the library.
    """),
    code("""
    %matplotlib inline
    import functools, math, os
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    from fsdp_lab.fsdp1 import (FullyShardedDataParallel as FSDP, ModuleWrapPolicy, MixedPrecision,
                                ShardingStrategy, shard_boundaries, size_based_auto_wrap_policy)
    from fsdp_lab.fsdp1.flat_grad import GradBufferPeak
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, TransformerBlock
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.memory_plots import plot_memory_curve
    from fsdp_lab.viz.widgets import Explorer

    FIGURES = "figures/03_fsdp1_flat_parameters"
    os.makedirs(FIGURES, exist_ok=True)
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: flatten → pad → shard

    An FSDP1 *unit* lays all its parameters end to end in one 1-D tensor (registration order), pads it
    with zeros to a multiple of the world size N, and gives rank r the contiguous slice
    `[r·S, (r+1)·S)` with `S = ceil(total / N)`. Parameters do not care where the cuts fall: a
    parameter may be owned completely, partly (it *straddles* two ranks) or not at all.
    """),
    code("""
    block = Llama("cpu", seed=0).layers[0]
    names = [n for n, _ in block.named_parameters()]
    numels = [p.numel() for p in block.parameters()]
    total = sum(numels)

    def layout(world):
        shard = math.ceil(total / world)
        print(f"{world} ranks: total {total:,} elements, padded {shard * world:,}, shard {shard:,} per rank")
        for rank in range(world):
            owned = [f"{n.replace('.weight', '')}[{a}:{b}]" + ("" if (a, b) == (0, m) else "*")
                     for n, m, (a, b) in zip(names, numels, shard_boundaries(numels, world, rank)) if b > a]
            print(f"  rank {rank}: " + ", ".join(owned))

    layout(2)
    layout(3)
    print("* = part of a parameter that straddles two ranks")
    """),
    code("""
    def draw_layout(world, ax=None):
        ax = ax or plt.subplots(figsize=(10, 0.6 + 0.5 * world))[1]
        shard = math.ceil(total / world)
        colors = plt.cm.tab10.colors
        for rank in range(world):
            lo = rank * shard
            for i, (n, (a, b)) in enumerate(zip(names, shard_boundaries(numels, world, rank))):
                if b > a:
                    start = sum(numels[:i]) + a - lo
                    ax.barh(rank, b - a, left=start, color=colors[i % 10], edgecolor="white",
                            label=n.replace(".weight", "") if rank == 0 or a > 0 else None)
            pad = max(0, (rank + 1) * shard - total)
            if pad:
                ax.barh(rank, pad, left=shard - pad, color="lightgrey", hatch="//", label="padding")
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.invert_yaxis()
        ax.set_xlabel("element offset inside the rank's flat shard")
        ax.set_title(f"one TransformerBlock flattened and sharded over {world} ranks")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=5, loc="upper center",
                  bbox_to_anchor=(0.5, -0.35))
        return ax

    fig, ax = plt.subplots(figsize=(10, 2.6))
    draw_layout(3, ax)
    fig.savefig(f"{FIGURES}/flat_layout_3_ranks.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    ## 2. On real ranks: what `named_parameters()` shows

    With `use_orig_params=True` the original `Parameter` objects stay on their modules with their
    original names, but outside forward each one's `.data` is a **1-D view of the rank's shard**: the
    whole parameter flattened, a part of it (straddling), or an empty `(0,)` tensor. The optimizer
    steps these views, which writes straight into the flat shard.
    """),
    code("""
    def what_each_rank_sees():
        import torch.distributed as dist
        model = FSDP(Llama("cpu", seed=0), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
                  if n.startswith("layers.0.") and ("w1" in n or "w2" in n or "wq" in n)}
        units = [(h.unit_name, h.numel, h.padded_numel, h.shard_numel)
                 for u in model.modules() if isinstance(u, FSDP) for h in u._handles]
        with FSDP.summon_full_params(model):
            full = tuple(dict(model.named_parameters())["layers.0.feed_forward.w1.weight"].shape)
        return dist.get_rank(), shapes, units, full

    for rank, shapes, units, full in fsdp_lab.launch(what_each_rank_sees, world_size=3, print_ranks=None):
        print(f"rank {rank}: " + ", ".join(f"{n.split('.')[-2]} {s}" for n, s in shapes.items()))
    print("units (name, elements, padded, per-rank shard):", units)
    print("inside summon_full_params w1 is", full)
    """),
    md("""
    ## 3. The hooks in time: gathered, used, freed

    One FULL_SHARD step on 2 ranks, each block its own unit. Forward: each unit is all-gathered in its
    pre-forward hook and freed after its forward (the root — embeddings, final norm, output — stays
    gathered: backward needs it at once). Backward: each unit is gathered again (prefetched one unit
    ahead with `BACKWARD_PRE`), its gradients are reduce-scattered, and it is freed.
    """),
    code("""
    def one_step(strategy="FULL_SHARD", wrapping="per block", world_policy=None):
        import torch.distributed as dist
        policies = {"per block": ModuleWrapPolicy({TransformerBlock}), "whole model": None,
                    "per linear": functools.partial(size_based_auto_wrap_policy, min_num_params=40_000)}
        model = FSDP(Llama("cpu", seed=0), sharding_strategy=ShardingStrategy[strategy],
                     auto_wrap_policy=policies[wrapping])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rank, world = dist.get_rank(), dist.get_world_size()
        batch = lambda step: shard_batch(global_batch(512, 8, 32, step=step), rank, world)
        model(batch(0)).loss.backward(); opt.step(); opt.zero_grad()   # records the execution order
        with Timeline() as tl, MemoryTracker(model, opt) as mt:
            tl.attach(model, [(f"layers.{i}", b) for i, b in enumerate(model.blocks())])
            loss = model(batch(1)).loss
            loss.backward()
            opt.step(); opt.zero_grad()
        tl.detach()
        comms = tl.comm_events()
        return {"timeline": tl, "memory": mt.timeline(), "peak": mt.peak(), "loss": loss.item(),
                "comms": {n: (sum(1 for e in comms if e.name == n), sum(e.bytes for e in comms if e.name == n))
                          for n in ("all_gather", "reduce_scatter", "all_reduce")}}

    def draw(runs, title):
        fig, (a, b) = plt.subplots(2, 1, figsize=(11, 6.5))
        plot_timeline(Timeline.merge([r["timeline"] for r in runs]), ax=a, title=title)
        plot_memory_curve(runs[0]["memory"], ax=b, title="rank 0 memory at phase boundaries")
        fig.tight_layout()
        return fig

    def compare(settings):
        return {f"{s} / {w}": one_step(s, w) for s, w in settings}

    # every setting of section 4 on 2 ranks in one launch; per rank: {setting: result}
    settings = [("FULL_SHARD", "per block"), ("SHARD_GRAD_OP", "per block"), ("NO_SHARD", "per block"),
                ("FULL_SHARD", "whole model"), ("FULL_SHARD", "per linear")]
    two_ranks = fsdp_lab.launch(compare, settings, world_size=2)
    runs = [r["FULL_SHARD / per block"] for r in two_ranks]
    for name, (count, nbytes) in runs[0]["comms"].items():
        print(f"{name:15} {count:3d} calls  {nbytes / 2**20:7.3f} MiB")
    """),
    code("""
    fig = draw(runs, "FULL_SHARD, one unit per block, 2 ranks")
    fig.savefig(f"{FIGURES}/full_shard_timeline_memory.png", dpi=90)
    """, tags=["nbval-ignore-output"]),
    md("""
    Five units → 5 all-gathers in forward and 4 in backward (the root is not gathered again), 5
    reduce-scatters. In the memory curve, `unsharded_params` rises and falls unit by unit.

    ## 4. Strategies and wrapping: memory against traffic

    Same model, same data, one step each. The losses must agree; peak memory and bytes moved do not.
    HYBRID_SHARD needs a world that factors: on 4 ranks, shard within {0,1} and {2,3}, all-reduce
    gradients across {0,2} and {1,3}.
    """),
    code("""
    four_ranks = fsdp_lab.launch(compare, [("HYBRID_SHARD", "per block"), ("FULL_SHARD", "per block")],
                                 world_size=4)
    cache = {(k, 2): [r[k] for r in two_ranks] for k in two_ranks[0]}
    cache.update({(k, 4): [r[k] for r in four_ranks] for k in four_ranks[0]})
    table = {f"{k} ({n} ranks)": runs_[0] for (k, n), runs_ in cache.items()}
    print(f"{'setting':38} {'loss':>7} {'AG':>4} {'RS':>4} {'AR':>4} {'MiB moved':>10}")
    for name, r in table.items():
        c = r["comms"]
        moved = sum(b for _, b in c.values()) / 2**20
        print(f"{name:38} {r['loss']:7.4f} {c['all_gather'][0]:4d} {c['reduce_scatter'][0]:4d} "
              f"{c['all_reduce'][0]:4d} {moved:10.3f}")
    """),
    code("""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    peaks = {n: r["peak"] for n, r in table.items()}
    cats = ["sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads", "optimizer_state",
            "activations", "temporaries", "comm_buffers"]
    left = [0.0] * len(peaks)
    for cat in cats:
        vals = [p.get(cat, 0) / 2**20 for p in peaks.values()]
        ax.barh(list(peaks), vals, left=left, label=cat)
        left = [l + v for l, v in zip(left, vals)]
    ax.invert_yaxis(); ax.set_xlabel("rank 0 peak, MiB"); ax.legend(fontsize=7, ncol=4, loc="lower right")
    ax.set_title("peak memory by category at the moment of the peak")
    fig.tight_layout(); fig.savefig(f"{FIGURES}/strategies_peak.png", dpi=90)
    for name, p in peaks.items():
        print(f"{name:38} peak {sum(p.values()) / 2**20:6.2f} MiB")
    """, tags=["nbval-ignore-output"]),
    md("""
    Read the table: SHARD_GRAD_OP skips the backward all-gathers (4 fewer) and pays with memory;
    NO_SHARD moves gradients with one all-reduce per unit and keeps everything replicated; a whole-model
    unit gathers everything at once (one all-gather, the highest `unsharded_params`), per-linear units
    the opposite (many small collectives, the lowest).

    ## 5. fp32 gradients: one flat buffer instead of `torch.cat`

    With bf16 compute and fp32 reduction, every parameter's bf16 gradient must become fp32. PyTorch's
    FSDP1 makes an fp32 copy per parameter and concatenates them (`grad_accumulation="concat"` here): the
    copies and the concatenation coexist. The default `"flat"` adds each gradient straight into its
    slice of one pre-allocated fp32 buffer. Same numbers, fewer bytes.
    """),
    code("""
    def flat_vs_concat():
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out = {}
        for mode in ("concat", "flat"):
            model = FSDP(Llama("cpu", seed=0), mixed_precision=policy, grad_accumulation=mode)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses, peak = [], 0
            for step in range(3):
                with GradBufferPeak() as gp:
                    loss = model(shard_batch(global_batch(512, 4, 16, step=step), rank, world)).loss
                    loss.backward()
                opt.step(); opt.zero_grad()
                losses.append(loss.item()); peak = max(peak, gp.peak)
            out[mode] = (losses, peak)
        return out

    result = fsdp_lab.launch(flat_vs_concat, world_size=2)[0]
    for mode, (losses, peak) in result.items():
        print(f"{mode:6} losses {[round(l, 4) for l in losses]}  gradient buffers peak {peak / 2**20:.3f} MiB")
    print("identical losses:", result["flat"][0] == result["concat"][0],
          "| flat / concat peak:", f"{result['flat'][1] / result['concat'][1]:.3f}")
    """),
    md("""
    The model is one unit here, so its gradient buffers are the largest thing in backward, and the
    saving shows in the whole step's peak too: the flat gradient is reduced in place, with no receive
    buffer as large as itself (`benchmarks/fsdp1_flat_grad.py` measures both peaks).

    ## 6. Frozen units are freed in backward

    A frozen unit is still gathered in backward — its weights are needed for the gradient of its input —
    but nobody waits for its gradient. PyTorch's FSDP1 frees it at the end of backward; here it is freed
    as soon as the gradient w.r.t. the unit's input exists (`register_multi_grad_hook` on its inputs).
    Freeze `layers.1` and look at its gathered bytes when `layers.0`'s backward starts.
    """),
    code("""
    def frozen_bytes():
        base = Llama("cpu", seed=0)
        for p in base.layers[1].parameters():
            p.requires_grad_(False)
        model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        units = {h.unit_name: u for u in model.modules() if isinstance(u, FSDP) for h in u._handles}
        seen = {}
        gathered = lambda name: sum(h.unsharded_bytes() for h in units[name]._handles)
        units["layers.1"].module.register_full_backward_pre_hook(
            lambda *_: seen.__setitem__("layers.1 backward starts", gathered("layers.1")))
        units["layers.0"].module.register_full_backward_pre_hook(
            lambda *_: seen.__setitem__("layers.0 backward starts", gathered("layers.1")))
        model(global_batch(512, 2, 16)).loss.backward()
        return seen

    for moment, nbytes in fsdp_lab.launch(frozen_bytes, world_size=2)[0].items():
        print(f"layers.1 (frozen) gathered bytes when {moment}: {nbytes:,}")
    """),
    md("""
    ## 7. Explore

    Strategy, wrapping and world size → one recorded step: timeline and rank 0's memory. The static
    figure is the widget's default setting (widget state is not saved in a notebook).
    """),
    code("""
    def render(strategy, wrapping, world_size):
        key = (f"{strategy} / {wrapping}", world_size)
        if key not in cache:  # runs already measured above are reused
            cache[key] = fsdp_lab.launch(one_step, strategy, wrapping, world_size=world_size)
        runs = cache[key]
        c = runs[0]["comms"]
        text = (f"all-gathers {c['all_gather'][0]}, reduce-scatters {c['reduce_scatter'][0]}, "
                f"all-reduces {c['all_reduce'][0]}; peak unsharded params "
                f"{runs[0]['peak'].get('unsharded_params', 0) / 2**20:.2f} MiB")
        return draw(runs, f"{strategy}, {wrapping}, {world_size} ranks"), text

    fig, text = render("FULL_SHARD", "per linear", 2)
    print(text.split(";")[0])
    fig.savefig(f"{FIGURES}/widget_default_per_linear.png", dpi=90)
    """),
    code("""
    explorer = Explorer({
        "strategy": widgets.Dropdown(options=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                                     value="FULL_SHARD", description="strategy"),
        "wrapping": widgets.Dropdown(options=["per block", "whole model", "per linear"], value="per linear",
                                     description="wrapping"),
        "world_size": widgets.Dropdown(options=[1, 2, 4], value=2, description="world size"),
    }, render, title="FSDP1: one step", auto=False)
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 8. Exercise: a rank's shard boundaries

    Write `my_boundaries(numels, world, rank)`: for each parameter (element counts in flattening order)
    the `(start, end)` range of its own flattened elements that `rank` owns; `(x, x)` (empty) when it owns
    none. The check compares with the library on many shapes and with what real ranks hold.
    """),
    code("""
    def my_boundaries(numels, world, rank):
        shard = math.ceil(sum(numels) / world)
        lo, hi = rank * shard, (rank + 1) * shard
        out, offset = [], 0
        for n in numels:
            start = min(max(lo - offset, 0), n)
            end = min(max(hi - offset, 0), n)
            out.append((start, max(start, end)))
            offset += n
        return out
    """),
    code("""
    def check(fn):
        gen = torch.Generator().manual_seed(0)
        for _ in range(300):
            numels = torch.randint(1, 40, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist()
            world = int(torch.randint(1, 9, (1,), generator=gen))
            for rank in range(world):
                if fn(numels, world, rank) != shard_boundaries(numels, world, rank):
                    return f"wrong for numels={numels}, world={world}, rank={rank}"
        # what 3 real ranks hold for layers.0 (section 2): w1 on rank 1 is w1[12118:45056]
        if fn(numels_block, 3, 1)[names.index("feed_forward.w1.weight")] != (12118, 45056):
            return "wrong for the real block on rank 1"
        return "correct"

    numels_block = numels
    print(check(my_boundaries))
    """),
    md("""
    ## Summary

    * FSDP1 flattens each unit's parameters into one tensor, pads it to a multiple of N and gives each
      rank one contiguous slice; parameters may straddle ranks, which elementwise optimizers don't notice.
    * With `use_orig_params=True` each original parameter is a 1-D view of the rank's slice (full,
      partial or empty) between steps, and a full-shape view of the gathered tensor during compute.
    * FULL_SHARD gathers twice per step and frees in between; SHARD_GRAD_OP gathers once and holds;
      NO_SHARD is DDP; HYBRID_SHARD shards inside a group and replicates across.
    * Smaller units: lower peak, more (smaller) collectives.
    * fsdp_lab adds separate flat parameters per (dtype, requires_grad), a flat fp32 gradient buffer,
      and frozen units freed in backward. Details: `docs/fsdp1.md`.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
