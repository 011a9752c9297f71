"""Lab 06: mixed precision and the gradient's life cycle under FSDP."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 06 — Mixed precision: what each dtype costs

    **Goals.**

    1. Know the bytes, the precision and the range of each floating dtype.
    2. Tell apart the four dtypes of a mixed-precision policy: **compute** (`param_dtype`), **master**
       (`main_params_dtype`), **gradient accumulation** (`main_grads_dtype`) and **wire**
       (`grad_comm_dtype`, else `reduce_dtype`).
    3. Follow one gradient from autograd to the optimizer on a real run: produced → accumulated →
       communicated → reduced → applied.
    4. Measure four policies: memory by category at the peak, bytes on the wire, loss.
    5. Train with a real gradient-reduction bug (Megatron-FSDP's `optim` mode before its fix) and
       write the correct reduction yourself, with a bf16 wire and float32 accumulation.
    6. Train in float16 with dynamic loss scaling, and write its sharded step: unscale, and agree
       across ranks on overflow.
    """),
    code("""
    %matplotlib inline
    import dataclasses, math, os
    import torch
    import torch.distributed as dist
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import collectives
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.precision import MixedPrecisionPolicy, accumulation_dtype, grad_comm_dtype, main_params_dtype
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.workshop import lab_files, lab06
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop.zero import ZeRO1

    files = lab_files("06_mixed_precision")   # labs/figures/06_mixed_precision, from labs/ or labs/solutions/
    BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
    short = lambda d: str(d).replace("torch.", "")   # a dtype's name: "bfloat16" for torch.bfloat16
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The bytes of each dtype

    A dtype is a trade: bytes per number against fraction bits (precision) and exponent bits (range).
    The table reads them from `torch.finfo`: the stored fraction bits are log2(1/eps), the exponent bits
    are the rest after the sign bit, and a normal number has one more bit of precision, the implicit 1.
    """),
    code("""
    print(f"{'dtype':>9} {'bytes':>5} {'fraction bits':>13} {'exponent bits':>13} {'eps (1 ulp at 1.0)':>19} {'smallest normal':>15} {'max':>12}")
    for dtype in (torch.float64, FP32, BF16, FP16):
        info = torch.finfo(dtype)
        fraction = round(-math.log2(info.eps))
        print(f"{short(dtype):>9} {info.bits // 8:5d} {fraction:13d} {info.bits - 1 - fraction:13d} {info.eps:19.3g} "
              f"{info.smallest_normal:15.3g} {info.max:12.6g}")

    # what 7 stored fraction bits do to a running sum: add 0.001 a thousand times
    for dtype in (FP32, BF16):
        total = torch.zeros((), dtype=dtype)
        for _ in range(1000):
            total += torch.tensor(0.001, dtype=dtype)
        print(f"sum of 1000 x 0.001 in {short(dtype):8}: {total.item():.4g}")
    """),
    md("""
    bf16 keeps float32's 8 exponent bits (the same range) and stores 7 fraction bits (8 bits of
    precision with the implicit 1). fp16 stores 10 fraction bits but only 5 exponent bits: it overflows
    above 65504, and gradients below its smallest normal lose precision, then round to zero — fp16
    training needs **loss scaling** (section 7); bf16 does not.

    In bf16 the running sum stops growing once 0.001 is below half an ulp of the total: this is why
    **where gradients are accumulated** matters as much as what they are computed in.

    ## 2. Four dtypes, one policy

    `fsdp_lab`'s `MixedPrecisionPolicy` (FSDP2) and `MixedPrecision` (FSDP1) take PyTorch's fields (four in
    FSDP2's policy, six in FSDP1's) plus three borrowed from **Megatron-FSDP**'s `MixedPrecisionPolicy` (`main_params_dtype`,
    `main_grads_dtype`, `grad_comm_dtype`, added to Megatron-LM in PR #3067). PyTorch's own policies
    have none of them — here are the two FSDP2 policies' fields, read from the classes:
    """),
    code("""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    theirs = [f.name for f in dataclasses.fields(TorchPolicy)]
    ours = [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
    print("in both:        ", [name for name in ours if name in theirs])
    print("fsdp_lab's only:", [name for name in ours if name not in theirs])
    """),
    md("""
    PyTorch's policy grows with its releases: torch 2.15 added `param_dtype_override_fn` (a compute
    dtype chosen per parameter), which `fsdp_lab` does not take. What this kernel's torch has that
    `fsdp_lab` does not (the output is not compared: it depends on the release):
    """),
    code("""
    print(f"PyTorch {torch.__version__.split('+')[0]}'s only:", [name for name in theirs if name not in ours])
    """, tags=["nbval-ignore-output"]),
    md("""
    | field | what it sets | default here |
    |---|---|---|
    | `param_dtype` | compute: the all-gathered parameters, activations, the gradients autograd produces | the parameter's own |
    | `main_params_dtype` | master: the sharded weights the optimizer updates (and its state) | float32 (`None`: the model's own) |
    | `main_grads_dtype` | accumulation across microbatches | float32 |
    | `grad_comm_dtype` | the wire: reduce-scatter / all-reduce | `reduce_dtype`, else `param_dtype`, else own |

    `None` means something else in Megatron-FSDP: there `main_grads_dtype=None` is the compute dtype and
    `grad_comm_dtype=None` the model's own gradient dtype. Here `None` follows PyTorch's FSDP2 up to
    torch 2.14, under both FSDPs: gradients kept without sync accumulate in `reduce_dtype`. (PyTorch's FSDP1
    keeps them in `param_dtype` instead; `fsdp_lab`'s FSDP1 follows the FSDP2 rule.) Since torch 2.15,
    `fully_shard` with no `reduce_dtype` reduces in the parameter's own dtype rather than `param_dtype`;
    `fsdp_lab` keeps the older rule on every torch release, so this lab's figures do not depend on the
    release. Name `reduce_dtype` to get the same wire from both. Megatron-LM's
    `megatron_fsdp/mp_policy.py` also defaults `grad_comm_dtype` to bf16 and adds `grad_accum_dtype`, the
    dtype the reduction itself runs in, which this lab cannot offer (below). The helpers in
    `fsdp_lab.precision` resolve the four for a parameter of a given dtype:
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
    print(f"{'policy':>30} | {'master':>8} {'compute':>8} {'accumulate':>10} {'wire':>8}")
    for name, fields in POLICIES.items():
        row = resolve(MixedPrecisionPolicy(**fields))
        print(f"{name:>30} | " + " ".join(f"{short(row[k]):>{w}}" for k, w in
                                           [("master", 8), ("compute", 8), ("accumulate", 10), ("wire", 8)]))
    """),
    md("""
    The third row is what PyTorch's own FSDP2 does with `param_dtype=reduce_dtype=bf16` on a float32
    model: bf16 compute, wire and no-sync accumulation; float32 master weights, sharded gradients and
    optimizer state. The fourth sends bf16 on the wire but accumulates microbatches in float32. Note
    what "fp32 accumulation" does *not* cover: the sum **across ranks** happens inside the
    reduce-scatter, in the wire dtype — each rank's gradient is rounded to bf16 and the ranks'
    contributions are added in bf16 (gloo here, NCCL on GPUs, both reduce in the buffer's dtype).
    Reducing in float32 from bf16 buffers needs recent NCCL's symmetric-memory / registered-buffer
    kernels (which NCCL version, and over which interconnect, NCCL's release notes say), which
    Megatron-FSDP exposes; this CPU lab cannot show it.

    ## 3. The life cycle of a gradient, from a real run

    Two ranks, policy "bf16 comm + fp32 accumulation", three microbatches of which the first two are
    accumulated without sync. We read the dtype and bytes of every buffer the gradient passes through
    from the live objects and from the timeline's reduce-scatter event, or compute them from the
    parameter's size where the buffer is gone by the time we look (the gathered weight in the compute
    dtype, the bytes communicated).
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
        compute = fsdp_param.dtypes.compute                     # the dtypes precision.param_dtypes decided
        seen["compute"] = (compute, weight.numel() * torch.finfo(compute).bits // 8)
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
    ax = lab06.draw_gradient_life(life, STAGES)
    files.savefig(ax.figure, "gradient_life_cycle.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    md("""
    The gathered weight and its gradient are full-size (every rank has all rows); the master, the
    sharded `.grad` and the optimizer state are 1/W of it. The accumulation buffer is full-size *and*
    float32: accumulating without sync costs `4 × params` bytes per rank until the reduce-scatter.

    ## 4. The policies, measured

    Each policy trains the same model on the same data for `STEPS` steps of `MICRO` microbatches (2 ranks;
    the cell sets them and the check under the figure prints how many steps it compared).
    The second step (after the first has allocated the optimizer state) is measured on rank 0: the highest each memory category reached (MemoryTracker's
    `max_by_category()`, one column each; these maxima happen at different moments, so they do not add
    up), the peak of the total (`peak_total()`, the sum of `peak()`), and bytes of the collectives (Timeline; the size
    nccl-tests counts: all-gather output, reduce-scatter input). The bar chart stacks the categories
    **at the moment of the peak** (`peak()`). Communication buffers are given back the moment their
    collective is waited for (`fsdp_lab.collectives.release`), not when gloo's worker thread drops its
    last reference, so their maximum and the peak of the total are the same on every run. A float16
    policy (the explorer below offers one) trains under dynamic loss scaling,
    `fsdp_lab.grad_scaler.ShardedLossScaler`.
    """),
    code("""
    STEPS, BATCH, SEQ, MICRO = 20, 6, 16, 3

    def train_policy(fields, steps=STEPS, bf16_model=False):
        model = Llama(CONFIG, seed=0)
        model = shard_model(model.to(BF16) if bf16_model else model, MixedPrecisionPolicy(**fields))
        # AdamW, `steps` steps of BATCH sequences of SEQ tokens (over all ranks) in MICRO microbatches, gradients
        # synced on the last; float16 under ShardedLossScaler; the second step measured on each rank
        return lab06.train_and_measure(model, CONFIG.vocab_size, steps, BATCH, SEQ, MICRO,
                                       loss_scaling=FP16 in fields.values())

    def all_policies():
        return {name: train_policy(fields) for name, fields in POLICIES.items()}

    table = fsdp_lab.launch(all_policies, world_size=2)[0]
    lab06.print_policy_memory(table)
    """),
    code("""
    print(f"{'policy':>30} | {'comm buffers KiB':>16} {'peak total KiB':>14}")
    for name, row in table.items():
        print(f"{name:>30} | {row['highest'].get('comm_buffers', 0) / 1024:16.0f} {sum(row['memory'].values()) / 1024:14.0f}")
    """),
    code("""
    fig = lab06.plot_policies(table)
    files.savefig(fig, "policies.png", dpi=100, bbox_inches="tight")
    plt.show()
    reference = table["fp32"]["losses"]
    gap = {name: max(abs(a - b) for a, b in zip(row["losses"], reference)) for name, row in table.items() if name != "fp32"}
    print(f"every policy within 0.1 of the fp32 loss at every one of the {len(reference)} steps:", all(v < 0.1 for v in gap.values()))
    lab06.print_policy_ratios(table)
    """),
    code("""
    lab06.print_policy_losses(table, gap)   # bf16 digits after a ≈: they differ with the CPU's kernels
    """),
    md("""
    What to read in the table:

    * **sharded** is the same everywhere: float32 master weights in every policy.
    * **gathered** halves with bf16 compute; so do the all-gather bytes.
    * **RS bytes** halve with a bf16 wire. The fourth policy keeps that bf16 wire but accumulates in
      float32: its accumulation buffer doubles. Its **acc.grad** column grows by less than that: the
      column counts every full-size gradient not yet reduce-scattered, so at its highest it holds the
      buffer *and* the bf16 gradients the last backward has produced and FSDP has not yet added in (each
      module's post-backward adds its own; the root's, embeddings and output here, comes last), the same
      bytes under both policies. The ratios are printed under the figure.
    * The loss curves would lie on top of each other at this scale; the left panel plots each policy's
      *difference* from the float32 run instead; the cell under the figure prints each policy's losses
      and largest difference (after a ≈: their last digits depend on the CPU's bf16 kernels, so the
      tests compare that every policy stays close to float32, not the digits). At this size bf16 changes
      the numbers, not the course of training. The accumulation dtype matters when many microbatches are
      summed: `tests/test_precision.py` sums many microbatches' bf16 gradients and finds float32
      accumulation within float32 round-off of the exact sum, bf16 accumulation off by bf16 round-off.

    ## 5. A real reduction bug: Megatron-FSDP's `optim` mode

    In ZeRO-1 — Megatron-FSDP's `optim` sharding strategy — every rank keeps a **whole** gradient buffer
    and reduces it once per step: a reduce-scatter leaves each rank the sum of its slice over all ranks.
    Before Megatron-LM PR #3067, Megatron-FSDP reduce-scattered into a fresh shard and then, for every
    strategy, *added* that shard into the rank's slice of its local buffer (`local_grad += reduced_grad`).
    Under ZeRO-2/3 that slice is the sharded accumulator, so adding is right; under `optim` it still held
    the rank's own **un-reduced** gradient. Rank *i* stepped with `g_i + Σ_j g_j` (both pre-scaled by
    1/DP) instead of `Σ_j g_j`: its own data counted twice, on its own slice. The fix copies instead of
    adding for `no_shard` and `optim`.

    Below, lab 03's ZeRO-1 (`fsdp_lab.workshop.zero.ZeRO1`) reduces the way Megatron-FSDP did, with and
    without the fix, and trains 40 steps on 2 ranks with different data; a single process training on
    the whole batch is the reference.
    """),
    code("""
    BUG_STEPS, BUG_BATCH, BUG_LR = 40, 8, 3e-3

    def reduce_like_megatron(grad, fixed):
        rank, world = dist.get_rank(), dist.get_world_size()
        buffer = grad.reshape(-1) / world                  # Megatron pre-scales by 1/DP before reducing
        reduced = torch.empty(buffer.numel() // world)
        collectives.reduce_scatter_tensor(reduced, buffer)  # sum over ranks of this rank's slice
        local = buffer[rank * reduced.numel():(rank + 1) * reduced.numel()]  # still this rank's own g_i / DP
        if fixed:
            local.copy_(reduced)                           # PR #3067: copy for no_shard / optim
        else:
            local += reduced                               # before: g_i/DP + sum_j g_j/DP
        return local

    class OptimMode(ZeRO1):
        fixed = True
        def after_backward(self):
            for p, shard in zip(self.params, self.shards):
                shard.grad = reduce_like_megatron(p.grad, self.fixed).clone()
                p.grad = None

    def megatron_runs():
        rank, world = dist.get_rank(), dist.get_world_size()
        out = {}
        for fixed in (True, False):
            stage = OptimMode(Llama(CONFIG, seed=0), lr=BUG_LR)
            stage.fixed = fixed
            losses = []
            for step in range(BUG_STEPS):
                loss = stage.step(shard_batch(global_batch(CONFIG.vocab_size, BUG_BATCH, SEQ, step=step), rank, world))
                collectives.all_reduce(loss, op="avg")
                losses.append(loss.item())
            out["fixed" if fixed else "buggy"] = losses
        return out

    def single_process():
        model = Llama(CONFIG, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=BUG_LR, eps=1e-5)
        losses = []
        for step in range(BUG_STEPS):
            loss = model(global_batch(CONFIG.vocab_size, BUG_BATCH, SEQ, step=step)).loss
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        return losses

    bug = fsdp_lab.launch(megatron_runs, world_size=2)[0]
    bug["single process"] = single_process()
    lab06.print_optim_mode_bug(bug)
    """),
    code("""
    fig = lab06.plot_optim_mode_bug(bug)
    files.savefig(fig, "optim_mode_bug.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    md("""
    The fixed reduction trains like one process on the whole batch, to float32 round-off. The buggy
    one steps each rank's slice with a gradient tilted toward that rank's own data. AdamW normalises
    the size of each step, so nothing blows up: the run just trains a different model, its loss
    drifting from the reference's by the amounts printed above — a bug that only a comparison with a
    reference run shows.

    ## 6. Exercise: the reduction, with a bf16 wire and float32 accumulation

    Write `reduce_grad_shard(local_grad, wire_dtype)`: `local_grad` is this rank's whole float32
    gradient (1-D, divisible by the world size). Send it in `wire_dtype` with **one reduce-scatter**
    (`collectives.reduce_scatter_tensor(output, input)` sums over ranks), and return this rank's shard of
    the **mean** over ranks as a **float32** tensor (the accumulation and the optimizer stay in float32).
    The check runs it on 2 ranks with a float32 and a bf16 wire and compares with the mean computed on
    one process — and names the Megatron-FSDP bug if it sees it.
    """),
    exercise("""
    def reduce_grad_shard(local_grad, wire_dtype):
        import torch.distributed as dist
        ### BEGIN SOLUTION
        world = dist.get_world_size()
        shard = torch.empty(local_grad.numel() // world, dtype=wire_dtype)
        collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))   # summed across ranks in wire_dtype
        return shard.to(torch.float32) / world                               # accumulate in float32
        ### END SOLUTION
        ### STUB raise NotImplementedError("cast to wire_dtype, reduce-scatter into a shard, return it in float32 / world")
    """),
    code("""
    lab06.check_reduce_grad_shard(reduce_grad_shard)
    """),
    md("""
    ## 7. float16 needs loss scaling

    Below fp16's smallest normal a gradient keeps fewer and fewer bits (subnormals); below half its
    smallest subnormal it becomes 0. The cell shows three gradients stored in fp16, with and without a
    scale of 2^16. Loss scaling multiplies the loss by S before backward (every gradient is S times larger,
    by the chain rule), then divides the gradients by S in float32 before the optimizer step; if some
    gradient overflowed to inf/NaN, the step is skipped and S is halved (PyTorch's `GradScaler`; for
    FSDP1 PyTorch ships `ShardedGradScaler`).
    """),
    code("""
    info = torch.finfo(FP16)
    print(f"float16: smallest normal {info.smallest_normal:.3g}, smallest subnormal {2.0 ** -24:.3g}")
    tiny = torch.tensor([2e-8, 1e-6, 1e-3])
    scale = 2.0 ** 16
    print("in float16          :", tiny.half().float().tolist())
    print("scaled, in float16  :", (tiny * scale).half().float().tolist())
    print("unscaled in float32 :", ((tiny * scale).half().float() / scale).tolist())
    """),
    md("""
    Under FSDP each rank holds only its **shard** of each gradient, so one rank can find an inf the
    others do not. If each rank decided alone, one would step and the other skip: the model would mix
    updated and stale shards, and the ranks' loss scales would part, so later reduce-scatters would add
    gradients scaled differently. So both scalers all-reduce the "found inf" flag across the ranks
    before deciding: PyTorch's `ShardedGradScaler` with the default op, SUM (a non-zero sum means some rank
    overflowed), and `fsdp_lab.grad_scaler.ShardedLossScaler` (tested against `torch.amp.GradScaler`) with
    MAX.

    ## 8. Exercise: the sharded loss-scaling step

    Write `unscale_and_check(grads, scale)`: `grads` is this rank's list of scaled gradient shards.
    Divide each by `scale` **in place**, and return `True` if any element on **any rank** is inf or NaN
    (one all-reduce of a one-element flag, `op="max"`), else `False`. The check runs it on 2 ranks — an inf
    in rank 1's last shard, a NaN and then an inf in rank 0's first shard, no overflow — and compares with
    `torch.amp.GradScaler` stepping the whole gradient on one process.
    """),
    exercise("""
    def unscale_and_check(grads, scale):
        ### BEGIN SOLUTION
        found = torch.zeros(1)
        for g in grads:
            if not torch.isfinite(g).all():
                found.fill_(1.0)
            g.mul_(1.0 / scale)
        collectives.all_reduce(found, op="max")        # every rank decides the same
        return bool(found.item())
        ### END SOLUTION
        ### STUB raise NotImplementedError("unscale each shard in place; flag inf/NaN; all-reduce the flag with max")
    """),
    code("""
    lab06.check_unscale_and_check(unscale_and_check)
    """),
    md("""
    ## 9. Explore: build a policy

    Pick the four dtypes and see memory by category, bytes on the wire and the loss curve (2 ranks,
    20 steps). "native" master weights train a bf16 model whose master copy stays bf16. Any float16
    choice trains with `ShardedLossScaler` (the text reports its scale and skipped steps). The figure
    below is the default setting, drawn statically so it is saved with the notebook.
    """),
    code("""
    DTYPES = {"float32": FP32, "bfloat16": BF16, "float16": FP16}

    def render(param_dtype="bfloat16", main_params="float32", main_grads="float32", comm="bfloat16", steps=20):
        fields = dict(param_dtype=DTYPES[param_dtype], grad_comm_dtype=DTYPES[comm],
                      main_grads_dtype=DTYPES[main_grads], main_params_dtype=None if main_params == "native" else FP32)
        run = fsdp_lab.launch(train_policy, fields, steps, main_params == "native", world_size=2)[0]
        fig, text = lab06.draw_policy_run(run)
        used = accumulation_dtype(DTYPES[main_grads], DTYPES[param_dtype], DTYPES[comm])
        if used != DTYPES[main_grads]:  # e.g. float16 compute with bfloat16 chosen: neither holds the other
            text += (f"\\naccumulated in {str(used).removeprefix('torch.')}, not {main_grads}: never narrower than "
                     f"the {param_dtype} gradient (torch.promote_types)")
        return fig, text

    fig, text = render()
    print(text)
    files.savefig(fig, "explorer_default.png", dpi=100, bbox_inches="tight")
    plt.show()
    """),
    code("""
    names = list(DTYPES)
    explorer = Explorer({  # each render launches a training run: it runs on the Run button only
        "param_dtype": widgets.Dropdown(options=names, value="bfloat16", description="compute"),
        "main_params": widgets.Dropdown(options=["float32", "native"], value="float32", description="master"),
        "main_grads": widgets.Dropdown(options=names, value="float32", description="accumulate"),
        "comm": widgets.Dropdown(options=names, value="bfloat16", description="wire"),
        "steps": widgets.IntSlider(value=20, min=5, max=50, step=5, description="steps"),
    }, render, title="Build a mixed-precision policy", auto=False)
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## Summary

    * A policy has four dtypes: **compute** (`param_dtype`), **master** (`main_params_dtype`, float32 by
      default), **accumulation** (`main_grads_dtype`, float32 by default) and **wire** (`grad_comm_dtype`,
      else `reduce_dtype`, else `param_dtype`). The last three are Megatron-FSDP's names; PyTorch's FSDP2
      policy has `param_dtype`, `reduce_dtype`, `output_dtype` and `cast_forward_inputs` (and from torch
      2.15 `param_dtype_override_fn`). The full table per
      buffer and phase is in `docs/precision.md`.
    * bf16 compute halves gathered parameters and all-gather bytes; a bf16 wire halves reduce-scatter
      bytes — and sums the ranks' contributions in bf16, whatever the accumulation dtype. Master weights
      and optimizer state stay float32 and dominate sharded memory.
    * Accumulate in float32: a bf16 running sum loses small gradients.
    * A reduced gradient *replaces* what the rank had (ZeRO-1) or is added to a sharded accumulator
      (ZeRO-2/3): adding it to the rank's own un-reduced slice counts that rank twice.
    * float16 needs loss scaling, and under sharding the overflow check must be agreed by all ranks.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
