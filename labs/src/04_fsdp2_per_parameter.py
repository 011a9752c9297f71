"""Lab 04: FSDP2, per-parameter sharding with DTensor; the life of one parameter through a step."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, md  # noqa: E402

CELLS = [
    md("""
    # Lab 04 — FSDP2: every parameter is a DTensor

    **Goals.**

    1. See how one weight is cut into `Shard(0)` pieces rank by rank, and how uneven shapes are padded.
    2. Follow one parameter through a training step: gathered → used → freed → gathered again →
       gradient reduce-scattered — on a real timeline and memory curve.
    3. Compare `reshard_after_forward=True` and `False`: memory against number of all-gathers.
    4. Check that `fsdp_lab.fsdp2.fully_shard` gives the same losses as PyTorch's own `fully_shard`.
    5. Write the copy-in / copy-out of one group yourself and check it against the library.
    """),
    code("""
    %matplotlib inline
    import math, os
    import torch
    import torch.nn as nn
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    from fsdp_lab import collectives
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.memory_plots import plot_memory_curve
    from fsdp_lab.viz.widgets import Explorer

    FIGURES = "figures/04_fsdp2_per_parameter"
    os.makedirs(FIGURES, exist_ok=True)
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
    ## 2. On real ranks: what each rank holds

    `fully_shard(nn.Linear(3, 5))` on 4 ranks. Each rank reports its DTensor's placement, its local
    shape, and the size of the padded storage behind it.
    """),
    code("""
    def dtensor_per_rank():
        import torch.distributed as dist
        torch.manual_seed(0)
        layer = fully_shard(nn.Linear(3, 5))
        w, b = layer.weight, layer.bias
        return {"rank": dist.get_rank(), "placements": str(w.placements), "global": tuple(w.shape),
                "weight local": tuple(w.to_local().shape),
                "weight storage": w.to_local().untyped_storage().nbytes() // 4,
                "bias local": tuple(b.to_local().shape)}

    for row in fsdp_lab.launch(dtensor_per_rank, world_size=4):
        print(row)
    """),
    md("""
    Rank 3 holds no rows of the 5×3 weight, yet it stores 2×3 floats (6 elements): the padding that keeps
    every rank's all-gather input the same size.

    ## 3. The life of one parameter through a step

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
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw={"height_ratios": [1.2, 1]})
        plot_timeline(Timeline.merge([r["timeline"] for r in results]), ax=ax1, title=title or "one step")
        plot_memory_curve(results[0]["memory"], ax=ax2, title="rank 0 memory by category")
        fig.tight_layout()
        return fig

    fig = draw(results, "2 ranks, one fully_shard per block, reshard_after_forward=True")
    fig.savefig(f"{FIGURES}/life_of_a_step.png", dpi=90)
    """),
    md("""
    The memory curve shows the `unsharded_params` band rising by one block's bytes before each block and
    falling after it, in forward and again in backward; `sharded_grads` appear block by block as the
    reduce-scatters land. The timeline shows all-gathers on the comm lane running while the previous block
    computes (backward prefetch).

    ## 4. `reshard_after_forward`: memory against communication

    `True` frees each block after its forward and gathers it again in backward (more all-gathers, less
    memory); `False` keeps every block gathered from its forward to its backward.
    """),
    code("""
    def summary(r):
        return {"peak_unsharded": r["max"]["unsharded_params"],
                "all_gathers": sum(name == "all_gather" for name, _ in r["comms"])}

    table = {True: summary(r0), False: summary(fsdp_lab.launch(one_step, False, world_size=2)[0])}
    print(f"{'reshard_after_forward':>22} {'peak unsharded (MiB)':>21} {'all-gathers/step':>17}")
    for reshard, row in table.items():
        print(f"{str(reshard):>22} {row['peak_unsharded'] / 2**20:21.3f} {row['all_gathers']:17d}")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    labels = [str(k) for k in table]
    axes[0].bar(labels, [v["peak_unsharded"] / 2**20 for v in table.values()], color="#4C72B0")
    axes[0].set_title("peak unsharded params (MiB)")
    axes[1].bar(labels, [v["all_gathers"] for v in table.values()], color="#DD8452")
    axes[1].set_title("all-gathers per step")
    for ax in axes:
        ax.set_xlabel("reshard_after_forward")
    fig.tight_layout()
    fig.savefig(f"{FIGURES}/reshard_after_forward.png", dpi=90)
    """),
    md("""
    ## 5. Same numbers as PyTorch's `fully_shard`

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
    ## 6. Explore

    Pick the world size, the wrapping (one group per block, or the whole model as one group) and the
    reshard policy; the widget runs one recorded step and draws the timeline and rank 0's memory. The
    static figure below is the widget's default setting (a widget's state is not saved in a notebook).
    """),
    code("""
    def render(world_size, wrapping, reshard_after_forward):
        runs = fsdp_lab.launch(one_step, reshard_after_forward, wrapping == "per block", world_size=world_size)
        peak = runs[0]["max"]["unsharded_params"] / 2**20
        fig = draw(runs, f"{world_size} ranks, {wrapping}, reshard_after_forward={reshard_after_forward}")
        return fig, f"peak unsharded params on rank 0: {peak:.2f} MiB"

    fig, text = render(2, "whole model", True)
    print(text)
    fig.savefig(f"{FIGURES}/whole_model_one_group.png", dpi=90)
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
    With the whole model as one group the peak of `unsharded_params` is the whole model: sharding saves
    nothing at the peak. One group per block keeps about one block (plus the root's embeddings and output)
    gathered at a time.

    ## 7. Exercise: copy-in and copy-out of one group

    One all-gather serves a whole group. **Copy-in**: concatenate every parameter's padded shard into one
    flat buffer. After `all_gather_into_tensor` the output holds `world` such buffers, rank after rank.
    **Copy-out**: cut each parameter's columns back out of every rank's buffer, stack them (rank-major)
    into the padded full parameter, and drop the padding rows.

    Write both functions. `shards` are this rank's padded shards (each `(ceil(rows/W), *rest)`);
    `gathered` is the flat all-gather output; `shapes` are the original parameter shapes.
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
    print("correct" if ok else "not yet: compare your unsharded parameters with the library's")
    """),
    md("""
    ## Summary

    * FSDP2 shards **each parameter** on dim 0 into a `DTensor` (`Shard(0)`); uneven rows are padded inside
      the rank's storage, never shown to the optimizer.
    * A group's all-gather is copy-in → one collective → copy-out; its reduce-scatter is the reverse with the
      gradients. The unsharded parameter keeps its identity; only its storage comes and goes.
    * `reshard_after_forward` trades memory (one block gathered at a time) for one more all-gather per block.
    * fsdp_lab's `fully_shard` and PyTorch's give the same losses and the same sharded parameters.

    Read next: `fsdp_lab/fsdp2/param.py` (one parameter's life) and `docs/fsdp2.md`.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
