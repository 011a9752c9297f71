"""Lab 10: bring your own Hugging Face model: both FSDPs, QLoRA, memory, timeline, PEFT adapters."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 10 — Bring your own model: a Hugging Face `transformers` model under FSDP and QLoRA

    **Goals.**

    1. Take a model as `transformers` gives it (`LlamaForCausalLM`) and shard it with fsdp_lab's FSDP2 and
       FSDP1: a decoder layer is a module like any other.
    2. QLoRA it: `apply_lora` finds `q_proj` … `down_proj` by their Hugging Face names.
    3. Watch one step: the memory breakdown by category (`MemoryTracker`) and the collective timeline.
    4. Save the adapters in PEFT's format and load them back with `peft` onto the plain model.

    Here the model is built from a small config with random weights (CPU, no download). Where the
    machine has real weights, set `FSDP_LAB_HF_MODEL` to their folder (or a hub name) before starting
    the notebook: the same cells then load them with `from_pretrained`. The compared outputs below are
    those of the small config.
    """),
    code("""
    %matplotlib inline
    import os, tempfile
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import transformers, peft
    import fsdp_lab
    fsdp_lab.start_fork_server(preload=["transformers", "peft"])   # ranks fork from it with these imported
    from fsdp_lab import hf
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.qlora import apply_lora, lora_parameter_counts
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.memory_plots import plot_breakdown
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab_files, lab10

    files = lab_files("10_hugging_face")
    transformers.logging.set_verbosity_error()          # no load reports or progress bars in the outputs
    transformers.utils.logging.disable_progress_bar()
    import warnings; warnings.filterwarnings("ignore", category=FutureWarning)
    print(f"torch {torch.__version__} | transformers {transformers.__version__} | peft {peft.__version__}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The model

    `make_model()` is what every rank calls. With `FSDP_LAB_HF_MODEL` set it loads real weights with
    `from_pretrained` (on CPU, float32, eager attention like the small model's); otherwise it builds the
    small Llama of `lab10.tiny_llama` from a config, seeded, so every rank builds the same weights.
    """),
    code("""
    def make_model():
        path = os.environ.get("FSDP_LAB_HF_MODEL")
        if path:   # real weights, where the machine has them
            return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
        return lab10.tiny_llama(seed=0)

    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    print(type(model).__name__, "|", len(model.model.layers), "decoder layers |", f"{n_params:,} parameters")
    print("decoder layer class:", type(model.model.layers[0]).__name__)
    one_process = lab10.train_losses(make_model())
    # float32 losses: digits past the 4th can depend on the CPU's kernels, hence the "≈"
    print(f"one process, {len(one_process)} SGD steps, losses:", ", ".join(f"≈{x:.4f}" for x in one_process))
    """),
    md("""
    ## 2. Exercise: shard it with FSDP2

    Write `shard_hf_model(model)`: one `fully_shard` per decoder layer (`model.model.layers`), then one for
    the root (the embeddings, final norm and `lm_head` stay in the root's group). The check runs it on 2
    ranks on `lab10`'s small Llama (even where `make_model` loads real weights), trains it and compares the
    losses with those of the same small model trained in one process.
    """),
    exercise("""
    def shard_hf_model(model):
        ### BEGIN SOLUTION
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
        ### END SOLUTION
        ### STUB raise NotImplementedError("fully_shard each layer of model.model.layers, then the model")
    """),
    code("""
    lab10.check_shard_hf_model(shard_hf_model)
    """),
    md("""
    ## 3. One step under FSDP2, FSDP1 and QLoRA: memory and collectives

    The same step on 2 ranks three ways: fsdp_lab's FSDP2 (one group per decoder layer and the root), FSDP1
    (`FullyShardedDataParallel` with one unit per decoder layer), and QLoRA (NF4 base weights plus low-rank
    adapters, their rank and alpha printed first) under FSDP2. Each rank reports its bytes by category at the
    moment of its step's peak, as its `MemoryTracker` saw them (each category's own maximum comes at other
    moments, so those would not add up to the peak), and its collectives on a `Timeline`. The step recorded is
    each model's first, and each peak comes in backward (printed with the last phase boundary before it;
    `opt.step()` has boundaries of its own), before AdamW creates its state inside `opt.step()`, so no
    `optimizer_state` shows at these peaks. From the second step on the state is there for the whole step. The
    loss printed is the mean over both ranks (each rank's loss is that of its half of the batch), all-reduced
    after the recorded step; it is checked against the first loss of the one-process run above, which saw the
    whole batch. QLoRA's loss is not expected to match it: its adapters start at zero, but its base weights
    are NF4-rounded.
    """),
    code("""
    def one_step(kind):
        import torch.distributed as dist
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
        from fsdp_lab.qlora import NF4Tensor
        rank, world = dist.get_rank(), dist.get_world_size()
        model = make_model()
        nf4 = None
        if kind == "QLoRA + FSDP2":
            torch.manual_seed(1)
            apply_lora(model, rank=lab10.RANK, alpha=lab10.ALPHA)   # the adapters the PEFT exercise exports
            quantized = [p for p in model.model.layers[0].parameters() if isinstance(p, NF4Tensor)]
            nf4 = {"stored": sum(p.storage_bytes() for p in quantized), "float32": 4 * sum(p.numel() for p in quantized),
                   "rest": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters()
                               if not isinstance(p, NF4Tensor))}          # adapters and norms, float32
        if kind == "FSDP1":
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}))
        else:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = lab10.token_batch(0, rank, world)
        with Timeline() as tl, MemoryTracker(model, opt) as mt:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean_loss = loss.detach().clone()          # after the recorded step: not in the timeline or the memory
        dist.all_reduce(mean_loss)
        mean_loss /= world
        comms = [(e.name, e.args.get("module"), e.bytes) for e in sorted(tl.comm_events(rank), key=lambda e: e.t_start)]
        return {"memory": mt.result(), "timeline": tl, "comms": comms, "loss": mean_loss.item(), "nf4": nf4}

    KINDS = ("FSDP2", "FSDP1", "QLoRA + FSDP2")
    runs = {kind: fsdp_lab.launch(one_step, kind, world_size=2) for kind in KINDS}
    kib = lambda b: f"{b / 1024:8.1f} KiB"
    print(f"QLoRA adapters: rank {lab10.RANK}, alpha {lab10.ALPHA}")
    for kind, results in runs.items():
        r0 = results[0]
        gathers = [b for name, _, b in r0["comms"] if name == "all_gather"]
        print(f"{kind:14} loss ≈{r0['loss']:.4f} (mean over ranks) | all-gathers {len(gathers):2d} ({kib(sum(gathers))}) | "
              f"reduce-scatters {sum(n == 'reduce_scatter' for n, _, _ in r0['comms']):2d}")
        memory = r0["memory"]
        print(f"   at the step's peak ({kib(memory.peak_total).strip()}, rank 0, after '{memory.peak_label}'):",
              ", ".join(f"{k} {kib(v).strip()}" for k, v in memory.peak.items() if v))
    for kind in ("FSDP2", "FSDP1"):
        print(f"{kind} loss equal to one process's first loss (≈{one_process[0]:.4f}) within 1e-5:",
              abs(runs[kind][0]["loss"] - one_process[0]) < 1e-5)
    print("QLoRA + FSDP2 loss differs from one process's by more than 1e-5 (its base weights are NF4):",
          abs(runs["QLoRA + FSDP2"][0]["loss"] - one_process[0]) > 1e-5)

    layer = "model.layers.0"                         # the first decoder layer's group
    layer_gather = {kind: next(b for name, module, b in runs[kind][0]["comms"] if name == "all_gather" and module == layer)
                    for kind in ("FSDP2", "QLoRA + FSDP2")}
    nf4 = runs["QLoRA + FSDP2"][0]["nf4"]
    print(f"{layer}'s all-gather: {layer_gather['FSDP2']:,} bytes in float32, {layer_gather['QLoRA + FSDP2']:,} with QLoRA "
          f"({layer_gather['QLoRA + FSDP2'] / layer_gather['FSDP2']:.2f} of float32)")
    print(f"   its NF4 linears: {nf4['stored']:,} bytes against {nf4['float32']:,} in float32 "
          f"({nf4['stored'] / nf4['float32']:.3f} of float32, {2 * nf4['stored'] / nf4['float32']:.3f} of bf16)")
    print(f"   its float32 adapters and norms: {nf4['rest']:,} bytes; the remaining "
          f"{layer_gather['QLoRA + FSDP2'] - nf4['stored'] - nf4['rest']:,}: each rank sends its own copy of every NF4 "
          "weight's double-quantization factor and mean, counted once in the stored bytes (fsdp_lab/qlora/nf4_fsdp.py)")
    """),
    md("""
    Here FSDP1 and FSDP2 all-gather the same bytes and both reach the one-process loss. The bytes need not
    match for every model: FSDP2 pads each parameter's dim 0 to a multiple of the world size, FSDP1 each
    unit's flat parameter, so their padding can differ; the loss matches regardless. With QLoRA a decoder layer's all-gather carries the 4-bit codes
    and the scales of its linears (their share of the float32 and bf16 bytes is printed), with the float32
    adapters and norms riding along: the last lines split the whole layer's all-gather, printed as a fraction
    of its float32 size. Only the adapters' gradients are reduce-scattered. The figure stacks rank 0's bytes
    by category at the peak of its step (the bar's height is that peak) and shows the timeline of both ranks
    for each run; the widget below switches between them. (A run's duration is its first step's, where one rank
    may wait for the other: it changes from run to run, the bytes and counts do not.)
    """),
    code("""
    def render(kind):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 3]})
        plot_breakdown({k: runs[k][0]["memory"].peak for k in KINDS}, ax=left, unit="KiB",
                       title="rank 0 bytes by category at the step's peak")
        plot_timeline(Timeline.merge([r["timeline"] for r in runs[kind]]), ax=right, title=f"{kind}, 2 ranks, one step",
                      legend_outside=True)
        fig.tight_layout()
        return fig

    fig = render("QLoRA + FSDP2")
    files.savefig(fig, "memory_and_timeline.png", dpi=80, bbox_inches="tight")
    """),
    code("""
    explorer = Explorer({"kind": widgets.ToggleButtons(options=list(KINDS), value="QLoRA + FSDP2", description="run")},
                        render, title="one step, three ways")
    explorer.show(fig);
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 4. Exercise: the adapters in PEFT's format

    PEFT stores a LoRA layer's matrices under `base_model.model.<module name>.lora_A.weight` (rank × in) and
    `...lora_B.weight` (out × rank). Write `peft_state_dict(model)`: for each `LoRALinear` of a QLoRA model
    (`lab10`'s tiny Llama after `apply_lora`), map those keys to its `lora_a` and `lora_b`. The check writes
    your tensors beside PEFT's `adapter_config.json`, loads them with `peft.PeftModel.from_pretrained` onto
    the plain model holding the dequantized base weights, and compares its logits with the QLoRA model's.
    """),
    exercise("""
    def peft_state_dict(model):
        from fsdp_lab.qlora import LoRALinear
        ### BEGIN SOLUTION
        out = {}
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                out[f"base_model.model.{name}.lora_A.weight"] = module.lora_a
                out[f"base_model.model.{name}.lora_B.weight"] = module.lora_b
        return out
        ### END SOLUTION
        ### STUB raise NotImplementedError("for each LoRALinear: base_model.model.<name>.lora_A.weight -> lora_a, lora_B -> lora_b")
    """),
    code("""
    lab10.check_peft_state_dict(peft_state_dict)
    """),
    md("""
    ## 5. Save and reload with `peft`

    `fsdp_lab.hf.export_peft_adapters` writes exactly that, with the config; `fsdp_lab.hf.save_pretrained`
    writes the base model with the NF4 weights dequantized (`adapters=False`: the plain model's keys only). Loading both with `transformers` and `peft`
    gives back the QLoRA model's outputs.
    """),
    code("""
    qlora = make_model()
    torch.manual_seed(1)
    apply_lora(qlora, rank=lab10.RANK, alpha=lab10.ALPHA)
    lab10.train_losses(qlora)            # 2 steps: the adapters move away from their zero start
    counts = lora_parameter_counts(qlora)
    print(f"trainable {counts.trainable:,} of {counts.total:,} parameters ({counts.trainable_fraction:.2%})")
    ids = lab10.token_batch(0)
    with torch.no_grad():
        ours = qlora(input_ids=ids).logits
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(qlora, f"{d}/base", adapters=False)   # the plain model's keys only
        hf.export_peft_adapters(qlora, f"{d}/adapters")
        print("adapter files:", sorted(os.listdir(f"{d}/adapters")))
        base = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/base", attn_implementation="eager").eval()
        reloaded = peft.PeftModel.from_pretrained(base, f"{d}/adapters").eval()
        with torch.no_grad():
            theirs = reloaded(input_ids=ids).logits
    print("PEFT's logits equal ours within 1e-5:", torch.allclose(theirs, ours, atol=1e-5, rtol=0))
    """),
    md("""
    ## Summary

    * A `transformers` model shards like any module: `fully_shard` each decoder layer and the root (FSDP2), or
      wrap with `ModuleWrapPolicy({DecoderLayerClass})` (FSDP1); the loss averaged over ranks equals one
      process's (to 1e-5, printed in section 3).
    * `apply_lora` finds Hugging Face's layer names by default; under FSDP the base linears travel as NF4, while
      the embeddings, `lm_head`, norms and adapters stay float32 (section 3 splits a layer's all-gather).
    * `MemoryTracker` and `Timeline` read a Hugging Face model's step as they read any other.
    * The adapters are what a fine-tune produces: PEFT's keys and config make them loadable with
      `PeftModel.from_pretrained` onto the plain model; see docs/huggingface.md.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
