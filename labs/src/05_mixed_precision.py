"""Lab 05: mixed precision and the gradient's life cycle under FSDP."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, md  # noqa: E402

CELLS = [
    md("""
    # Lab 05 — Mixed precision: what each dtype costs

    **Goals.**

    1. Know the bytes and the precision of each floating dtype.
    2. Tell apart the four dtypes of a mixed-precision policy: **compute** (`param_dtype`), **master**
       (`main_params_dtype`), **gradient accumulation** (`main_grads_dtype`) and **communication**
       (`grad_comm_dtype`, else `reduce_dtype`).
    3. Follow one gradient from autograd to the optimizer on a real run: produced → cast →
       accumulated → communicated → reduced → applied.
    4. Measure four policies: memory by category, bytes on the wire, loss after 50 steps.
    5. Recreate the double-counted-gradient bug in a tiny loop, then fix it.
    """),
    code("""
    %matplotlib inline
    import contextlib, gc, os
    import torch
    import torch.nn as nn
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.precision import MixedPrecisionPolicy, accumulation_dtype, grad_comm_dtype, main_params_dtype
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz.memory_plots import plot_breakdown
    from fsdp_lab.viz.widgets import Explorer

    FIGURES = "figures/05_mixed_precision"
    os.makedirs(FIGURES, exist_ok=True)
    BF16, FP32 = torch.bfloat16, torch.float32
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The bytes of each dtype

    A dtype is a trade: bytes per number against mantissa bits (precision) and exponent bits (range).
    bf16 keeps float32's range with 8 bits of mantissa; fp16 has more mantissa but overflows at 65504.
    """),
    code("""
    print(f"{'dtype':>9} {'bytes':>5} {'eps (1 ulp at 1.0)':>19} {'max':>10}")
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        print(f"{str(dtype).replace('torch.', ''):>9} {info.bits // 8:5d} {info.eps:19.3g} {info.max:10.3g}")

    # what 8 bits of mantissa do to a running sum: add 0.001 a thousand times
    for dtype in (FP32, BF16):
        total = torch.zeros((), dtype=dtype)
        for _ in range(1000):
            total += torch.tensor(0.001, dtype=dtype)
        print(f"sum of 1000 x 0.001 in {str(dtype).replace('torch.', ''):8}: {total.item():.4g}")
    """),
    md("""
    In bf16 the running sum stops growing once 0.001 is below half an ulp of the total: this is why
    **where gradients are accumulated** matters as much as what they are computed in.

    ## 2. Four dtypes, one policy

    `MixedPrecisionPolicy` (FSDP2) and `MixedPrecision` (FSDP1) take PyTorch's fields plus three that
    separate what `reduce_dtype` folds together:

    | field | what it sets | default |
    |---|---|---|
    | `param_dtype` | compute: the all-gathered parameters, activations, the gradients autograd produces | the parameter's own |
    | `main_params_dtype` | master: the sharded weights the optimizer updates (and its state) | float32 (`None`: the model's own) |
    | `main_grads_dtype` | accumulation across microbatches | float32 |
    | `grad_comm_dtype` | the wire: reduce-scatter / all-reduce | `reduce_dtype`, else `param_dtype`, else own |

    The helpers in `fsdp_lab.precision` resolve them for a parameter of a given dtype:
    """),
    code("""
    def resolve(policy, own=FP32):
        compute = policy.param_dtype or own
        return {"master": main_params_dtype(policy, own), "compute": compute,
                "accumulate": accumulation_dtype(policy.main_grads_dtype, compute, policy.reduce_dtype or compute),
                "wire": grad_comm_dtype(policy, own)}

    POLICIES = {
        "fp32": dict(),
        "bf16 params + fp32 reduce": dict(param_dtype=BF16, reduce_dtype=FP32),
        "bf16 params + bf16 reduce": dict(param_dtype=BF16, reduce_dtype=BF16, main_grads_dtype=None),
        "bf16 comm + fp32 accumulation": dict(param_dtype=BF16, grad_comm_dtype=BF16),
    }
    short = lambda d: str(d).replace("torch.", "")
    print(f"{'policy':>30} | {'master':>8} {'compute':>8} {'accumulate':>10} {'wire':>8}")
    for name, fields in POLICIES.items():
        row = resolve(MixedPrecisionPolicy(**fields))
        print(f"{name:>30} | " + " ".join(f"{short(row[k]):>{w}}" for k, w in
                                           [("master", 8), ("compute", 8), ("accumulate", 10), ("wire", 8)]))
    """),
    md("""
    The third row is PyTorch's own FSDP2 with bf16 everywhere (`main_grads_dtype=None`: gradients
    accumulate in the reduce dtype). The fourth sends bf16 on the wire but accumulates in float32:
    a temporary bf16 copy (tagged `comm_buffers`) exists only for the collective.

    ## 3. The life cycle of a gradient, from a real run

    Two ranks, policy "bf16 comm + fp32 accumulation", three microbatches of which the first two are
    accumulated without sync. We read the dtype and bytes of every buffer the gradient passes through
    from the live objects and from the timeline's reduce-scatter event.
    """),
    code("""
    CONFIG = LlamaConfig.from_name("cpu", n_layers=1)

    def shard_model(model, policy):
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)

    def life_of_a_gradient():
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        model = shard_model(Llama(CONFIG, seed=0), MixedPrecisionPolicy(param_dtype=BF16, grad_comm_dtype=BF16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        weight = model.layers[0].feed_forward.w1.weight          # the sharded master (a DTensor)
        fsdp_param = next(p for p in model.layers[0]._fsdp_state.group.fsdp_params if p.sharded_param is weight)
        seen = {}
        def grab_grad(grad):                                      # what autograd produces
            seen.setdefault("produced", (grad.dtype, grad.numel() * grad.element_size()))
        batch = shard_batch(global_batch(CONFIG.vocab_size, 6, 16), rank, world)
        with Timeline() as tl:
            for i, micro in enumerate(batch.chunk(3)):
                model.set_requires_gradient_sync(i == 2)
                model(micro.input_ids, micro.labels).loss.backward()
                if i == 0:
                    fsdp_param.unsharded_param.register_hook(grab_grad)  # hooks the next backward
                if i == 1:
                    acc = fsdp_param.unsharded_accumulated_grad
                    seen["accumulated"] = (acc.dtype, acc.numel() * acc.element_size())
            opt.step()
        rs = [e for e in tl.comm_events(rank, "reduce_scatter") if e.args.get("module") == "layers.0"][0]
        local = weight.to_local()
        seen["master"] = (weight.dtype, local.numel() * local.element_size())
        seen["compute"] = (fsdp_param.compute_dtype, weight.numel() * torch.finfo(fsdp_param.compute_dtype).bits // 8)
        wire = getattr(torch, rs.args["dtype"])  # this weight's padded rows inside the group's reduce-scatter input
        seen["communicated"] = (wire, world * fsdp_param.padded_sharded_size.numel() * torch.finfo(wire).bits // 8)
        seen["reduced"] = (weight.grad.dtype, local.numel() * weight.grad.element_size())
        state = opt.state[weight]["exp_avg"].to_local()
        seen["applied"] = (state.dtype, 2 * state.numel() * state.element_size())
        return seen

    life = fsdp_lab.launch(life_of_a_gradient, world_size=2)[0]
    STAGES = [("master", "sharded master weight"), ("compute", "all-gathered for compute"),
              ("produced", "gradient from autograd"), ("accumulated", "no-sync accumulation buffer"),
              ("communicated", "its part of the reduce-scatter input"), ("reduced", "sharded .grad"),
              ("applied", "AdamW state (exp_avg + exp_avg_sq)")]
    for key, label in STAGES:
        dtype, nbytes = life[key]
        print(f"{label:>36}: {short(dtype):>8} {nbytes:>8,d} bytes")
    """),
    code("""
    def draw_life(life, ax=None):
        ax = ax or plt.subplots(figsize=(11, 2.6))[1]
        colors = {torch.float32: "#4C72B0", torch.bfloat16: "#DD8452", torch.float16: "#55A868"}
        for i, (key, label) in enumerate(STAGES):
            dtype, nbytes = life[key]
            ax.add_patch(plt.Rectangle((i * 1.5, 0), 1.2, 1, color=colors.get(dtype, "#999"), alpha=0.85))
            ax.text(i * 1.5 + 0.6, 0.62, short(dtype), ha="center", fontsize=9, color="white", weight="bold")
            ax.text(i * 1.5 + 0.6, 0.3, f"{nbytes / 1024:.0f} KiB", ha="center", fontsize=8, color="white")
            ax.text(i * 1.5 + 0.6, -0.25, "\\n".join(label.split(" ", 2)[:2] + label.split(" ", 2)[2:]),
                    ha="center", va="top", fontsize=7)
            if i:
                ax.annotate("", xy=(i * 1.5, 0.5), xytext=(i * 1.5 - 0.3, 0.5), arrowprops=dict(arrowstyle="->"))
        ax.set_xlim(-0.2, len(STAGES) * 1.5)
        ax.set_ylim(-0.9, 1.2)
        ax.axis("off")
        ax.set_title("life of layers.0.feed_forward.w1's gradient (rank 0, 2 ranks)")
        return ax

    ax = draw_life(life)
    ax.figure.savefig(f"{FIGURES}/gradient_life_cycle.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    md("""
    The gathered weight and its gradient are full-size (every rank has all rows); the master, the
    sharded `.grad` and the optimizer state are 1/W of it. The accumulation buffer is full-size *and*
    float32: accumulating without sync costs `4 × params` bytes per rank until the reduce-scatter.

    ## 4. The policies, measured

    Each policy trains the same model on the same data for 50 steps of 3 microbatches (2 ranks).
    Step 1 is measured: memory by category (MemoryTracker, peak of each category on rank 0) and bytes
    of the collectives (Timeline; the size nccl-tests counts: all-gather output, reduce-scatter input).
    """),
    code("""
    STEPS, BATCH, SEQ, MICRO = 50, 6, 16, 3
    CATEGORIES = ["sharded_params", "unsharded_params", "unsharded_grads", "sharded_grads", "comm_buffers",
                  "optimizer_state"]

    def train_policy(fields, steps=STEPS, bf16_model=False):
        import torch.distributed as dist
        rank, world = dist.get_rank(), dist.get_world_size()
        model = Llama(CONFIG, seed=0)
        model = shard_model(model.to(BF16) if bf16_model else model, MixedPrecisionPolicy(**fields))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
        losses = []
        for step in range(steps):
            batch = shard_batch(global_batch(CONFIG.vocab_size, BATCH, SEQ, step=step), rank, world)
            measured = step == 1
            with (MemoryTracker(model, opt) if measured else contextlib.nullcontext()) as mt, \\
                    (Timeline() if measured else contextlib.nullcontext()) as tl:
                loss = torch.zeros(())
                for i, micro in enumerate(batch.chunk(MICRO)):
                    model.set_requires_gradient_sync(i == MICRO - 1)
                    micro_loss = model(micro.input_ids, micro.labels).loss / MICRO
                    micro_loss.backward()
                    loss += micro_loss.detach().float()
                opt.step()
                opt.zero_grad()
            if measured:
                memory = {k: v for k, v in mt.max_by_category().items() if k in CATEGORIES}
                wire = {}
                for e in tl.comm_events(rank):
                    wire[e.name] = wire.get(e.name, 0) + e.bytes
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        return {"losses": losses, "memory": memory, "wire": wire}

    def all_policies():
        out = {}
        for name, fields in POLICIES.items():
            gc.collect()  # the previous model must not be counted
            out[name] = train_policy(fields)
        return out

    table = fsdp_lab.launch(all_policies, world_size=2)[0]
    print(f"{'policy':>30} | {'sharded':>7} {'gathered':>8} {'acc.grad':>8} {'sh.grad':>7} {'comm':>6} {'optim':>6} "
          f"| {'AG bytes':>9} {'RS bytes':>9} | {'loss@1':>6} {'loss@50':>7}")
    for name, row in table.items():
        m = row["memory"]
        print(f"{name:>30} | " + " ".join(f"{m.get(c, 0) / 1024:{w}.0f}" for c, w in
                                           zip(CATEGORIES, (7, 8, 8, 7, 6, 6)))
              + f" | {row['wire'].get('all_gather', 0):9,d} {row['wire'].get('reduce_scatter', 0):9,d}"
              + f" | {row['losses'][0]:#6.3g} {row['losses'][-1]:#7.3g}")
    print("(memory in KiB, peak per category on rank 0; bytes per step on rank 0)")
    """),
    code("""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.8))
    for name, row in table.items():
        ax0.plot(range(1, STEPS + 1), row["losses"], label=name, lw=1.2)
    ax0.set_xlabel("step"); ax0.set_ylabel("loss"); ax0.set_title("loss, same data, 2 ranks"); ax0.legend(fontsize=8)
    plot_breakdown({name.replace(" + ", "\\n"): row["memory"] for name, row in table.items()}, ax=ax1, unit="KiB",
                   title="peak memory by category (rank 0)")
    ax1.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(f"{FIGURES}/policies.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    md("""
    What to read in the table:

    * **sharded** is the same everywhere: float32 master weights in every policy.
    * **gathered** halves with bf16 compute; so do the all-gather bytes.
    * **RS bytes** halve with a bf16 wire; the fourth policy pays a float32 accumulation buffer
      (**acc.grad**) for it, plus a bf16 temporary in **comm**.
    * The losses agree to 2-3 significant digits: at this size bf16 changes the numbers, not the course
      of training. The accumulation dtype matters when many microbatches are summed (see
      `tests/test_precision.py`: with 16 microbatches, float32 accumulation stays within 1e-5 of the exact
      sum, bf16 accumulation is off by more than 1e-3).

    ## 5. Exercise: the double-counted gradient

    Some optimizer-sharding implementations keep one full-size gradient buffer per rank, reduce-scatter
    it after every microbatch, and add the reduced shard to the sharded gradient. If the buffer is not
    zeroed after the reduce-scatter, the next microbatch's gradient is added *on top of* the one already
    reduced, and reducing again counts it twice: `R(g1) + R(g1 + g2)` instead of `R(g1) + R(g2)`.

    The cell below simulates two ranks in one process with plain tensors. `reduce_scatter` averages the
    ranks' buffers and gives rank r its r-th chunk. `buggy` has the bug.
    """),
    code("""
    def reduce_scatter(buffers):
        \"\"\"buffers[r]: rank r's full gradient -> rank r's chunk of the mean over ranks.\"\"\"
        mean = torch.stack(buffers).mean(0)
        return [chunk.clone() for chunk in mean.chunk(len(buffers))]

    def buggy(micro_grads):
        \"\"\"micro_grads[m][r]: rank r's gradient of microbatch m. Returns each rank's sharded gradient.\"\"\"
        world = len(micro_grads[0])
        buffers = [torch.zeros_like(micro_grads[0][0]) for _ in range(world)]
        sharded = None
        for grads in micro_grads:
            for r in range(world):
                buffers[r] += grads[r]                      # accumulate
            shards = reduce_scatter(buffers)                # communicate
            sharded = shards if sharded is None else [s + t for s, t in zip(sharded, shards)]
            # BUG: buffers still hold the gradients just reduced
        return sharded

    g = [[torch.tensor([1., 2., 3., 4.]), torch.tensor([3., 2., 1., 0.])],   # microbatch 1, ranks 0 and 1
         [torch.tensor([0., 1., 0., 1.]), torch.tensor([2., 1., 2., 1.])]]   # microbatch 2
    want = reduce_scatter([g[0][r] + g[1][r] for r in range(2)])
    print("right :", [s.tolist() for s in want])
    print("buggy :", [s.tolist() for s in buggy(g)])
    """),
    md("""
    **Your turn.** Write `fixed(micro_grads)`: same loop, but each microbatch's gradient is counted once.
    (One line does it.) The checking cell runs `fsdp_lab.fsdp2.fully_shard` on two ranks, syncing every
    microbatch, and compares your shards with the library's `.grad`.
    """),
    code("""
    def fixed(micro_grads):
        world = len(micro_grads[0])
        buffers = [torch.zeros_like(micro_grads[0][0]) for _ in range(world)]
        sharded = None
        for grads in micro_grads:
            for r in range(world):
                buffers[r] += grads[r]
            shards = reduce_scatter(buffers)
            sharded = shards if sharded is None else [s + t for s, t in zip(sharded, shards)]
            for buffer in buffers:
                buffer.zero_()                              # the fix: the reduced gradient leaves the buffer
        return sharded
    """),
    code("""
    def tiny_data(rank, micro):
        g = torch.Generator().manual_seed(10 * rank + micro)
        return torch.randn(3, 2, generator=g)

    def tiny_model():
        torch.manual_seed(0)
        return nn.Linear(2, 2, bias=False)                  # 4 weights: rank r holds row r

    def library_shards():
        import torch.distributed as dist
        rank = dist.get_rank()
        model = fully_shard(tiny_model())
        for micro in range(3):                              # sync every microbatch
            model(tiny_data(rank, micro)).pow(2).sum().backward()
        return model.weight.grad.to_local().reshape(-1)

    def per_rank_grads():
        model = tiny_model()
        grads = []
        for micro in range(3):
            row = []
            for rank in range(2):
                model.zero_grad()
                model(tiny_data(rank, micro)).pow(2).sum().backward()
                row.append(model.weight.grad.reshape(-1).clone())
            grads.append(row)
        return grads

    library = fsdp_lab.launch(library_shards, world_size=2)
    yours = fixed(per_rank_grads())
    ok = all(torch.allclose(y, l, rtol=1e-5, atol=1e-6) for y, l in zip(yours, library))
    print("correct" if ok else "not yet: your shards differ from fully_shard's .grad "
          f"(yours {[y.tolist() for y in yours]}, library {[l.tolist() for l in library]})")
    print("and the buggy version would give:",
          "correct" if all(torch.allclose(b, l) for b, l in zip(buggy(per_rank_grads()), library)) else "wrong")
    """),
    md("""
    `fsdp_lab`'s FSDP2 and FSDP1 never do this: the full gradient is *taken* from the parameter (or from
    the no-sync buffer, which is then dropped) before it is reduced, so every microbatch reaches the
    reduce-scatter exactly once. `tests/test_precision.py` checks every strategy against single-process
    gradients with different data on each rank.

    ## 6. Explore: build a policy

    Pick the four dtypes and see memory by category, bytes on the wire and the loss curve (2 ranks,
    20 steps). "native" master weights train a bf16 model whose master copy stays bf16. The figure below
    is the default setting, drawn statically so it is saved with the notebook.
    """),
    code("""
    DTYPES = {"float32": FP32, "bfloat16": BF16, "float16": torch.float16}

    def render(param_dtype="bfloat16", main_params="float32", main_grads="float32", comm="bfloat16", steps=20):
        fields = dict(param_dtype=DTYPES[param_dtype], grad_comm_dtype=DTYPES[comm],
                      main_grads_dtype=DTYPES[main_grads], main_params_dtype=None if main_params == "native" else FP32)
        run = fsdp_lab.launch(train_policy, fields, steps, main_params == "native", world_size=2)[0]
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.4))
        ax0.plot(range(1, steps + 1), run["losses"], color="#4C72B0")
        ax0.set_xlabel("step"); ax0.set_ylabel("loss"); ax0.set_title("loss")
        plot_breakdown({"this policy": run["memory"]}, ax=ax1, unit="KiB", title="peak memory (rank 0)")
        fig.tight_layout()
        wire = ", ".join(f"{k} {v:,d} B" for k, v in run["wire"].items())
        return fig, f"per step on rank 0: {wire} | loss {run['losses'][0]:#.3g} -> {run['losses'][-1]:#.3g}"

    fig, text = render()
    print(text)
    fig.savefig(f"{FIGURES}/explorer_default.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    code("""
    explorer = Explorer({
        "param_dtype": widgets.Dropdown(options=list(DTYPES), value="bfloat16", description="compute"),
        "main_params": widgets.Dropdown(options=["float32", "native"], value="float32", description="master"),
        "main_grads": widgets.Dropdown(options=list(DTYPES), value="float32", description="accumulate"),
        "comm": widgets.Dropdown(options=list(DTYPES), value="bfloat16", description="wire"),
        "steps": widgets.IntSlider(value=20, min=5, max=50, step=5, description="steps"),
    }, render, title="Build a mixed-precision policy", auto=False)
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## Summary

    * A policy has four dtypes: **compute** (`param_dtype`), **master** (`main_params_dtype`, float32 by
      default), **accumulation** (`main_grads_dtype`, float32 by default) and **wire** (`grad_comm_dtype`,
      else PyTorch's `reduce_dtype` rule). The full table per buffer and phase is in `docs/precision.md`.
    * bf16 compute halves gathered parameters and all-gather bytes; a bf16 wire halves reduce-scatter
      bytes. Master weights and optimizer state stay float32 and dominate sharded memory.
    * Accumulate in float32: a bf16 running sum loses small gradients. With a bf16 wire and float32
      accumulation, a temporary bf16 buffer exists only for the collective.
    * A reduced gradient must leave the accumulation buffer, or the next reduction counts it again.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
