"""Lab 08: QLoRA, 4-bit NF4 base weights and LoRA adapters, sharded by FSDP2."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 08 — QLoRA: 4-bit weights, low-rank adapters, and FSDP

    **Goals.**

    1. See why 4 bits per weight, and where the 16 NF4 code values come from (normal quantiles).
    2. Quantize one block by hand, then with `fsdp_lab.qlora.to_nf4`; pack two codes per byte;
       count the bits per parameter double quantization saves (4.5 → ~4.127).
    3. Look inside a tensor subclass: what `__torch_dispatch__` sees when the model uses an NF4 weight.
    4. Put a LoRA adapter on a linear layer; train QLoRA under FSDP2 on 2 ranks and read the
       `quantized` memory category and the bytes each all-gather moves, against bf16.
    5. Set our estimates for Llama-2-7B beside the published figures and explore the knobs.

    **Exercises.** You write the LoRA forward on an NF4 weight (section 6) and the nearest-code lookup
    (section 10); a checking cell after each compares your code with fsdp_lab's and names the mistake.
    """),
    code("""
    %matplotlib inline
    import os
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    from torch.utils._python_dispatch import TorchDispatchMode
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab.workshop import lab_files, lab08
    from fsdp_lab.qlora import NF4_CODEBOOK, NF4Tensor, LoRALinear, apply_lora, build_nf4_codebook, to_nf4
    from fsdp_lab.qlora.nf4 import (nf4_bits_per_param, nf4_storage_bytes, pack_nibbles, quantize_nf4_blocks,
                                    unpack_nibbles)
    from fsdp_lab.memory.estimate import estimate
    from fsdp_lab.models.llama import LlamaConfig
    from fsdp_lab.viz.widgets import Explorer

    files = lab_files("08_qlora")   # labs/figures/08_qlora in the lab build, else labs/my_figures/08_qlora
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. Why 4 bits

    Fine-tuning only small adapters means the base weights are read, never updated: they need no gradients and
    no optimizer state, only storage. For Llama-2-7B that storage decides whether the model fits on a consumer
    GPU at all.
    """),
    code("""
    cfg = LlamaConfig.from_name("llama2-7b")
    linear_numel = cfg.n_layers * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden)
    print(f"Llama-2-7B block linears: {linear_numel / 1e9:.3f} billion weights")
    for name, bits in [("float32", 32), ("bfloat16", 16), ("int8", 8), ("NF4 + scales", nf4_bits_per_param())]:
        print(f"{name:13} {bits:6.3f} bits/weight -> {linear_numel * bits / 8 / 2**30:6.2f} GiB")
    """),
    md("""
    ## 2. The code book from normal quantiles

    Trained weights are roughly normal. NF4 spaces its 16 code values at quantiles of N(0, 1): dense near 0,
    where most weights are, and sparse in the tails. They are 8 positive values and 7 negative ones plus an
    exact 0, divided by the largest so the ends are ±1. `build_nf4_codebook` derives them; the stored table
    `NF4_CODEBOOK` is the one bitsandbytes uses (torchao stores it rounded to 4 decimals). Quantile spacing
    does not make the codes equally used: each block of 64 weights is divided by its own absmax, so its
    largest value always lands on ±1 and the others crowd toward 0. The cell counts how often each code is
    used for normal weights: the codes near 0 most, the two ends least.
    """),
    code("""
    derived = build_nf4_codebook()
    print("max |derived - NF4_CODEBOOK| =", f"{(derived - NF4_CODEBOOK).abs().max().item():.1e}")
    print("codes:", " ".join(f"{v:+.4f}" for v in NF4_CODEBOOK.tolist()))
    normal_packed, _ = quantize_nf4_blocks(torch.randn(2**20, generator=torch.Generator().manual_seed(0)), block_size=64)
    usage = torch.bincount(unpack_nibbles(normal_packed).long(), minlength=16) / (2 * normal_packed.numel())
    print("share of 2**20 normal weights per code:", " ".join(f"{100 * u:.1f}%" for u in usage.tolist()))
    print(f"least used {100 * usage.min().item():.1f}% (code {usage.argmin().item()}), "
          f"most used {100 * usage.max().item():.1f}% (code {usage.argmax().item()}); equal use would be {100 / 16:.2f}%")

    fig = lab08.plot_codebook_over_normal()
    files.savefig(fig, "codebook.png", dpi=90)
    """),
    md("""
    ## 3. Quantize a block by hand, then with the library

    A block of 64 values is divided by its absolute maximum, each value replaced by the index of the nearest
    code. Dequantizing multiplies the code value by the block's scale. (The library, as bitsandbytes, compares
    each value with the 15 midpoints between neighbouring codes, computed in float32, and a value equal to a
    midpoint takes the lower code. The argmin below picks the nearest code, the same everywhere but on those
    midpoints: their float32 sums round, so only some lie exactly halfway, and argmin sends a midpoint that
    rounding left nearer the upper code up. The last line counts both. See section 10.)
    """),
    code("""
    torch.manual_seed(0)
    block = torch.randn(64) * 0.02
    absmax = block.abs().max()
    normalised = block / absmax
    by_hand = (normalised[:, None] - NF4_CODEBOOK[None, :]).abs().argmin(dim=1)
    packed, scales = quantize_nf4_blocks(block, block_size=64)
    library = unpack_nibbles(packed).long()
    print("absmax:", f"{absmax.item():.5f}", "| library scale:", f"{scales.item():.5f}")
    print("first 8 codes by hand:", by_hand[:8].tolist(), "| library:", library[:8].tolist())
    print("same codes:", torch.equal(by_hand, library))
    error = (NF4_CODEBOOK[library] * absmax - block).abs().max() / absmax
    bound = ((NF4_CODEBOOK[1:] - NF4_CODEBOOK[:-1]).max() / 2).item()
    print(f"largest error / absmax: {error.item():.4f} (bound: half the widest gap, {bound:.4f})")
    midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2                     # float32: bitsandbytes' thresholds
    below, above = (midpoints - NF4_CODEBOOK[:-1]).double(), (NF4_CODEBOOK[1:] - midpoints).double()   # exact
    sent_up = (midpoints[:, None] - NF4_CODEBOOK[None, :]).abs().argmin(dim=1) != torch.arange(15)
    print(f"midpoints exactly halfway: {int((below == above).sum())} of 15 | argmin sends {int(sent_up.sum())} up,"
          f" each nearer the upper code: {bool((below > above)[sent_up].all())}")
    """),
    md("""
    ### Packing: two codes per byte

    The code of the even-index element goes in the high nibble, the odd one in the low nibble.
    """),
    code("""
    codes = library[4:8].to(torch.uint8)   # four different codes: each byte shows which nibble is which
    pair_bytes = pack_nibbles(codes)
    print("codes", codes.tolist(), "-> bytes", [f"0x{b:02x}" for b in pair_bytes.tolist()])
    print("bytes for 64 values:", packed.numel(), "plus one scale")
    """),
    md("""
    ## 4. Double quantization: 4.5 → ~4.127 bits per parameter

    One float32 scale per 64 weights costs 32/64 = 0.5 bit per weight. Double quantization stores the scales
    as int8 (after subtracting their mean) with one float32 factor per 256 scales: 8/64 + 32/(64·256) ≈ 0.127
    bit. We use torchao's linear int8 scheme (bitsandbytes uses a dynamic 8-bit code; see docs/qlora.md).
    """),
    code("""
    torch.manual_seed(0)
    w = torch.randn(4096, 4096) * 0.02
    for dq in (False, True):
        t = to_nf4(w, double_quant=dq)
        err = (t.dequantize(torch.float32) - w).abs().mean().item()
        print(f"double_quant={dq!s:5}  stored {t.storage_bytes():>9,} bytes = "
              f"{8 * t.storage_bytes() / w.numel():.4f} bits/param  (formula {nf4_bits_per_param(double_quant=dq):.4f})"
              f"  mean |error| {err:.2e}")
    print("exact bytes, formula n_blocks*32 + n_blocks + 4*ceil(n_blocks/256) + 4:", f"{nf4_storage_bytes(w.numel()):,}")
    """),
    md("""
    ## 4b. Dequantization, compiled

    Every forward and backward dequantizes each NF4 weight: unpack two 4-bit codes per byte, look each up in
    the 16-entry code book, multiply by its block's absmax, cast. Element by element that is several kernels
    and full-size temporaries; `torch.compile` fuses them into one loop, on CPU too, bit for bit the same
    values. Inductor writes C++, so compiling needs a C++ compiler and Python's headers (`fsdp-lab doctor`
    says whether they are here); without them these two cells say what is missing and time the eager forms
    only (and `pytest --nbval` skips them, since they print less). The cell below prints the ratios
    `benchmarks/nf4_compile.py` recorded; the next times this lab's weight (not compared). Both give each
    eager form's time as a multiple of the compiled one's. What compiling saves is the element-wise form's
    kernels and temporaries; the eager gather form `fsdp_lab` uses (one lookup, one multiply) has few to
    save, and needs no compiler: set its ratio beside the element-wise form's.
    """),
    code("""
    from fsdp_lab.qlora.nf4 import dequantize_nf4_blocks, dequantize_nf4_blocks_fused
    from fsdp_lab.toolchain import missing_for_torch_compile
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    w_packed, w_scales = quantize_nf4_blocks(w.reshape(-1), 64)
    eager_out = dequantize_nf4_blocks(w_packed, w_scales, 64, dtype=torch.bfloat16)
    cannot_compile = missing_for_torch_compile()    # None where inductor's C++ can be built here
    if cannot_compile:
        print("not compiled here: torch.compile on CPU needs", cannot_compile)
    else:
        compiled_dequant = torch.compile(dequantize_nf4_blocks_fused, dynamic=False)
        compiled_out = compiled_dequant(w_packed, w_scales, 64, torch.bfloat16)   # the first call compiles
        print("compiled == eager, bit for bit:", torch.equal(compiled_out, eager_out))
    lab08.print_recorded_compile_ratios(files.labs.parent / "benchmarks/results/nf4_compile_cpu.json", w.shape)
    """, tags=["needs-cpp-compiler"]),
    code("""
    timed = {"eager (gather form)": lambda: dequantize_nf4_blocks(w_packed, w_scales, 64, dtype=torch.bfloat16),
             "eager (element-wise form)": lambda: dequantize_nf4_blocks_fused(w_packed, w_scales, 64, torch.bfloat16)}
    if not cannot_compile:
        timed["compiled"] = lambda: compiled_dequant(w_packed, w_scales, 64, torch.bfloat16)
    lab08.print_shortest_times(timed)     # the last one is the reference of the ratios
    """, tags=["nbval-ignore-output", "needs-cpp-compiler"]),
    md("""
    ## 5. What a tensor subclass sees

    `NF4Tensor` reports the shape and dtype of the float weight it stands for (below: (32, 64), float32) but
    holds only bytes. `F.linear` on it is caught by `__torch_function__` and becomes dequantize-then-matmul
    (no weight gradient). Everything else reaches `__torch_dispatch__` as aten ops: the logging mode below
    prints which ops an NF4 weight receives when it is detached, cloned and moved, and what happens for an op
    it does not support.
    """),
    code("""
    class ShowOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, NF4Tensor) for a in args):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    small = to_nf4(torch.randn(32, 64))
    with ShowOps() as mode:
        small.detach(); small.clone(); small.to("cpu", copy=True)
    print("aten ops on the NF4Tensor:", mode.ops)
    print(small)
    try:
        small + 1
    except NotImplementedError as exc:
        print("small + 1 ->", str(exc).splitlines()[0][:100])
    x = torch.randn(2, 64, requires_grad=True)
    y = F.linear(x, small)
    y.sum().backward()
    print("F.linear output", tuple(y.shape), "| input grad", tuple(x.grad.shape), "| weight grad: none")
    """),
    md("""
    ## 6. LoRA on a linear

    `LoRALinear` computes `x Wᵀ + (alpha/r) · x Aᵀ Bᵀ` with W frozen (here NF4) and only A (r × in) and B (out
    × r) trained. B starts at zero, so wrapping changes nothing until the first step.
    """),
    code("""
    torch.manual_seed(0)
    base = nn.Linear(256, 128, bias=False)
    base.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)
    lora = LoRALinear(base, rank=4, alpha=8)
    x = torch.randn(16, 256)
    print("same output as the NF4 base at init:", torch.equal(lora(x), F.linear(x, base.weight)))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    print(f"trainable {trainable} of {trainable + 256 * 128} values ({100 * trainable / (trainable + 256 * 128):.1f}%)")
    target = torch.randn(16, 4) @ torch.randn(4, 128) * 0.1     # a rank-4 change to learn
    opt = torch.optim.AdamW([lora.lora_a, lora.lora_b], lr=1e-2)
    goal = F.linear(x, base.weight) + target
    for step in range(60):
        loss = F.mse_loss(lora(x), goal)
        loss.backward(); opt.step(); opt.zero_grad()
        if step in (0, 59):
            print(f"step {step:2d}  loss {loss.item():.4f}")
    """),
    md("""
    ### Exercise: the LoRA forward

    Write `lora_forward(x, weight, lora_a, lora_b, alpha, rank)`, the output of one LoRA linear without a
    bias: the frozen `weight` (an `NF4Tensor`, out × in) applied to `x`, plus the low-rank update through
    `lora_a` (rank × in) and then `lora_b` (out × rank), scaled by `alpha / rank`. `F.linear(x, weight)`
    dequantizes an NF4 weight for you; most other ops on it are refused. The check uses a random B: at
    initialisation B is zero, and a zero B hides every mistake in the update.
    """),
    exercise("""
    def lora_forward(x, weight, lora_a, lora_b, alpha, rank):
        ### BEGIN SOLUTION
        update = F.linear(F.linear(x, lora_a), lora_b)
        return F.linear(x, weight) + update * (alpha / rank)
        ### END SOLUTION
        ### STUB raise NotImplementedError("return F.linear(x, weight) plus the update through lora_a then lora_b, times alpha / rank")
    """),
    code("""
    lab08.check_lora_forward(lora_forward)
    """),
    md("""
    ## 7. QLoRA under FSDP2 on 2 ranks

    The CPU Llama (2 blocks), every block linear NF4 with rank-8 adapters, one `fully_shard` group per block.
    Each rank holds whole 64-value quantization blocks of packed codes (never split between ranks;
    docs/qlora.md); the all-gather moves those bytes. Step 2 is recorded with `MemoryTracker` and `Timeline`.
    """),
    code("""
    def qlora_llama():          # NF4 base weights and rank-8 adapters: both FSDPs train this below
        from fsdp_lab.models.llama import Llama
        model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
        torch.manual_seed(0)                          # the adapters' initial values
        return apply_lora(model, rank=8, alpha=16, quantize_base=True)

    def qlora_step(steps=3):    # FSDP2 over the QLoRA Llama: each block a group, then the root
        from fsdp_lab.fsdp2 import fully_shard
        model = qlora_llama()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        # AdamW on the adapters; the second step under a MemoryTracker and a Timeline
        return lab08.train_recorded(model, steps)

    runs = fsdp_lab.launch(qlora_step, world_size=2)
    r0 = runs[0]
    print("losses (mean over ranks):", " ".join(f"{(a + b) / 2:.4f}" for a, b in zip(runs[0]["losses"], runs[1]["losses"])))
    lab08.print_memory_at_rest(r0["memory"])
    """),
    md("""
    The `quantized` category is this rank's half of every NF4 weight (codes, int8 scales, factors);
    `sharded_params` are the embeddings, norms and output layer (frozen, float32 here) and the adapters;
    `optimizer_state` is AdamW's two moments (and its step counters) for the adapters only.

    ### All-gather bytes: NF4 against bf16

    One block's all-gather carries its 7 NF4 weights plus its norms and adapters. Had the same weights been
    bf16, each would move 2 bytes per value; the adapters and norms would be the same float32 bytes either
    way, so the comparison keeps them float32 on both sides.
    """),
    code("""
    cfg_cpu = LlamaConfig.from_name("cpu")
    d, f, hd = cfg_cpu.dim, cfg_cpu.ffn_hidden, cfg_cpu.head_dim
    shapes = [(cfg_cpu.n_heads * hd, d), (cfg_cpu.n_kv_heads * hd, d), (cfg_cpu.n_kv_heads * hd, d),
              (d, cfg_cpu.n_heads * hd), (f, d), (f, d), (d, f)]
    linear_values = sum(o * i for o, i in shapes)
    adapters_and_norms = sum(8 * (o + i) for o, i in shapes) + 2 * d
    block_gathers = sorted({b for name, module, b in r0["events"] if name == "all_gather" and module == "layers.0"})
    print("values in one block's linears:", f"{linear_values:,}")
    print("all-gather of layers.0 (bytes, both ranks' shards):", block_gathers)
    print("  of which NF4 ~ values/2 + values/64 =", f"{linear_values // 2 + linear_values // 64:,}")
    print("  adapters + norms in float32         =", f"{4 * adapters_and_norms:,}")
    nf4_block = block_gathers[0]                        # measured: NF4 linears + float32 adapters and norms
    nf4_linears = nf4_block - 4 * adapters_and_norms    # measured, less the float32 part
    print("  NF4 part measured (all-gather - adapters and norms) =", f"{nf4_linears:,}")
    bf16_block = 2 * linear_values + 4 * adapters_and_norms  # the same block with bf16 linears, same float32 rest
    print("the same block with bf16 linears      =", f"{bf16_block:,}",
          f"({bf16_block / nf4_block:.2f}x the NF4 block's all-gather)")
    print(f"float32 adapters + norms are {4 * adapters_and_norms / nf4_block:.0%} of the NF4 block's all-gather: "
          f"the NF4 linears alone are {2 * linear_values / nf4_linears:.2f}x "
          f"smaller than in bf16, the whole block only {bf16_block / nf4_block:.2f}x")
    """),
    md("""
    ### Frozen parameters are resharded too

    The NF4 weights need no gradient, but they are still freed after forward and gathered again in backward
    (each block is gathered twice per step), and freed again after backward: nothing stays gathered between
    steps. Reduce-scatters carry only the adapters' gradients.
    """),
    code("""
    from collections import Counter
    gathers = Counter(module for name, module, b in r0["events"] if name == "all_gather")
    scatter_bytes = sum(b for name, module, b in r0["events"] if name == "reduce_scatter")
    print("all-gathers per group in one step:", dict(sorted(gathers.items())))
    print("bytes still gathered after the step:", r0["unsharded_after"])
    print("reduce-scatter bytes in the step:", f"{scatter_bytes:,}",
          f"(adapter gradients, float32: {4 * sum(8 * (o + i) for o, i in shapes) * 2:,} for 2 blocks)")

    fig = lab08.plot_qlora_two_ranks(runs, nf4_block, bf16_block)
    files.savefig(fig, "qlora_two_ranks.png", dpi=90)
    """),
    md("""
    ### The same model under FSDP1

    FSDP1 flattens a unit's parameters into flat parameters. The NF4 weights' packed storage goes into flat
    parameters of its own, one per inner dtype (uint8 codes, int8 scales, float32 factors and means), never
    cast; after the all-gather each weight is rebuilt as an `NF4Tensor` over the gathered bytes.
    """),
    code("""
    def fsdp1_step():
        import torch.distributed as dist
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
        from fsdp_lab.models.data import global_batch, shard_batch
        from fsdp_lab.models.llama import TransformerBlock
        from fsdp_lab.timeline import Timeline
        rank, world = dist.get_rank(), dist.get_world_size()
        model = FullyShardedDataParallel(qlora_llama(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
        batch = shard_batch(global_batch(512, 4, 32, step=0), rank, world)
        with Timeline() as tl:
            loss = model(batch.input_ids, batch.labels).loss
            loss.backward(); opt.step(); opt.zero_grad()
        return loss.item(), [(e.args.get("dtype"), e.bytes) for e in tl.comm_events(rank, "all_gather")
                             if e.args.get("module") == "layers.0"]

    runs1 = fsdp_lab.launch(fsdp1_step, world_size=2)
    print("first loss, FSDP1 vs FSDP2 (mean over ranks):", f"{(runs1[0][0] + runs1[1][0]) / 2:.4f}",
          f"{(runs[0]['losses'][0] + runs[1]['losses'][0]) / 2:.4f}")
    print("layers.0 all-gathers in one step (dtype, bytes):", runs1[0][1])
    """),
    md("""
    Each flat parameter is gathered in forward and again in backward. fsdp_lab's FSDP1 keeps one dtype and one
    `requires_grad` per flat parameter (PyTorch's allows mixed `requires_grad` with `use_orig_params=True`),
    so the frozen float32 norms and the trainable float32 adapters are two; then come the codes (values/2
    bytes), the int8 scales (values/64) and the float32 factors and means.

    ## 8. Llama-2-7B: estimates beside published figures

    Two published measurements of Llama-2-7B QLoRA on two 24 GB RTX 3090s:

    * the FSDP2 + NF4 talk's headline (REFERENCES.md): 12.88 GiB with FSDP1 + bitsandbytes against 12.60 GiB
      with FSDP2 + torchao's NF4, batch 8 × 2048 tokens (which memory statistic is not stated);
    * Answer.AI's fsdp_qlora benchmarks (`benchmarks_03_2024.md`) report 4.98 GiB, the allocator's peak
      *reserved* memory (`torch.cuda.max_memory_reserved`) for the command on that page: the script's default
      LoRA rank 64 on q, k, v, gate, up and down (not o), batch 1 × 512, pure bf16, FSDP1 + bitsandbytes, with
      reentrant checkpointing and no CPU offload (both flags set against the script's defaults).

    The estimator counts *live* bytes for the same model and batch shapes (with gradient checkpointing in both
    settings), with adapters on all seven linears of each block (`LORA_TARGETS` in
    `fsdp_lab/memory/estimate.py`) where Answer.AI's run has six (not o):
    """),
    code("""
    def live(strategy="fsdp2", rank=8, batch=1, seq=512):   # the estimate of live bytes, by category
        return estimate("llama2-7b", world_size=2, strategy=strategy, param_dtype=torch.bfloat16, qlora=True,
                        lora_rank=rank, batch_size=batch, seq_len=seq, activation_checkpointing=True)

    PUBLISHED = {"talk, FSDP1 + bitsandbytes": 12.88, "talk, FSDP2 + torchao NF4": 12.60,
                 "Answer.AI (rank 64), peak reserved": 4.98}  # GiB, sources in REFERENCES.md
    talk_estimate = {s: live(s, rank=8, batch=8, seq=2048) for s in ("fsdp2", "fsdp1_full_shard")}
    small = {rank: live(rank=rank) for rank in (8, 64)}
    lab08.print_published_against_estimates(PUBLISHED, talk_estimate, small, files.labs.parent / "benchmarks/results")
    """),
    md("""
    Where the gap at batch 1 × 512 can come from (sources in REFERENCES.md and Answer.AI's benchmark page):

    * **Not the CUDA context**: `max_memory_reserved` counts only what PyTorch's caching allocator holds; the
      context lives outside it.
    * **The allocator's reserve**: in Answer.AI's script every rank loads and quantizes the model layer by
      layer on its own GPU (rank 0 keeps the result on the CPU, the others on `meta`, and FSDP then
      broadcasts rank 0's weights with `sync_module_states`); blocks cached while loading stay reserved
      unless released by `torch.cuda.empty_cache()`, which later versions of the script call.
    * **bitsandbytes' own buffers**: `Linear4bit` keeps its quantization state on the module, outside the flat
      parameter, so the absmax statistics are replicated on every rank, and in March 2024 each weight was
      dequantized to a full bf16 temporary for its matmul (both worked out from the shapes below).
    """),
    code("""
    lab08.print_bitsandbytes_buffers(LlamaConfig.from_name("llama2-7b"))
    """),
    md("""
    At batch 8 × 2048 activations and temporaries are most of the estimate (the shares printed above), which
    lands close to the talk's figures (the difference printed above). The GPU lines are our own code on the GPU
    and torch named beside them (`benchmarks/qlora_7b.py --device cuda`: rank 0 of 2, `max_memory_allocated`).

    ## 9. Explore: rank, block size, double quantization, world size

    Per-rank model-state memory of Llama-2-7B QLoRA (activations left out) and the bytes one block's
    all-gather moves. The static figure is the widget's default setting.
    """),
    code("""
    def seven_b(lora_rank, block_size, double_quant, world_size):
        c = LlamaConfig.from_name("llama2-7b")
        lin = [(c.dim, c.dim)] * 4 + [(c.ffn_hidden, c.dim)] * 2 + [(c.dim, c.ffn_hidden)]
        nf4 = c.n_layers * sum(nf4_storage_bytes(o * i, block_size, 256, double_quant) for o, i in lin)
        adapters = c.n_layers * sum(lora_rank * (o + i) for o, i in lin)
        frozen = 2 * c.vocab_size * c.dim + (2 * c.n_layers + 1) * c.dim
        per_rank = {"quantized": nf4 / world_size, "sharded_params": 2 * (frozen + adapters) / world_size,
                    "sharded_grads": 2 * adapters / world_size, "optimizer_state": 4 * adapters / world_size}
        return per_rank, nf4 / c.n_layers, 2 * sum(o * i for o, i in lin)    # and one block's NF4 / bf16 bytes

    def render(lora_rank, block_size, double_quant, world_size):
        return lab08.draw_7b_states(*seven_b(lora_rank, block_size, double_quant, world_size), world_size)

    fig, text = render(8, 64, True, 2)
    print(text)
    files.savefig(fig, "explore_7b.png", dpi=90)
    lab08.print_adapters_against_frozen(seven_b, world_size=2)
    """),
    code("""
    explorer = Explorer({
        "lora_rank": widgets.Dropdown(options=[4, 8, 16, 64], value=8, description="LoRA rank"),
        "block_size": widgets.Dropdown(options=[32, 64, 128, 256], value=64, description="block size"),
        "double_quant": widgets.Checkbox(value=True, description="double quant"),
        "world_size": widgets.Dropdown(options=[1, 2, 4, 8], value=2, description="world size"),
    }, render, title="QLoRA at 7B: memory and bytes")
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    Smaller blocks track the weights more closely but cost more scale bytes; double quantization makes that
    cost small. At LoRA rank 8 the adapters, with their gradients and AdamW state, are smaller than the frozen
    bf16 embeddings, norms and output layer, which then are the largest part after the NF4 weights; at LoRA
    rank 64 (Answer.AI's setting) the adapters are the larger of the two, though still smaller than the NF4
    weights (the lines printed above).

    ## 10. Exercise: the nearest-code lookup

    Write `nearest_code(normalised)`: for each value in [-1, 1], its NF4 code (0..15) as bitsandbytes computes
    it: the number of the 15 midpoints between neighbouring `NF4_CODEBOOK` entries, computed in float32, that
    lie **strictly below** the value. That is the nearest code everywhere but on a midpoint itself, which goes
    to the **lower** code even where float32 rounding left it a little nearer the upper one (section 3's last
    line); an argmin of distances sends those up (torchao takes the argmin of distances to its rounded table,
    so its codes near midpoints can go either way).
    """),
    exercise("""
    def nearest_code(normalised):
        ### BEGIN SOLUTION
        midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
        return (normalised[..., None] > midpoints).sum(dim=-1).to(torch.uint8)
        ### END SOLUTION
        ### STUB raise NotImplementedError("count, for each value, the midpoints between neighbouring codes that lie strictly below it")
    """),
    code("""
    lab08.check_nearest_code(nearest_code)
    """),
    md("""
    ## Summary

    * NF4 stores 4-bit codes at normal quantiles, one absmax scale per 64 values; double quantization shrinks
      the scales to int8 with a float32 factor per 256: ~4.127 bits per weight.
    * `NF4Tensor` is a tensor subclass: the model sees a float weight, `F.linear` dequantizes on the fly,
      other aten ops reach `__torch_dispatch__`.
    * LoRA trains two small matrices per linear; under FSDP2 the NF4 weights are sharded by whole blocks and
      all-gathered as bytes, frozen yet resharded like any parameter. The NF4 linears move about a quarter of
      their bf16 bytes; a whole block's all-gather, whose float32 adapters and norms weigh the same either
      way, shrinks by less (both ratios printed in section 7).
    * Answer.AI's Llama-2-7B figure is the allocator's peak *reserved* memory (the talk's statistic is not
      stated); the estimator counts live bytes (section 8: the gap at batch 1 × 512, where it can come from).

    Read next: `fsdp_lab/qlora/nf4.py`, `nf4_fsdp.py`, `lora.py` and `docs/qlora.md`.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
