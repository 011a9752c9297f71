"""Lab 02: where the memory of a training step goes — measured, estimated, and compared."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 02 — Memory anatomy: parameters, gradients, optimizer state, activations

    "Where does the memory go?" is the first question of every out-of-memory error. This lab answers it
    twice — by **measurement** (`MemoryTracker`, which counts tensor storages on CPU, GPU or fake tensors)
    and by **estimate** (`estimate`, from the model's shapes alone) — and checks that the two agree.

    **Goals.**

    1. Count the bytes of parameters, gradients and AdamW state of a Llama block by hand.
    2. Reproduce the talk's 7B example: 14 GB params + 14 GB grads + 28 GB Adam in 16-bit terms.
    3. Measure one training step on CPU, by category, and draw memory over the step.
    4. See how batch size and sequence length drive activations, and derive this Llama's formula term by term.
    5. Run FSDP2 on real ranks and on a simulated world of 8 — including a 7B-shaped model that allocates nothing.
    6. Predict, yourself, the bytes of parameters, gradients and AdamW state of a live model, and the
       activations of a bf16 forward; the checks compare with `MemoryTracker` on the real thing.
    """),
    code("""
    %matplotlib inline
    import os
    import torch
    import matplotlib.pyplot as plt
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab.memory import MemoryTracker, estimate, measure_step, merge_ranks, CATEGORIES
    from fsdp_lab.memory.estimate import activation_bytes, deepspeed_model_states
    from fsdp_lab.memory.results import format_rows
    from fsdp_lab.models.llama import Llama, LlamaConfig, parameter_breakdown, count_parameters
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.viz.memory_plots import plot_breakdown, plot_memory_curve, plot_estimate_vs_measured
    from fsdp_lab.viz.memory_widgets import MemoryExplorer
    from fsdp_lab.workshop import lab_files, lab02

    files = lab_files("02_memory_anatomy")   # labs/figures/02_memory_anatomy, from labs/ or labs/solutions/
    MiB, GB = 2**20, 1e9
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: model states of a Llama block

    A parameter costs its bytes four times over during training with AdamW (three with SGD and momentum):
    the parameter itself, its gradient, and the optimizer's state (AdamW keeps `exp_avg` and `exp_avg_sq`, each the size of the
    parameter, plus a 4-byte `step` counter per tensor). Count them for one block of the CPU Llama:
    `wq, wk, wv, wo` (grouped-query: `wk`, `wv` have only the kv heads), `w1, w2, w3`, two RMSNorm weights.
    """),
    code("""
    cfg = LlamaConfig.from_name("cpu")
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_hidden
    by_hand = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d + 3 * d * f + 2 * d
    print("block parameters by hand :", by_hand)
    print("parameter_breakdown      :", parameter_breakdown(cfg)["per_layer"])
    fp32 = 4
    print(f"params {by_hand * fp32} B + grads {by_hand * fp32} B + AdamW {2 * by_hand * fp32 + 9 * 4} B "
          f"= {4 * by_hand * fp32 + 36} B per block in float32")
    print("whole model:", count_parameters(cfg), "parameters")
    """),
    md("""
    ### Exercise: predict the model states of a live model

    Write `predict_model_states(model)`: the bytes of `params`, `grads` and `optimizer_state` that the model
    and a `torch.optim.AdamW` hold after one optimizer step (gradients not yet zeroed), as a dict. Use the
    parameters themselves (`p.numel()`, `p.element_size()`), so it works for any dtype. The check trains the
    CPU Llama one step in float32 and in bfloat16 under `MemoryTracker` and compares to the byte.
    """),
    exercise("""
    def predict_model_states(model):
        params = list(model.parameters())
        ### BEGIN SOLUTION
        nbytes = sum(p.numel() * p.element_size() for p in params)
        # AdamW: exp_avg and exp_avg_sq, zeros_like(param) (the parameter's dtype), and a float32 `step` per tensor
        return {"params": nbytes, "grads": nbytes, "optimizer_state": 2 * nbytes + 4 * len(params)}
        ### END SOLUTION
        ### STUB raise NotImplementedError("return {'params': ..., 'grads': ..., 'optimizer_state': ...} in bytes")
    """),
    code("""
    lab02.check_predict_model_states(predict_model_states)
    """),
    md("""
    ## 2. The talk's 7B example

    Llama-2-7B in bf16 with AdamW whose states are also bf16 (what `torch.optim.AdamW` does for bf16
    parameters). The estimator computes model states from exact parameter counts; the talk rounds P to
    7 billion (14 + 14 + 28 GB). With mixed precision (fp32 master weights and Adam states, the ZeRO
    paper's accounting) it is 16 bytes per parameter, and ZeRO-3 / FSDP divides all of it by N.
    """),
    code("""
    b = estimate("llama2-7b", world_size=1, strategy="ddp", param_dtype=torch.bfloat16, batch_size=1, seq_len=4096)
    s = b.phases["optimizer_step"]
    P = count_parameters(LlamaConfig.from_name("llama2-7b"))
    print(f"P = {P:,}")
    print(f"params {s['params'] / GB:.2f} GB + grads {s['grads'] / GB:.2f} GB + Adam {s['optimizer_state'] / GB:.2f} GB "
          f"= {(s['params'] + s['grads'] + s['optimizer_state']) / GB:.2f} GB")
    print(f"the talk, P = 7e9: {2 * 7e9 / GB:.0f} + {2 * 7e9 / GB:.0f} + {4 * 7e9 / GB:.0f} = {8 * 7e9 / GB:.0f} GB")
    z3 = estimate("llama2-7b", world_size=8, strategy="fsdp2", param_dtype=torch.bfloat16, optimizer="adamw_master",
                  batch_size=1, seq_len=4096)
    print(f"mixed precision, FSDP2 on 8 GPUs: {z3.model_states / GB:.2f} GB per GPU; "
          f"the ZeRO paper's stage 3, (2+2+12)P/N = {deepspeed_model_states(P, 8, 3) / GB:.2f} GB")
    print(f"bytes per parameter: {(s['params'] + s['grads'] + s['optimizer_state']) / P:.1f} with bf16 "
          f"everything, {z3.model_states * 8 / P:.1f} with mixed precision (before dividing by 8 GPUs)")
    """),
    md("""
    ## 3. Measure one training step on CPU

    `MemoryTracker` is a `TorchDispatchMode`: it sees every op's output storage, counts each storage once,
    and drops it when the storage dies. Parameters, their `.grad` and the optimizer's state are recognised;
    tensors autograd saves for backward are **activations**; everything else allocated is a **temporary**,
    and what existed before tracking started (the rotary tables, the batch) is **other**.
    We take a warm-up step first so AdamW's state exists (the steady state).
    """),
    code("""
    torch.manual_seed(0)
    model = Llama("cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batch = global_batch(cfg.vocab_size, 4, 128)

    def train_step():
        loss = model(batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()                                   # warm-up: creates AdamW's state
    with MemoryTracker(model, opt) as mt:
        train_step()
    peak = mt.peak()
    print("peak after:", mt.result().peak_label)
    for c in CATEGORIES:
        if peak[c]:
            print(f"  {c:<16}{peak[c] / MiB:9.3f} MiB")
    print(f"  {'total':<16}{mt.peak_total() / MiB:9.3f} MiB")
    """),
    md("""
    The peak comes after the end of forward, at the start of backward: every activation but the loss's
    labels is still alive, and the loss's gradient (float32, batch x seq x vocab, twice) is being computed. Now the estimate for the same configuration —
    `ddp` on one process is plain single-process training:
    """),
    code("""
    est = estimate(cfg, world_size=1, strategy="ddp", param_dtype=torch.float32, batch_size=4, seq_len=128)
    print(f"{'category':<16}{'estimate':>12}{'measured':>12}   (bytes at the peak)")
    for c in CATEGORIES:
        if est[c] or peak[c]:
            print(f"{c:<16}{est[c]:>12,}{peak[c]:>12,}")
    print(f"{'total':<16}{est.total:>12,}{mt.peak_total():>12,}   ratio {mt.peak_total() / est.total:.4f}")
    print(f"measured - estimated: {mt.peak_total() - est.total:,} bytes")
    ax = plot_estimate_vs_measured(est, peak, unit="MiB", title="CPU Llama, batch 4 x 128, float32")
    files.savefig(ax.figure, "estimate_vs_measured.png", dpi=100, bbox_inches="tight")
    """),
    md("""
    Model states match to the byte; activations match because the estimator counts exactly what this Llama
    still holds for backward at that moment (the loss has already let go of its labels; see `docs/memory.md`).
    The difference printed last is the loss scalar and its gradient (4 bytes each in float32), which the
    estimate leaves out.

    ## 4. Memory over one step

    The tracker records a snapshot at every phase boundary: forward and backward of each block, the
    optimizer step. Activations build up through forward and drain through backward while gradients
    appear. Through the optimizer step parameters, gradients and state are all alive at once (the
    for-loop AdamW's per-parameter temporaries come and go between its two snapshots), and
    `zero_grad(set_to_none=True)` then frees the gradients: the last snapshot, the rightmost step of the
    curve, holds none. The dashed line is the tracker's peak of section 3. The tracker counts every
    allocation, not only those alive at a phase boundary, and this peak falls between two snapshots, so
    the highest snapshot stays below it (both printed below).
    """),
    code("""
    timeline = mt.timeline()
    print(len(timeline), "phase boundaries, e.g.:", [label for label, _ in timeline[:4]])
    last_label, last = timeline[-1]
    print(f"gradients at the last snapshot, '{last_label}': {last.get('grads', 0)} bytes")
    highest = max(sum(snap.values()) for _, snap in timeline)
    print(f"highest snapshot {highest / MiB:.3f} MiB; tracker's peak {mt.peak_total() / MiB:.3f} MiB, "
          f"after '{mt.result().peak_label}'")
    ax = plot_memory_curve(mt.result(), unit="MiB", label_every=3)   # a result: its peak is marked
    files.savefig(ax.figure, "memory_over_one_step.png", dpi=100, bbox_inches="tight")
    """),
    md("""
    ## 5. Batch size and sequence length drive activations

    Parameters do not depend on the batch; activations grow linearly in the number of tokens T = batch x seq.
    The formula below is **this** Llama's (`fsdp_lab/models/llama.py`: fused SDPA, RMSNorm computed in float32,
    SwiGLU, no dropout, grouped-query attention by `repeat_interleave`); other implementations save other
    tensors — for GPT-style models see Korthikanti et al., *Reducing Activation Recomputation in Large
    Transformer Models* (2022). With d the width, f the SwiGLU hidden size, h the heads and e bytes per
    element, one block saves (for the Llamas of this lab: heads d / h wide, no head norms, no adapters):

    | where | saved tensor | bytes |
    | --- | --- | --- |
    | each RMSNorm (two per block) | its input upcast to float32 (for `pow` and `mul`) | 4Td |
    | | `rsqrt` of the mean square, one float32 per token | 4T |
    | | the normalised input cast back (for `* weight`) | eTd |
    | | the norm's output (input of the next linears) | eTd |
    | attention | q, k, v (k, v after `repeat_interleave`: d wide each) and SDPA's output | 4eTd |
    | | SDPA's float32 log-sum-exp, one per head and token | 4Th |
    | | `wo`'s input (the heads merged back) | eTd |
    | SwiGLU | outputs of `w1`, of `silu`, of `w3`, and their product (`w2`'s input) | 4eTf |

    Sum per block: `2*(4Td + 2eTd + 4T) + 4eTd + 4Th + eTd + 4eTf`. Rotary embeddings save only their constant
    cos/sin tables; residual additions save nothing; the fused attention kernel saves no T x T matrix. The
    model adds one final RMSNorm, what the loss keeps (its float32 log-softmax, 4TV, and the int64 labels, 8T)
    and the int64 input ids the embedding saves (8T).
    `activation_bytes` in the estimator is this formula for such a Llama; heads of another width
    (`head_dim` set apart from d / h), Qwen3's head norms and QLoRA (frozen norms, adapters) add terms of their own
    (`docs/memory.md`). We measure the activations after forward only.
    """),
    code("""
    def forward_activations(batch_size, seq_len):
        x = global_batch(cfg.vocab_size, batch_size, seq_len)
        with MemoryTracker(model) as t:
            out = model(x)
            acts = t.current()["activations"]
        del out
        return acts

    rows = []
    for bs, sl in [(1, 64), (2, 64), (4, 64), (4, 32), (4, 128)]:
        m = forward_activations(bs, sl)
        e = activation_bytes(cfg, bs, sl, torch.float32)["total"]
        rows.append((bs * sl, m))
        print(f"batch {bs} x seq {sl:>3} = {bs * sl:>3} tokens: measured {m / MiB:7.3f} MiB, formula {e / MiB:7.3f} MiB")
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([r[0] for r in rows], [r[1] / MiB for r in rows], "o-")
    ax.set_xlabel("tokens per step (batch x seq)"); ax.set_ylabel("activations (MiB)")
    ax.set_title("activations grow linearly with tokens")
    files.savefig(fig, "activations_vs_tokens.png", dpi=100, bbox_inches="tight")
    """),
    md("""
    ## 6. Run N ranks: FSDP2 on 2 real ranks

    `measure_step` builds the Llama on each rank, shards every block and the root with
    `fsdp_lab.fsdp2.fully_shard`, takes a warm-up step and tracks the second. The tracker sees FSDP's own
    tags: sharded parameters, gathered (unsharded) parameters, communication buffers.
    """),
    code("""
    results = fsdp_lab.launch(measure_step, "cpu", world_size=2, strategy="fsdp2", batch_size=2, seq_len=64)
    est2 = estimate(cfg, world_size=2, strategy="fsdp2", batch_size=2, seq_len=64)
    # the figure and both tables below are this one run
    print(format_rows(merge_ranks(results), unit="MiB"))
    ax = plot_breakdown({f"rank {r.rank} (measured)": r.peak for r in results}
                        | {f"estimate ({est2.phase})": est2}, unit="MiB",
                        title="FSDP2 on 2 ranks: each at its own peak, by category")
    files.savefig(ax.figure, "fsdp2_two_ranks.png", dpi=100, bbox_inches="tight")
    """),
    md("""
    A collective's buffers are given back the moment it is waited for (`fsdp_lab.collectives.release`),
    not whenever gloo's worker thread lets go of them, so every number above is the same on every run and on
    both ranks. FSDP2 tags its collectives' buffers `comm_buffers`: a prefetched all-gather's flat output
    (this rank's shard was copied into its own rows of it) and a reduce-scatter's flat input, which gloo
    sums in place chunk by chunk, so no untagged receive buffer appears. At its peak the estimator counts
    no `temporaries`, while a real step always has some (gradients of activations on their way through a
    block), so the table below sets the sum of the two beside the estimate, and every other category on
    its own:
    """),
    code("""
    stable = [c for c in CATEGORIES if c not in ("temporaries", "comm_buffers")]
    r0 = results[0]
    print(f"{'category':<28}{'estimate':>10}{'rank 0':>10}{'rank 1':>10}   MiB, each at its own peak")
    for c in stable:
        if est2[c] or any(r.peak[c] for r in results):
            print(f"{c:<28}{est2[c] / MiB:10.3f}" + "".join(f"{r.peak[c] / MiB:10.3f}" for r in results))
    flight = lambda b: (b["temporaries"] + b["comm_buffers"]) / MiB
    print(f"{'temporaries + comm_buffers':<28}{flight(est2):10.3f}" + "".join(f"{flight(r.peak):10.3f}" for r in results))
    print(f"{'total':<28}{est2.total / MiB:10.3f}" + "".join(f"{r.peak_total / MiB:10.3f}" for r in results))
    print(f"estimate's peak: phase '{est2.phase}'; measured peak (rank 0) after: '{r0.peak_label}'")
    print(f"activations: estimate {est2['activations'] / MiB:.3f} MiB at its peak, "
          f"{est2.phases['forward_end']['activations'] / MiB:.3f} at the end of forward; measured "
          f"{r0.peak['activations'] / MiB:.3f} at the measured peak, {r0.max_by_category['activations'] / MiB:.3f} "
          f"at their own maximum (end of forward)")
    print(f"comm_buffers + temporaries at the peak: estimate {flight(est2):.3f} MiB (comm_buffers "
          f"{est2['comm_buffers'] / MiB:.3f}: the next block's prefetched all-gather; temporaries "
          f"{est2['temporaries'] / MiB:.3f}), measured {flight(r0.peak):.3f} MiB (comm_buffers "
          f"{r0.peak['comm_buffers'] / MiB:.3f}, temporaries {r0.peak['temporaries'] / MiB:.3f})")
    freed = est2["activations"] - r0.peak["activations"]
    final_norm, w2_input = activation_bytes(cfg, 2, 64)["final_norm"], 2 * 64 * cfg.ffn_hidden * 4
    print(f"activations freed by the measured peak: {freed:,} B = the final norm's {final_norm:,} B + the "
          f"{w2_input:,} B the last block's w2 saved: {freed == final_norm + w2_input}")
    """),
    md("""
    The totals are close here (the `total` row), and so is every category but activations and temporaries:
    the estimator's `backward` phase is the moment the measured peak comes after (the label above), the
    start of the last block's backward. Every block's activations are alive, the root's parameters are
    gathered beside that block, the next block's prefetched all-gather waits in `comm_buffers`, and the
    head's gradient (output and final norm) is there with the block's first gradient (its `w2`, the last
    linear of its forward). The measured peak is a moment into that backward: the final norm's saved tensors
    and the input `w2` saved are freed by then (the last line above adds them up), and the block's first
    activation gradients sit in `temporaries`. Compared at the same moment, the end of forward, estimated
    and measured activations agree but for the loss's labels (8 bytes a token), which the estimator already
    counts as freed there (printed above).
    """),
    md("""
    ## 7. A simulated world of 8

    `fsdp_lab.simulated_world(8)` makes this process rank 0 of 8 on torch's fake process group: memory is
    real, collectives return without exchanging data — so the numbers below are rank 0's memory, not its
    training result. First the CPU Llama, then a Llama with the exact shapes of Llama-2-7B (4 of its 32
    blocks, to keep the lab fast) under `FakeTensorMode`: nothing is allocated, yet every storage has a size.
    """),
    code("""
    with fsdp_lab.simulated_world(8) as world:
        sim = measure_step("cpu", strategy="fsdp2", batch_size=2, seq_len=64)
    est8 = estimate(cfg, world_size=8, strategy="fsdp2", batch_size=2, seq_len=64)
    steady8 = est8.phases["steady"]
    print(world.note)
    print(f"rank 0 of 8: sharded params {sim.current['sharded_params']:,} B (estimate "
          f"{steady8['sharded_params']:,} B), AdamW state {sim.current['optimizer_state']:,} B "
          f"(estimate {steady8['optimizer_state']:,} B)")
    print(f"peak {sim.peak_total / MiB:.3f} MiB measured vs {est8.total / MiB:.3f} MiB estimated "
          f"({sim.peak_total / est8.total:.2f}x)")
    """),
    code("""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_lab.fsdp2 import MixedPrecisionPolicy, fully_shard

    big = LlamaConfig.from_name("llama2-7b", n_layers=4)
    # the model is built in bf16 and PyTorch's fully_shard keeps the sharded parameter and its gradient
    # in the dtype the model was built in, so AdamW's state is bf16 too (as the estimate assumes);
    # fsdp_lab's defaults would keep float32 master weights and accumulate gradients in float32
    # instead (lab 06), so this run asks for neither

    pure_bf16 = MixedPrecisionPolicy(main_params_dtype=None, main_grads_dtype=None)
    with fsdp_lab.simulated_world(8):
        mesh = init_device_mesh("cpu", (8,))             # built before fake mode: it holds real rank ids
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)
            fake_model = Llama(big)
            torch.set_default_dtype(torch.float32)
            for block in fake_model.layers:
                fully_shard(block, mesh=mesh, mp_policy=pure_bf16)
            fully_shard(fake_model, mesh=mesh, mp_policy=pure_bf16)
            fake_opt = torch.optim.AdamW(fake_model.parameters(), lr=1e-3, foreach=False)
            ids = torch.randint(0, big.vocab_size, (1, 1024))

            def fake_step():
                fake_model(ids, ids).loss.backward()
                fake_opt.step()
                fake_opt.zero_grad(set_to_none=True)

            fake_step()                                          # warm-up: AdamW state
            with MemoryTracker(fake_model, fake_opt) as fake_mt:
                fake_step()
    est_big = estimate(big, world_size=8, strategy="fsdp2", param_dtype=torch.bfloat16, batch_size=1, seq_len=1024)
    cur, steady_big = fake_mt.current(), est_big.phases["steady"]
    print(f"7B-shaped, 4 blocks, rank 0 of 8 (fake tensors): sharded params {cur['sharded_params']:,} B "
          f"(estimate {steady_big['sharded_params']:,} B), AdamW state {cur['optimizer_state']:,} B "
          f"(estimate {steady_big['optimizer_state']:,} B)")
    print(f"peak {fake_mt.peak_total() / GB:.2f} GB measured vs {est_big.total / GB:.2f} GB estimated "
          f"({fake_mt.peak_total() / est_big.total:.2f}x)")
    ax = plot_estimate_vs_measured(est_big, fake_mt.peak(), unit="GiB", title="7B shapes (4 blocks), rank 0 of 8")
    files.savefig(ax.figure, "fake_7b_rank0_of_8.png", dpi=100, bbox_inches="tight")
    """),
    md("""
    Model states agree to the byte, in both simulated runs. The peaks differ by how many gathered blocks,
    gradient buffers and temporaries are alive at the same moment: the estimator adds up its assumptions for
    each phase (in backward, the larger of two moments of the last block's backward: its start, and its end,
    where its whole gradient is copied into its reduce-scatter input beside the prefetched next block) and
    takes the largest phase, while the measured peak is whatever moment of the real step holds the most. That makes the estimate neither an upper nor a lower bound: the two ratios printed above
    (measured / estimated) are these runs', and over the 36 configurations of
    `benchmarks/estimate_vs_measured.py` (docs/memory.md) it lands on both sides of the measurement.
    `est_big.phases` shows every phase.

    ## 8. Explore

    Change the model, world size, strategy, dtypes, batch, sequence length, checkpointing, offload or QLoRA
    (GPUs/node sets the node that `fsdp1_hybrid_shard` shards within); the bars are the estimate for one rank. **measure** runs a real AdamW step and overlays it hatched,
    but only for a `cpu` model (pick one first: the explorer opens on Llama-2-7B, which it refuses as too
    big; picking `cpu` also lowers the sequence length to its longest, 128) and not for CPU offload, `fsdp1_hybrid_shard`, another optimizer or another gradient dtype;
    it uses real ranks up to 4 and a simulated world beyond, and says in red next to the button what it
    refused. The static figure below is
    the same plot for Llama-2-7B with FSDP2 on 8 GPUs, with and without activation checkpointing.
    """),
    code("""
    explorer = MemoryExplorer(model="llama2-7b", world_size=8, strategy="fsdp2", param_dtype="bfloat16",
                              batch_size=1, seq_len=4096)
    configs = {}
    for ac in (False, True):
        s = dict(explorer.settings(), activation_checkpointing=ac)
        configs["checkpointing" if ac else "no checkpointing"] = explorer.estimate(s)
    for name, b in configs.items():
        print(f"{name:<17} peak {b.total / 2**30:6.2f} GiB in phase {b.phase}")
    ax = plot_breakdown(configs, unit="GiB", title="Llama-2-7B, FSDP2, 8 GPUs, batch 1 x 4096, bf16")
    files.savefig(ax.figure, "explorer_static.png", dpi=100, bbox_inches="tight")
    """),
    code("""
    explorer.show();
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 9. Exercise: predict the activations

    Write `predict_activations(config, batch_size, seq_len)`: the bytes this Llama saves for backward
    during one forward in **bfloat16** (e = 2 bytes; RMSNorm still keeps a float32 copy of its input and
    the loss a float32 log-softmax). Use the per-block table of section 5 and add the final RMSNorm,
    the log-softmax (4*T*V), the int64 labels the loss keeps (8*T) and the int64 input ids the embedding
    saves (8*T). The check measures two
    shapes and accepts your prediction to within a few bytes (the loss's scalars, which the formula
    leaves out).
    """),
    exercise("""
    def predict_activations(config, batch_size, seq_len):
        T, d, f, h, V = batch_size * seq_len, config.dim, config.ffn_hidden, config.n_heads, config.vocab_size
        e = 2
        ### BEGIN SOLUTION
        norm = 4 * T * d + 2 * e * T * d + 4 * T
        block = 2 * norm + 4 * e * T * d + 4 * T * h + e * T * d + 4 * e * T * f
        return config.n_layers * block + norm + 4 * T * V + 8 * T + 8 * T
        ### END SOLUTION
        ### STUB raise NotImplementedError("n_layers * (per-block bytes) + final norm + 4*T*V + 8*T + 8*T")
    """),
    code("""
    lab02.check_predict_activations(predict_activations)
    """),
    md("""
    ## Summary

    * Training memory = **model states** (parameters, gradients, optimizer state: 16 bytes per parameter with
      mixed-precision Adam, 8 with bf16 everything) + **activations** (linear in batch x seq) + transients
      (the loss gradient, gathered FSDP blocks, optimizer temporaries).
    * `MemoryTracker` measures it by category from tensor storages — on CPU, GPU, or fake tensors — and
      `estimate` predicts it from shapes; they agree to the byte on model states and on single-process
      activations. Under FSDP2 the totals come close (sections 6 and 7 print how close), but the measured
      and estimated peaks are different moments of backward, so their categories differ (section 6) and the
      estimate is neither an upper nor a lower bound.
    * Sharding (FSDP / ZeRO-3) divides model states by N; it does not touch activations — checkpointing does.
    * A simulated world and fake tensors answer "would this fit on 8 GPUs?" on a laptop.

    Next: lab 03 builds ZeRO by hand, lab 04 FSDP1's flat parameters, and lab 05 the FSDP2 that produced the
    `sharded_params` and `unsharded_params` above.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
