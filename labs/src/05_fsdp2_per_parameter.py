"""Lab 05: FSDP2, per-parameter sharding with DTensor; the life of one parameter through a step."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 05 — FSDP2: every parameter is a DTensor

    **Goals.**

    1. See how one weight is cut into `Shard(0)` pieces rank by rank, how uneven shapes are padded, and how
       that differs from lab 04's flat parameter; write a parameter's padded shard yourself.
    2. Know why FSDP2 exists: what per-parameter sharding allows that a flat parameter does not, and what it
       costs (copy-in / copy-out around every collective).
    3. Follow one parameter through a training step: gathered → used → freed → gathered again →
       gradient reduce-scattered — on a real timeline and memory curve.
    4. Compare `reshard_after_forward=True` and `False`: memory against number of all-gathers.
    5. Check that `fsdp_lab.fsdp2.fully_shard` gives the same losses as PyTorch's own `fully_shard`.
    6. Write the pre-forward all-gather of one module yourself and check it against one-process compute.
    """),
    code("""
    %matplotlib inline
    import math, os
    import torch
    import torch.nn as nn
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import collectives
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.memory_plots import COLORS_BESIDE_TIMELINE as MEMORY_COLORS
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.fsdp1 import shard_boundaries
    from fsdp_lab.workshop import lab_files, lab05

    files = lab_files("05_fsdp2_per_parameter")   # labs/figures/05_*, from labs/ or labs/solutions/
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: `Shard(0)` and padding

    FSDP2 cuts every parameter along dim 0 the way `torch.chunk` does: each rank gets `ceil(rows / W)`
    rows, the last ranks fewer, maybe none. To all-gather equal sizes, every rank stores its rows in a
    buffer of the full `ceil(rows / W)` rows (zeros below). The parameter the optimizer sees is a
    `DTensor` whose local tensor is the unpadded part.
    """),
    code("""
    def shard_rows(rows, world):
        per_rank = math.ceil(rows / world)
        held = [max(0, min(per_rank, rows - r * per_rank)) for r in range(world)]
        return per_rank, held

    for name, shape, world in [("weight 5x3", (5, 3), 2), ("weight 5x3", (5, 3), 4), ("bias 7", (7,), 4)]:
        per_rank, held = shard_rows(shape[0], world)
        print(f"{name:10} on {world} ranks: padded rows/rank {per_rank}, real rows {held}, "
              f"padding rows {[per_rank - h for h in held]}")
    """),
    md("""
    The same `TransformerBlock` as in lab 04, on 3 ranks, both ways. FSDP1 (top) lays the block's parameters
    end to end and cuts the flat tensor in 3: a rank holds whole parameters, a piece of one, or none of
    another, and padding sits only at the end. FSDP2 (bottom) cuts **every** parameter by rows: each rank
    holds a third of every parameter, and each parameter whose rows do not divide by 3 carries its own
    padding. Each bar is what the rank contributes to the group's all-gather.
    """),
    code("""
    block = Llama("cpu", seed=0).layers[0]
    names = [n.replace(".weight", "") for n, _ in block.named_parameters()]
    shapes = [tuple(p.shape) for p in block.parameters()]
    numels = [math.prod(s) for s in shapes]
    WORLD = 3
    colors = plt.cm.tab10.colors
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    flat_shard = math.ceil(sum(numels) / WORLD)
    for rank in range(WORLD):
        for i, (a, b) in enumerate(shard_boundaries(numels, WORLD, rank)):
            if b > a:
                top.barh(rank, b - a, left=sum(numels[:i]) + a - rank * flat_shard, color=colors[i % 10])
        pad = max(0, (rank + 1) * flat_shard - sum(numels))
        if pad:
            top.barh(rank, pad, left=flat_shard - pad, color="lightgrey", hatch="//")
    per_param = []
    for rank in range(WORLD):
        left, real, padding = 0, 0, 0
        for i, shape in enumerate(shapes):
            rows, cols = math.ceil(shape[0] / WORLD), math.prod(shape[1:])
            held = max(0, min(rows, shape[0] - rank * rows))
            bottom.barh(rank, held * cols, left=left, color=colors[i % 10],
                        label=f"{names[i]} {shape}" if rank == 0 else None)
            if rows > held:
                bottom.barh(rank, (rows - held) * cols, left=left + held * cols, color="lightgrey", hatch="//",
                            label="padding" if rank == WORLD - 1 and not padding else None)
            left += rows * cols; real += held * cols; padding += (rows - held) * cols
        per_param.append((real, padding))
    for ax, title in ((top, "FSDP1: one flat parameter cut in 3 (lab 04)"),
                      (bottom, "FSDP2: every parameter cut by rows (Shard(0)), padded per parameter")):
        ax.set_yticks(range(WORLD), [f"rank {r}" for r in range(WORLD)]); ax.invert_yaxis(); ax.set_title(title)
    bottom.set_xlabel("element offset in the rank's all-gather input")
    bottom.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    files.savefig(fig, "flat_vs_per_parameter.png", dpi=90, bbox_inches="tight")
    print(f"FSDP1: {flat_shard:,} elements per rank, {flat_shard * WORLD - sum(numels)} padding in total (end of rank 2)")
    for rank, (real, padding) in enumerate(per_param):
        print(f"FSDP2 rank {rank}: {real:,} real + {padding:,} padding elements")
    """),
    md("""
    ## 2. On real ranks: what each rank holds

    `fully_shard(nn.Linear(3, 5))` on 4 ranks. Each rank reports its DTensor's placement, its local
    shape, and the size of the padded storage behind it.
    """),
    code("""
    def dtensor_per_rank():
        import torch.distributed as dist
        torch.manual_seed(0)
        layer = nn.Linear(3, 5)
        full = layer.weight.detach().clone()
        fully_shard(layer)
        w, b = layer.weight, layer.bias
        padded = layer._fsdp_state.group.fsdp_params[0]._sharded_data   # the weight's storage, with padding
        return {"rank": dist.get_rank(), "placements": str(w.placements), "global": tuple(w.shape),
                "weight local": tuple(w.to_local().shape),
                "weight storage": w.to_local().untyped_storage().nbytes() // 4,
                "bias local": tuple(b.to_local().shape)}, full, padded.clone()

    rows_per_rank = fsdp_lab.launch(dtensor_per_rank, world_size=4)
    for row, _, _ in rows_per_rank:
        print(row)
    weight_5x3 = rows_per_rank[0][1]                                      # for the exercise's check
    real_5x3 = {row["rank"]: padded for row, _, padded in rows_per_rank}
    """),
    md("""
    Rank 3 holds no rows of the 5×3 weight, yet it stores 2×3 floats (6 elements): the padding that keeps
    every rank's all-gather input the same size.

    ## 3. Exercise: a parameter's padded `Shard(0)` piece

    Write `shard_param(param, world, rank)`: the tensor rank `rank` stores for `param` — `ceil(rows / world)`
    rows, its own rows of `torch.chunk(param, world, dim=0)` on top (maybe none) and zero rows below. The
    check compares with `torch.chunk` plus padding on many shapes and worlds (it prints how many), and with
    the padded storage each of the 4 real ranks above holds for the 5×3 weight, value for value.
    """),
    exercise("""
    def shard_param(param, world, rank):
        ### BEGIN SOLUTION
        rows = math.ceil(param.shape[0] / world)
        mine = param[rank * rows:(rank + 1) * rows]          # what torch.chunk gives rank `rank` (maybe empty)
        padded = param.new_zeros((rows, *param.shape[1:]))
        padded[:mine.shape[0]] = mine
        return padded
        ### END SOLUTION
        ### STUB raise NotImplementedError("rows = ceil(rows / world); this rank's rows of param on top, zero rows below")
    """),
    code("""
    lab05.check_shard_param(shard_param, real=real_5x3, param=weight_5x3)
    """),
    md("""
    ## 4. Why FSDP2 exists

    Lab 04's flat parameter makes one all-gather per unit cheap — the gathered tensor *is* the parameters, no
    copy — but it ties every parameter of a unit together: PyTorch's FSDP1 refuses mixed dtypes and integer
    dtypes in one flat parameter, and mixed `requires_grad` unless `use_orig_params=True`; a parameter can
    straddle two ranks, so anything done per parameter (a quantized weight's blocks, for instance) has to work
    around the cuts. FSDP2 (PyTorch's `fully_shard`, tracked in pytorch issue #114299) shards each
    parameter on its own, as a DTensor:

    * **Frozen weights of other dtypes beside trainable ones in one group.** The group's all-gather inputs of
      different dtypes are viewed as bytes (`uint8`) and gathered together; the post-backward reduce-scatter
      takes only the parameters that got a gradient, so frozen and trainable weights share a group. The
      trainable ones must still share one dtype (their gradients are reduced in one buffer; PyTorch's
      `fully_shard` refuses otherwise: "FSDP expects uniform original parameter dtype").
    * **Tensor subclasses.** A parameter type can say what it sends (`fsdp_pre_all_gather`) and how to rebuild
      itself (`fsdp_post_all_gather`): torchao's NF4 weight all-gathers its packed 4-bit codes and scales as
      they are (lab 08).
    * **Communication-free sharded state dicts**: each rank's DTensor shards are the state dict.
    * **Memory determinism.** FSDP1 frees memory used across CUDA streams with `Tensor.record_stream`, so the
      caching allocator can reuse it only when it next sees the stream finished; its `limit_all_gathers`
      blocks the CPU to keep that bounded. FSDP2 keeps references and CUDA events and waits on them instead:
      PyTorch's documentation calls this "deterministic and expected memory usage" that "does not require
      blocking the CPU"; torchtitan reports lower peak memory from it. (On CPU with gloo there are no streams:
      this lab cannot show it.)

    **The cost.** Every parameter's shard has its own storage, so a group's all-gather first copies all of
    them into one flat buffer (*copy-in*) and, after the collective, copies each parameter's rows out of every
    rank's part (*copy-out*); the reduce-scatter does the same with the gradients. FSDP1 needs no copy
    around its all-gather: the rank's shard is already one contiguous slice of the flat parameter, and the
    parameters are views of the gathered flat tensor. Its gradients are not free of copies: each one is
    concatenated or added into one flat gradient before the reduce-scatter (lab 04, section 6). And the
    optimizer steps DTensors, paying DTensor's per-operator dispatch on the CPU. Section 9 shows
    copy-in/copy-out on one group.

    ## 5. The life of one parameter through a step

    Below, the CPU Llama (4 blocks) is sharded with one `fully_shard` per block plus one for the root, and
    one training step is recorded with a `Timeline` (compute and collectives) and a `MemoryTracker`
    (bytes by category). We follow `layers.1`'s group: all-gathered before its forward, freed after it
    (`reshard_after_forward=True`), all-gathered again in backward (prefetched while `layers.2` computes),
    then its gradients are reduce-scattered.
    """),
    code("""
    def one_step(layer_reshard=True, per_block=True):
        import warnings
        import torch.distributed as dist
        # the timeline's backward hook on the embedding (whose input, token ids, needs no grad)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = Llama(LlamaConfig.from_name("cpu"), seed=0)
        if per_block:
            for layer in model.layers:
                fully_shard(layer, reshard_after_forward=layer_reshard)
        fully_shard(model, reshard_after_forward=None if per_block else layer_reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i):
            batch = shard_batch(global_batch(512, 8, 64, step=i), rank, world)
            loss = model(batch.input_ids, batch.labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        step(0)  # warm up: lazy init
        with Timeline() as tl, MemoryTracker(model, opt) as mt:
            tl.attach(model)
            loss = step(1)
        return {"timeline": tl, "memory": mt.timeline(), "max": mt.max_by_category(), "loss": loss,
                "comms": [(e.name, e.args.get("module")) for e in sorted(tl.comm_events(rank), key=lambda e: e.t_start)]}

    results = fsdp_lab.launch(one_step, world_size=2)
    r0 = results[0]
    print("collectives of layers.1 in one step:", [name for name, module in r0["comms"] if module == "layers.1"])
    print("all-gathers per step:", sum(name == "all_gather" for name, _ in r0["comms"]),
          "| reduce-scatters per step:", sum(name == "reduce_scatter" for name, _ in r0["comms"]))
    print(f"peak unsharded params: {r0['max']['unsharded_params'] / 2**20:.3f} MiB, "
          f"sharded params: {r0['max']['sharded_params'] / 2**20:.3f} MiB (rank 0)")
    """),
    code("""
    def draw(results, title=""):
        memory = results[0]["memory"]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [1.1, 1.3]})
        plot_timeline(Timeline.merge([r["timeline"] for r in results]), ax=ax1,
                      title=(title or "one step") + " (all-gathers orange)")
        cats = [c for c in MEMORY_COLORS if any(snap.get(c, 0) for _, snap in memory)]
        xs = list(range(len(memory)))
        ax2.stackplot(xs, *[[snap.get(c, 0) / 2**20 for _, snap in memory] for c in cats], labels=cats,
                      colors=[MEMORY_COLORS[c] for c in cats], step="post")
        ax2.set_xticks(xs, [label.replace("forward", "fwd").replace("backward", "bwd") for label, _ in memory],
                       rotation=65, ha="right", fontsize=7)
        ax2.set_xlabel("moment in the step (module forward/backward start and end, optimizer step)")
        ax2.set_ylabel("MiB"); ax2.set_title("rank 0 memory by category at those moments")
        ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        return fig

    fig = draw(results, "2 ranks, one fully_shard per block, reshard_after_forward=True")
    files.savefig(fig, "life_of_a_step.png", dpi=90)
    """, tags=["nbval-ignore-output"]),
    code("""
    print(f"{'moment (rank 0)':32} {'unsharded params':>17} {'comm buffers':>13} {'sharded grads':>14}   MiB")
    for label, snap in r0["memory"]:
        if label.startswith(("forward layers", "backward layers", "optimizer step end")):
            print(f"{label:32} {snap.get('unsharded_params', 0) / 2**20:17.3f} "
                  f"{snap.get('comm_buffers', 0) / 2**20:13.3f} {snap.get('sharded_grads', 0) / 2**20:14.3f}")
    block_mib = sum(p.numel() for p in Llama("cpu", seed=0).layers[0].parameters()) * 4 / 2**20
    print(f"one block: {block_mib:.3f} MiB gathered, {block_mib / 2:.3f} MiB shard per rank; the buffer of "
          f"its all-gather (the output, whose rank-0 rows are the copy-in input): {block_mib:.3f} MiB")
    """),
    md("""
    The table is the figure's samples at the blocks' boundaries. In forward, `unsharded_params` is the root
    (embeddings, final norm, output: kept gathered) plus one block at each block's start and only the root at
    its end: each block is gathered before its forward and freed after it. In backward `unsharded_params`
    holds one block beside the root at each of these moments, but that block is not the only one on the
    rank. Its pre-backward hook has already issued the next block's all-gather (the prefetch), and from
    `layers.3` to `layers.1` that all-gather's output, a whole block (the last line), waits in
    `comm_buffers` until the next block's backward starts and copies the parameters out. (The rank's own
    shard was copied into its rows of that output, the all-gather's input, as PyTorch's FSDP2 does: no
    second buffer.) So in
    backward a rank holds about two blocks' parameters, as FSDP1 does with `BACKWARD_PRE` (lab 04, section
    4), counted here in two categories. From `layers.2` on, the block before's gradients wait in
    `comm_buffers` too, as its reduce-scatter's input (one block more), and `sharded_grads` grow block by
    block as the reduce-scatters finish. The timeline shows each all-gather on the comm lane before the
    compute that uses it.

    ## 6. `reshard_after_forward`: memory against communication

    `True` frees each block after its forward and gathers it again in backward (more all-gathers, less
    memory); `False` keeps every block gathered from its forward to its backward. The first column is the
    peak of `unsharded_params` alone; the second adds `comm_buffers` at the same moment and takes the largest
    sum over the moments of section 5's figure, so it counts what waits in the collectives' buffers then:
    the prefetched block in the all-gather's and, from `layers.2` on, the gradients of the block before in
    the reduce-scatter's (section 5). With them, `True` saves less than the first column suggests.
    """),
    code("""
    def with_buffers(memory):
        return max(snap.get("unsharded_params", 0) + snap.get("comm_buffers", 0) for _, snap in memory)

    def summary(r):
        return {"peak_unsharded": r["max"]["unsharded_params"], "with_buffers": with_buffers(r["memory"]),
                "all_gathers": sum(name == "all_gather" for name, _ in r["comms"])}

    table = {True: summary(r0), False: summary(fsdp_lab.launch(one_step, False, world_size=2)[0])}
    print(f"{'reshard_after_forward':>22} {'peak unsharded (MiB)':>21} {'+ comm buffers (MiB)':>21} "
          f"{'all-gathers/step':>17}")
    for reshard, row in table.items():
        print(f"{str(reshard):>22} {row['peak_unsharded'] / 2**20:21.3f} {row['with_buffers'] / 2**20:21.3f} "
              f"{row['all_gathers']:17d}")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    labels = [str(k) for k in table]
    bars = (("peak_unsharded", "unsharded params", "#2A4A80"), ("with_buffers", "+ comm buffers", "#8172B3"))
    for i, (key, name, color) in enumerate(bars):
        axes[0].bar([j + 0.4 * i for j in range(len(table))], [v[key] / 2**20 for v in table.values()], 0.4,
                    color=color, label=name)
    axes[0].set_xticks([j + 0.2 for j in range(len(table))], labels)
    axes[0].set_title("peak (MiB)"); axes[0].legend(fontsize=7)
    axes[1].bar(labels, [v["all_gathers"] for v in table.values()], color="#DD8452")
    axes[1].set_title("all-gathers per step")
    for ax in axes:
        ax.set_xlabel("reshard_after_forward")
    fig.tight_layout()
    files.savefig(fig, "reshard_after_forward.png", dpi=90)
    """),
    md("""
    ## 7. Same numbers as PyTorch's `fully_shard`

    The same model, sharded the same way, trained 3 AdamW steps with ours and with
    `torch.distributed.fsdp.fully_shard`, on the same 2 ranks.
    """),
    code("""
    def versus_torch():
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {}
        for name, shard in [("fsdp_lab", fully_shard), ("torch", torch_fully_shard)]:
            model = Llama(LlamaConfig.from_name("cpu"), seed=0)
            for layer in model.layers:
                shard(layer)
            shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses = []
            for i in range(3):
                batch = shard_batch(global_batch(512, 8, 64, step=i), rank, world)
                loss = model(batch.input_ids, batch.labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[name] = (losses, {k: v.to_local().clone() for k, v in model.state_dict().items()})
        diff = max((out["fsdp_lab"][1][k] - out["torch"][1][k]).abs().max().item() for k in out["torch"][1])
        return {name: losses for name, (losses, _) in out.items()}, diff

    losses, diff = fsdp_lab.launch(versus_torch, world_size=2)[0]
    for name, values in losses.items():
        print(f"{name:9}", " ".join(f"{v:.4f}" for v in values))
    print("max |difference| of the sharded parameters after 3 steps:", f"{diff:.1e}")
    """),
    md("""
    ## 8. Explore

    Pick the world size, the wrapping (one group per block, or the whole model as one group) and the
    reshard policy; the widget runs one recorded step and draws the timeline and rank 0's memory. The
    static figure below is the widget's default setting (a widget's state is not saved in a notebook).
    """),
    code("""
    def render(world_size, wrapping, reshard_after_forward):
        runs = fsdp_lab.launch(one_step, reshard_after_forward, wrapping == "per block", world_size=world_size)
        peak, both = runs[0]["max"]["unsharded_params"] / 2**20, with_buffers(runs[0]["memory"]) / 2**20
        fig = draw(runs, f"{world_size} ranks, {wrapping}, reshard_after_forward={reshard_after_forward}")
        return fig, f"peak unsharded params on rank 0: {peak:.2f} MiB; with comm buffers: {both:.2f} MiB"

    fig, text = render(2, "whole model", True)
    print(text)
    files.savefig(fig, "whole_model_one_group.png", dpi=90)
    """),
    code("""
    explorer = Explorer({
        "world_size": widgets.Dropdown(options=[1, 2, 4], value=2, description="world size"),
        "wrapping": widgets.Dropdown(options=["per block", "whole model"], value="whole model", description="wrapping"),
        "reshard_after_forward": widgets.Checkbox(value=True, description="reshard_after_forward"),
    }, render, title="FSDP2: one step", auto=False)
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    With the whole model as one group the peak of `unsharded_params` is the whole model: at that moment
    sharding the parameters saves nothing (the gradients and the optimizer state stay sharded). One group
    per block keeps one block (plus the root's embeddings and output) in `unsharded_params` at a time and,
    in backward, the next block's all-gather in `comm_buffers` beside it (section 5's table).

    ## 9. Copy-in and copy-out of one group

    One all-gather serves a whole group. **Copy-in**: concatenate every parameter's padded shard into one
    flat buffer (fsdp_lab, as PyTorch's FSDP2, writes it straight into this rank's rows of the output
    buffer, the all-gather's input, so no second buffer is held). After `all_gather_into_tensor` the output holds `world` such buffers, rank after rank.
    **Copy-out**: cut each parameter's columns back out of every rank's buffer, stack them (rank-major)
    into the padded full parameter, and drop the padding rows. `shards` are this rank's padded shards (each
    `(ceil(rows/W), *rest)`); `gathered` is the flat all-gather output; `shapes` are the original shapes.
    The cell after compares the result with the library's own all-gather on 4 ranks.
    """),
    code("""
    def copy_in(shards):
        return torch.cat([s.reshape(-1) for s in shards])

    def copy_out(gathered, shapes, world):
        per_rank = gathered.view(world, -1)
        numels = [math.ceil(shape[0] / world) * math.prod(shape[1:]) for shape in shapes]
        params = []
        for column, shape in zip(per_rank.split(numels, dim=1), shapes):
            padded = column.reshape(world * math.ceil(shape[0] / world), *shape[1:])
            params.append(padded[:shape[0]])
        return params
    """),
    code("""
    def check(copy_in, copy_out):
        import torch.distributed as dist
        world = dist.get_world_size()
        torch.manual_seed(1)
        model = fully_shard(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7)))
        group = model._fsdp_state.group
        shards = [p._sharded_data for p in group.fsdp_params]            # the library's padded shards
        shapes = [p.orig_size for p in group.fsdp_params]
        flat = copy_in(shards)
        gathered = torch.empty(flat.numel() * world)
        collectives.all_gather_into_tensor(gathered, flat)
        mine = copy_out(gathered, shapes, world)
        model.unshard()                                                   # the library's all-gather
        theirs = [p.unsharded_param.detach().clone() for p in group.fsdp_params]  # copy: reshard frees it
        model.reshard()
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(mine, theirs))

    ok = all(fsdp_lab.launch(check, copy_in, copy_out, world_size=4))
    print("copy-in / all-gather / copy-out gives the library's unsharded parameters:", ok)
    """),
    md("""
    ## 10. Exercise: a pre-forward all-gather hook

    The heart of FSDP2's forward: before a module runs, a forward pre-hook all-gathers its parameters'
    shards and puts the whole parameters on the module. Write `pre_forward(module, args)` for one module
    whose `module.shards` maps each parameter name to this rank's padded `Shard(0)` piece and `module.rows`
    to the parameter's real number of rows: all-gather each shard with
    `collectives.all_gather_into_tensor(output, shard)` (rank r's piece lands at rows `[r*S, (r+1)*S)`),
    drop the padding rows, and `setattr` the result. (`fully_shard` does it for a whole group with one
    collective and copy-in/copy-out; here one collective per parameter is fine.) The check runs it on 4
    ranks before an `nn.Linear(5, 7)` — 7 rows, so one padding row — and compares with the same layer in one
    process.
    """),
    exercise("""
    def pre_forward(module, args):
        import torch.distributed as dist
        from fsdp_lab import collectives
        world = dist.get_world_size()
        for name, shard in module.shards.items():
            ### BEGIN SOLUTION
            gathered = torch.empty(world * shard.shape[0], *shard.shape[1:], dtype=shard.dtype)
            collectives.all_gather_into_tensor(gathered, shard)
            setattr(module, name, gathered[:module.rows[name]])
            ### END SOLUTION
            ### STUB raise NotImplementedError("all-gather the shard into world * S rows, keep module.rows[name] of them, setattr it")
    """),
    code("""
    lab05.check_pre_forward(pre_forward)
    """),
    md("""
    ## Summary

    * FSDP2 shards **each parameter** on dim 0 into a `DTensor` (`Shard(0)`); uneven rows are padded inside
      the rank's storage, never shown to the optimizer.
    * FSDP2 exists for what PyTorch's FSDP1 flat parameter refuses: frozen weights of another dtype beside
      trainable ones, and mixed `requires_grad` without `use_orig_params=True`; and for tensor subclasses such as NF4 that choose what
      they all-gather, sharded state dicts without communication, and memory freed through events instead
      of `record_stream` (deterministic memory).
    * Its price: a group's all-gather is copy-in → one collective → copy-out, and its reduce-scatter the
      reverse with the gradients; FSDP1's flat parameter needs no copy around the all-gather (its
      gradients are still concatenated or added into one flat gradient before the reduce-scatter). The
      unsharded parameter keeps its identity; only its storage comes and goes.
    * `reshard_after_forward=True` trades memory for one more all-gather per block: each block is freed
      after its forward, but in backward the prefetched block waits in the all-gather's buffers (and the
      block before's gradients in the reduce-scatter's), so the saving is smaller than `unsharded_params`
      alone shows (section 6).
    * fsdp_lab's `fully_shard` and PyTorch's give the same losses and the same sharded parameters.

    Read next: `fsdp_lab/fsdp2/param.py` (one parameter's life) and `docs/fsdp2.md`.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
