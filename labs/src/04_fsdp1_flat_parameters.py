"""Lab 04: FSDP1, flat parameters: flatten -> pad -> shard, hooks, strategies, wrapping, gradients."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 04 — FSDP1: one flat parameter per unit

    **Goals.**

    1. Flatten → pad → shard a transformer block by hand, and see which rank owns which slice of
       which original parameter (including one that straddles two ranks).
    2. Watch the hooks: when a unit is gathered and freed in forward and backward (timeline + memory).
    3. Compare the sharding strategies (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD) and the
       wrapping granularity: memory against traffic.
    4. Where the gradient goes: one flat fp32 buffer (fairscale's layout) against per-parameter fp32
       copies concatenated at the end, and frozen units resharded in backward as soon as their input
       gradients exist (what PyTorch's FSDP1 does too).
    5. Write two pieces of FSDP1 yourself: a rank's slice of the flat parameter (padding included), and
       the post-backward reduce-scatter of the flat gradient; both are checked against fsdp_lab's FSDP1.
    """),
    code("""
    %matplotlib inline
    import functools, math, os
    import torch
    import matplotlib.pyplot as plt
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab.fsdp1 import (FullyShardedDataParallel as FSDP, ModuleWrapPolicy, MixedPrecision,
                                ShardingStrategy, shard_boundaries, size_based_auto_wrap_policy)
    from fsdp_lab.memory.buffer_peak import GradBufferPeak
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, TransformerBlock
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab_files, lab04
    from fsdp_lab.workshop.measure import wire_bytes

    files = lab_files("04_fsdp1_flat_parameters")   # labs/figures/04_*, from labs/ or labs/solutions/
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: flatten → pad → shard

    An FSDP1 *unit* lays all its parameters end to end in one 1-D tensor (registration order), pads it
    with zeros to a multiple of the world size N, and gives rank r the contiguous slice
    `[r·S, (r+1)·S)` with `S = ceil(total / N)` — PyTorch's FSDP1 cuts it with `torch.chunk` and pads
    the last piece the same way (and, with `use_orig_params=True`, also inserts alignment padding so
    each parameter starts on a 16-byte boundary; fsdp_lab does not). Parameters do not care where the
    cuts fall: a parameter may be owned completely, partly (it *straddles* two ranks) or not at all.
    """),
    code("""
    block = Llama("cpu", seed=0).layers[0]
    names = [n.replace(".weight", "") for n, _ in block.named_parameters()]
    numels = [p.numel() for p in block.parameters()]
    total = sum(numels)

    def layout(world):
        shard = math.ceil(total / world)
        print(f"{world} ranks: total {total:,} elements, padded {shard * world:,}, shard {shard:,} per rank")
        for rank in range(world):
            owned = [f"{n}[{a}:{b}]" + ("" if (a, b) == (0, m) else "*")
                     for n, m, (a, b) in zip(names, numels, shard_boundaries(numels, world, rank)) if b > a]
            pad = max(0, (rank + 1) * shard - total)
            print(f"  rank {rank}: " + ", ".join(owned) + (f", padding[{pad}]" if pad else ""))

    layout(2)
    layout(3)
    print("* = part of a parameter that straddles two ranks")
    """),
    code("""
    def draw_layout(world, ax):
        shard = math.ceil(total / world)
        colors = plt.cm.tab10.colors
        labelled = set()
        for rank in range(world):
            lo = rank * shard
            for i, (n, (a, b)) in enumerate(zip(names, shard_boundaries(numels, world, rank))):
                if b > a:
                    start = sum(numels[:i]) + a - lo
                    ax.barh(rank, b - a, left=start, color=colors[i % 10], edgecolor="white",
                            label=None if n in labelled else f"{n} ({numels[i]:,})")
                    labelled.add(n)
                    if numels[i] < 0.01 * total:   # too thin to see: point at it
                        ax.annotate(f"{n} ({b - a})", (start + (b - a) / 2, rank - 0.4),
                                    xytext=(start + (b - a) / 2, rank - 0.75), fontsize=7, ha="center",
                                    arrowprops=dict(arrowstyle="->", color=colors[i % 10]))
            pad = max(0, (rank + 1) * shard - total)
            if pad:
                ax.barh(rank, pad, left=shard - pad, color="lightgrey", hatch="//", label=f"padding ({pad})")
                ax.annotate(f"padding ({pad} zeros)", (shard, rank + 0.4), xytext=(shard * 0.85, rank + 0.75),
                            fontsize=7, ha="center", arrowprops=dict(arrowstyle="->", color="black"))
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.set_ylim(world - 0.1, -1.0)
        ax.set_xlim(0, shard * 1.01)
        ax.set_xlabel("element offset inside the rank's flat shard")
        ax.set_title(f"one TransformerBlock flattened and sharded over {world} ranks")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
        return ax

    fig, ax = plt.subplots(figsize=(10, 3.6))
    draw_layout(3, ax)
    files.savefig(fig, "flat_layout_3_ranks.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    ## 2. On real ranks: what `named_parameters()` shows

    PyTorch's FSDP1 defaults to `use_orig_params=False`, where `named_parameters()` and the optimizer see
    one `FlatParameter` per unit; fsdp_lab implements only `use_orig_params=True` (what FSDP1 needs for
    `torch.compile` and for per-parameter optimizer settings). With it the original `Parameter` objects
    stay on their modules with their original names (fsdp_lab's `named_parameters()` drops the
    `_fsdp_wrapped_module.` prefixes; PyTorch's drops them only inside `summon_full_params`), but outside
    forward each one's `.data` is a **1-D view of the rank's shard**: the
    whole parameter flattened, a part of it (straddling), or an empty `(0,)` tensor. The optimizer
    steps these views, which writes straight into the flat shard.
    """),
    code("""
    def what_each_rank_sees():
        import torch.distributed as dist
        model = FSDP(Llama("cpu", seed=0), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
                  if n.startswith("layers.0.") and ("w1" in n or "w2" in n or "wq" in n)}
        units = {h.unit_name: u for u in model.modules() if isinstance(u, FSDP) for h in u._handles}
        sizes = [(h.unit_name, h.numel, h.padded_numel, h.shard_numel) for u in units.values() for h in u._handles]
        (layer0,) = units["layers.0"]._handles
        with FSDP.summon_full_params(model):
            full = tuple(dict(model.named_parameters())["layers.0.feed_forward.w1.weight"].shape)
        return dist.get_rank(), shapes, sizes, full, layer0.flat_shard.detach().clone()

    three_ranks = fsdp_lab.launch(what_each_rank_sees, world_size=3, print_ranks=None)
    for rank, shapes, sizes, full, _ in three_ranks:
        print(f"rank {rank}: " + ", ".join(f"{n.split('.')[-2]} {s}" for n, s in shapes.items()))
    print("units (name, elements, padded, per-rank shard):", sizes)
    print("inside summon_full_params w1 is", full)
    layer0_shards = {rank: shard for rank, *_, shard in three_ranks}   # for the exercise below
    """),
    md("""
    ## 3. Exercise: a rank's slice of the flat parameter

    Write `rank_shard(params, world, rank)`: the 1-D tensor rank `rank` keeps for a unit whose parameters
    are `params` (in flattening order) — flatten each, lay them end to end, pad with zeros to a multiple
    of `world`, and cut `world` equal pieces. The check compares it with FSDP1's arithmetic on 40 random
    units and with the `layers.0` shards the 3 real ranks of section 2 hold.
    """),
    exercise("""
    def rank_shard(params, world, rank):
        ### BEGIN SOLUTION
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        shard = math.ceil(flat.numel() / world)
        flat = torch.cat([flat, flat.new_zeros(shard * world - flat.numel())])
        return flat[rank * shard:(rank + 1) * shard]
        ### END SOLUTION
        ### STUB raise NotImplementedError("flat = cat of p.reshape(-1); pad with zeros to ceil(numel / world) * world; return this rank's piece")
    """),
    code("""
    lab04.check_rank_shard(rank_shard, real_shards=layer0_shards, params=list(block.parameters()))
    """),
    md("""
    ## 4. The hooks in time: gathered, used, freed

    One FULL_SHARD step on 2 ranks, each block its own unit. Forward: each unit is all-gathered in its
    pre-forward hook and freed after its forward (the root — embeddings, final norm, output — stays
    gathered: backward needs it at once). Backward: each block's unit is gathered again (prefetched one
    unit ahead with `BACKWARD_PRE`); once all its gradients exist it is freed and its flat gradient is
    reduce-scattered (as in PyTorch's post-backward hook: reshard, then reduce).

    Besides the timeline, each run samples rank 0's memory and which units are gathered at named
    moments: before each block's attention and feed-forward in forward (and after its feed-forward),
    before each block's feed-forward and attention in backward, after backward and after the step.
    """),
    code("""
    def one_step(strategy="FULL_SHARD", wrapping="per block"):
        import torch.distributed as dist
        policies = {"per block": ModuleWrapPolicy({TransformerBlock}), "whole model": None,
                    "per linear": functools.partial(size_based_auto_wrap_policy, min_num_params=40_000)}
        model = FSDP(Llama("cpu", seed=0), sharding_strategy=ShardingStrategy[strategy],
                     auto_wrap_policy=policies[wrapping])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rank, world = dist.get_rank(), dist.get_world_size()
        batch = lambda step: shard_batch(global_batch(512, 8, 32, step=step), rank, world)
        model(batch(0)).loss.backward(); opt.step(); opt.zero_grad()   # records the execution order
        units = {h.unit_name: u for u in model.modules() if isinstance(u, FSDP) for h in u._handles}
        samples = []
        def sample(label):
            gathered = {n: sum(h.unsharded_bytes() for h in u._handles) for n, u in units.items()}
            samples.append((label, gathered, mt.current()))
        hooks = []
        for i, blk in enumerate(model.blocks()):
            for part, short in ((blk.attention, "attn"), (blk.feed_forward, "ffn")):
                hooks.append(part.register_forward_pre_hook(lambda *_, l=f"fwd L{i} {short}": sample(l)))
                hooks.append(part.register_full_backward_pre_hook(lambda *_, l=f"bwd L{i} {short}": sample(l)))
            hooks.append(blk.feed_forward.register_forward_hook(lambda *_, l=f"fwd L{i} end": sample(l)))
        with Timeline() as tl, MemoryTracker(model, opt) as mt:
            tl.attach(model, [(f"layers.{i}", b) for i, b in enumerate(model.blocks())])
            loss = model(batch(1)).loss
            sample("loss")
            loss.backward()
            sample("after backward")
            opt.step(); opt.zero_grad()
            sample("after step")
        tl.detach()
        for h in hooks:
            h.remove()
        comms = tl.comm_events()
        # each rank's loss is the mean over its share of the batch; their mean over ranks is the loss
        # of the whole batch (after the recorded step, so it adds nothing to the counts below)
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        return {"timeline": tl, "samples": samples, "peak": mt.peak(), "loss": whole.item() / world,
                "sent": wire_bytes(comms),
                "comms": {n: (sum(1 for e in comms if e.name == n), sum(e.bytes for e in comms if e.name == n))
                          for n in ("all_gather", "reduce_scatter", "all_reduce")}}

    def compare(settings):
        return {f"{s} / {w}": one_step(s, w) for s, w in settings}

    # every setting of section 5 on 2 ranks in one launch; per rank: {setting: result}
    settings = [("FULL_SHARD", "per block"), ("SHARD_GRAD_OP", "per block"), ("NO_SHARD", "per block"),
                ("FULL_SHARD", "whole model"), ("FULL_SHARD", "per linear")]
    two_ranks = fsdp_lab.launch(compare, settings, world_size=2)
    runs = [r["FULL_SHARD / per block"] for r in two_ranks]
    for name, (count, nbytes) in runs[0]["comms"].items():
        print(f"{name:15} {count:3d} calls  {nbytes / 2**20:7.3f} MiB")
    print()
    print("rank 0, gathered units at each moment (MiB of unsharded parameters per unit):")
    unit_names = list(runs[0]["samples"][0][1])
    print(f"{'moment':16}" + "".join(f"{n:>9}" for n in unit_names))
    for label, gathered, _ in runs[0]["samples"]:
        print(f"{label:16}" + "".join(f"{gathered[n] / 2**20:9.3f}" if gathered[n] else f"{'-':>9}"
                                      for n in unit_names))
    """),
    code("""
    fig = lab04.draw_step(runs, "FULL_SHARD, one unit per block, 2 ranks: time line (all-gathers orange)")
    files.savefig(fig, "full_shard_timeline_memory.png", dpi=90)
    """, tags=["nbval-ignore-output"]),
    md("""
    One unit per block plus the root: in forward every unit is gathered, in backward every unit but the root
    again (the root is not freed after forward), and every unit reduce-scatters once. The table above and the middle panel are the same samples: in forward one block at
    a time is gathered beside the root; in backward the block being differentiated and, at some moments,
    the next one (prefetched) — each freed as soon as all its gradients exist, before they are reduce-scattered.

    ## 5. Strategies and wrapping: memory against traffic

    Same model, same data, one step each. The wrappings: `per block` (one unit per transformer block), `whole
    model` (one unit), and `per linear`, a size-based policy (`min_num_params=40_000`): each feed-forward
    linear is large enough to be its own unit, while the attention's four smaller linears only pass the
    threshold together, as one attention unit. The `loss` column is the loss of the whole batch (each rank's
    loss on its share, averaged over the ranks), so it must agree in every row; peak memory and bytes sent do
    not. PyTorch's HYBRID_SHARD shards within a node (as many ranks as the node has GPUs) and replicates
    across nodes. CPU ranks have no nodes, so fsdp_lab splits the world itself (`fsdp_lab/fsdp1/groups.py`):
    the largest divisor of the world size that is at most its square root is the number of replicas, so 4
    ranks shard within {0,1} and {2,3} and all-reduce gradients across {0,2} and {1,3}, and a world that does
    not split into at least two groups of at least two ranks (a prime number of ranks, for one) is refused;
    the widget below offers it only where it runs. The batch is the same 8 sequences in every row, so a rank
    holds 4 of them on 2 ranks and 2 on 4 ranks: the 4-rank rows' peaks (their activations above all) compare
    only with each other. Each setting is measured with its own tracker, which counts only the storages of the
    model and optimizer it tracks, so runs earlier in the same process do not show up.

    `sent` is what one rank sends in the step (MiB), counted as a ring sends it — nccl-tests'
    bus-bandwidth factors: (n−1)/n of each all-gather's output and of each reduce-scatter's input,
    2(n−1)/n of each all-reduce's buffer, with n the ranks in that collective's group (the whole world,
    except HYBRID_SHARD's, whose all-gathers, reduce-scatters and all-reduces each run in a group of 2).
    """),
    code("""
    four_ranks = fsdp_lab.launch(compare, [("HYBRID_SHARD", "per block"), ("FULL_SHARD", "per block")],
                                 world_size=4)
    cache = {(k, 2): [r[k] for r in two_ranks] for k in two_ranks[0]}
    cache.update({(k, 4): [r[k] for r in four_ranks] for k in four_ranks[0]})
    table = {f"{k} ({n} ranks)": runs_[0] for (k, n), runs_ in cache.items()}
    lab04.print_strategy_table(table)   # loss, collectives per step, MiB sent, peak and its categories
    """),
    code("""
    fig = lab04.draw_strategy_peaks(table)
    files.savefig(fig, "strategies_peak.png", dpi=90, bbox_inches="tight")
    """, tags=["nbval-ignore-output"]),
    code("""
    peaks = {n: r["peak"] for n, r in table.items()}
    total_peak = {n: sum(p.values()) for n, p in peaks.items()}
    pb, pl, wm = (total_peak[f"FULL_SHARD / {w} (2 ranks)"] for w in ("per block", "per linear", "whole model"))
    sgo, ns = total_peak["SHARD_GRAD_OP / per block (2 ranks)"], total_peak["NO_SHARD / per block (2 ranks)"]
    unsh = {w: peaks[f"FULL_SHARD / {w} (2 ranks)"].get("unsharded_params", 0) for w in
            ("whole model", "per block", "per linear")}
    order = sorted(("whole model", "per block", "per linear"), key=lambda w: -total_peak[f"FULL_SHARD / {w} (2 ranks)"])
    print(f"FULL_SHARD peaks on 2 ranks: whole model {wm / 2**20:.2f}, per block {pb / 2**20:.2f}, "
          f"per linear {pl / 2**20:.2f} MiB -> highest to lowest: {', '.join(order)}")
    print(f"unsharded parameters at the peak: " + ", ".join(f"{w} {v / 2**20:.3f} MiB" for w, v in unsh.items()))
    print(f"per linear / per block peak: {pl / pb:.3f} ({'lower' if pl < pb else 'not lower'}); "
          f"SHARD_GRAD_OP / FULL_SHARD: {sgo / pb:.3f}; NO_SHARD / FULL_SHARD: {ns / pb:.3f}")
    sent = {n: r["sent"] for n, r in table.items()}
    ddp = sent["NO_SHARD / per block (2 ranks)"]
    print("sent per rank / NO_SHARD's, 2 ranks: " + ", ".join(
        f"{n.removesuffix(' (2 ranks)')} {v / ddp:.3f}" for n, v in sent.items() if n.endswith("(2 ranks)")))
    print(f"sent per rank, 4 ranks: HYBRID_SHARD / FULL_SHARD "
          f"{sent['HYBRID_SHARD / per block (4 ranks)'] / sent['FULL_SHARD / per block (4 ranks)']:.3f}")
    """),
    md("""
    Read the table: SHARD_GRAD_OP skips the backward all-gathers (4 fewer) and pays with memory (the gathered
    parameters stay from forward to backward). It sends exactly what NO_SHARD sends: a reduce-scatter and an
    all-gather of the same bytes cost a rank what one all-reduce of them does — ZeRO-2 has DDP's traffic.
    FULL_SHARD gathers each block again in backward and sends more (the ratio above), though not quite
    ZeRO-3's ratio, 3(N−1)/N of the parameters' bytes against DDP's 2(N−1)/N (lab 03), because the root is not
    gathered again. NO_SHARD moves gradients with one all-reduce per unit and keeps everything replicated (the
    highest peak of the per-block settings). The wrapping rows trade the other way: a whole-model unit gathers
    everything at once (one all-gather, the largest `unsharded_params` at its peak) and, being the root, is
    not gathered again in backward, so it sends what NO_SHARD sends; per-linear units the opposite (many small
    collectives, the smallest gathered set), and they send more than per-block units: the embedding and output
    layers become units of their own, gathered again in backward, where per block they sit in the root,
    gathered once. On 4 ranks HYBRID_SHARD sends less per rank than FULL_SHARD (the last line): its
    all-gathers and reduce-scatters run within groups of 2, where a rank sends half of each collective rather
    than three quarters, and its all-reduce across groups carries only the gradient shard. The lines above
    say, from this run's numbers, how the three FULL_SHARD peaks order.

    ## 6. fp32 gradients: one flat buffer instead of per-parameter copies and `torch.cat`

    With bf16 compute and fp32 reduction, every parameter's bf16 gradient must become fp32 before the
    reduce-scatter. Three ways to get there:

    * **PyTorch's FSDP1**: the parameter views are made by splitting the flat parameter, so autograd's
      backward of that split already concatenates the per-parameter gradients into one flat gradient in
      the compute dtype (bf16); the post-backward hook casts it with a single `.to(reduce_dtype)`. There
      is no per-parameter fp32 copy; for a moment the bf16 flat gradient and its fp32 copy coexist. Under
      `no_sync` it accumulates the unsharded gradient in the compute dtype.
    * **`grad_accumulation="concat"`** here follows fairscale's `optimize_backward_concat` as first written
      (PR #1184, 2024, on its Llama-3 training branch, not `main`): an fp32 copy per parameter, concatenated
      once all of a backward's gradients exist — the copies and the concatenation coexist. fairscale
      concatenates only in the syncing backward (the last microbatch); `fsdp_lab` at every backward,
      under `no_sync` into a flat fp32 buffer kept for the next microbatch.
    * **`"flat"`** (the default) is fairscale's follow-up (PR #1186): one pre-allocated fp32 flat buffer,
      each gradient added straight into its slice, so at most one parameter's bf16 gradient exists beside
      it. The PR reports 17.4 → 15.1 GB peak reserved memory with identical loss.
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
            del model, opt
        return out

    result = fsdp_lab.launch(flat_vs_concat, world_size=2)[0]
    # ≈: bf16 digits that depend on the CPU's matrix kernels (oneDNN's AMX or AVX-512 BF16 where the
    # CPU has them, PyTorch's own elsewhere); labs/nbval_sanitize.cfg leaves them out of the comparison
    for mode, (losses, peak) in result.items():
        print(f"{mode:6} losses {' '.join(f'≈{l:.4f}' for l in losses)}  gradient buffers peak {peak / 2**20:.3f} MiB")
    print("identical losses at every step:", result["flat"][0] == result["concat"][0],
          "| flat / concat peak:", f"{result['flat'][1] / result['concat'][1]:.3f}")
    fp32_params = sum(p.numel() for p in Llama("cpu", seed=0).parameters()) * 4
    print(f"the whole model's parameters in fp32: {fp32_params / 2**20:.3f} MiB")
    """),
    md("""
    The model is one unit here, so the flat buffer holds the fp32 gradient of every parameter at once: as
    many bytes as the whole model's fp32 parameters (the last line), while `"concat"`'s per-parameter
    copies and their concatenation coexist, twice that (`benchmarks/fsdp1_flat_grad.py` measures the whole
    step's peak too). By the same byte count,
    PyTorch's single cast would sit between the two: a bf16 flat gradient (2 bytes per parameter) beside
    its fp32 copy (4 bytes).

    ## 7. Exercise: the post-backward reduce-scatter of the flat gradient

    Once every gradient of a unit has arrived, its flat gradient (padded, as long as the flat parameter)
    is reduced: each rank needs only the sum over ranks of **its own** slice, which is what a
    reduce-scatter gives, and the loss is a mean over the whole batch, so the sum is divided by the world
    size. Write `reduce_flat_grad(flat_grad)` with `collectives.reduce_scatter_tensor(output, input)`;
    return this rank's shard. The check runs it on 2 ranks after one backward of the whole model,
    compares with the sharded gradient fsdp_lab's FSDP1 leaves in `.grad` after the same backward, and
    records your collectives with a `Timeline`: the shard must come from a reduce-scatter.
    """),
    exercise("""
    def reduce_flat_grad(flat_grad):
        import torch.distributed as dist
        from fsdp_lab import collectives
        world = dist.get_world_size()
        ### BEGIN SOLUTION
        shard = torch.empty(flat_grad.numel() // world, dtype=flat_grad.dtype)
        collectives.reduce_scatter_tensor(shard, flat_grad)
        return shard / world
        ### END SOLUTION
        ### STUB raise NotImplementedError("shard = empty(numel // world); reduce_scatter_tensor(shard, flat_grad); divide by world")
    """),
    code("""
    lab04.check_reduce_flat_grad(reduce_flat_grad)
    """),
    md("""
    ## 8. Frozen units are resharded in backward

    A frozen unit is still gathered in backward — its weights are needed for the gradient of its input —
    but nobody waits for its gradient. Like PyTorch's FSDP1 (since PR #101982, 2023; fairscale ported it
    in PR #1159), this implementation reshards it as soon as the gradients w.r.t. the unit's inputs exist.
    PyTorch puts a `register_multi_grad_hook` on the forward inputs; fsdp_lab passes the inputs through one
    identity autograd node whose backward calls back (`fsdp_lab/passthrough.py`: the same moment, without
    a reference cycle between hook and model). PyTorch keeps its end-of-backward reshard as a fallback
    for a unit whose inputs need no gradient. Freeze `layers.1` and look at its gathered bytes when `layers.0`'s backward starts.
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
    ## 9. Explore

    Strategy, wrapping and world size → one recorded step: timeline, gathered units and rank 0's memory.
    The static figure is the widget's default setting (widget state is not saved in a notebook).
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
        return lab04.draw_step(runs, f"{strategy}, {wrapping}, {world_size} ranks"), text

    fig, text = render("FULL_SHARD", "per linear", 2)
    print(text)
    files.savefig(fig, "widget_default_per_linear.png", dpi=90)
    """),
    code("""
    # strategy, wrapping and world size; HYBRID_SHARD narrows the world sizes to those it can split (4)
    explorer = Explorer(lab04.explorer_controls(), render, title="FSDP1: one step", auto=False)
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## Summary

    * FSDP1 flattens each unit's parameters into one tensor, pads it to a multiple of N and gives each
      rank one contiguous slice; parameters may straddle ranks, which elementwise optimizers don't notice.
    * With `use_orig_params=True` each original parameter is a 1-D view of the rank's slice (full,
      partial or empty) between steps, and a full-shape view of the gathered tensor during compute.
    * FULL_SHARD gathers twice per step and frees in between; SHARD_GRAD_OP gathers once and holds;
      NO_SHARD has DDP's data flow (replicated, gradients all-reduced, here per unit without DDP's
      buckets); HYBRID_SHARD shards inside a group and replicates across.
    * Smaller units gather less at once and issue more, smaller collectives; section 5's lines say how
      the peaks of whole-model, per-block and per-linear wrapping order in this run.
    * Gradients: PyTorch's FSDP1 casts one flat gradient to `reduce_dtype`; fairscale's per-parameter
      fp32 copies + `torch.cat` (`"concat"`) and its flat fp32 buffer (`"flat"`, the default here) are
      both here. Frozen units are resharded as soon as their input gradients exist, as in PyTorch's FSDP1.
      What fsdp_lab does that PyTorch's FSDP1 cannot: separate flat parameters per (dtype,
      requires_grad) inside one unit (PyTorch refuses mixed dtypes, integer dtypes, and mixed
      `requires_grad` unless `use_orig_params=True`). Details: `docs/fsdp1.md`.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
