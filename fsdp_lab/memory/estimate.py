"""Estimate the peak memory of one training step of a Llama, per rank, without running it.

Model states (parameters, gradients, optimizer state) are exact: they follow from the
parameter shapes of the config and how each strategy shards them (rank 0's shard). Activations
follow a per-layer formula for the Llama block of ``fsdp_lab.models.llama`` (below), exact for
what autograd saves in that code. Transients (unsharded layers, gradients before
reduce-scatter, the loss gradient, optimizer temporaries) are modelled per phase, and the peak
is the largest phase.

Activation formula. T = batch_size * seq_len tokens, d = dim, f = ffn_hidden, h = n_heads,
A = h * head_dim (the query width, d unless ``explicit_head_dim``), V = vocab_size,
L = n_layers, e = bytes of the compute dtype (RMSNorm computes in float32, the loss in float32,
hence the 4s):

    per RMSNorm   = 4*T*d (its float32 input) + 2*e*T*d (normalised and scaled output) + 4*T
    per block     = 2 * RMSNorm
                  + 4*e*T*A        (attention q, k, v, output saved by SDPA; k, v after repeat_interleave)
                  + 4*T*h          (SDPA's float32 log-sum-exp)
                  + e*T*A          (input of wo)
                  + 4*e*T*f        (SwiGLU: w1 out, w3 out, silu(w1 out), their product)
                  [+ (4 + e)*T*(A + A_kv) + 4*T*(h + h_kv) with ``qk_norm``: each head norm's
                     float32 input, rsqrt per head and output; A_kv = n_kv_heads * head_dim]
    whole model   = L * per block + RMSNorm (final; its output is the input of ``output``)
                  + 4*T*V (float32 log-softmax output kept by the loss)
                  + 8*T (the int64 labels the loss keeps)
                  + 8*T (the int64 input ids the embedding saves for its weight's gradient)

With activation checkpointing a block keeps only its input (e*T*d) and one block's full
activations are recomputed at a time in backward. The loss gradient adds 8*T*V bytes
(float32 gradients of log-probabilities and logits) at the start of backward, once the loss
has let go of its labels; the input ids stay saved until the embedding's backward. The logits
themselves (e*T*V) count only while the caller holds the model output (assumed not).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fsdp_lab.checks import check_bool, check_positive_int
from fsdp_lab.memory.results import unit_scale
from fsdp_lab.memory.tags import CATEGORIES
from fsdp_lab.models.llama import CONFIGS, LlamaConfig, count_parameters

STRATEGIES = ("ddp", "fsdp1_full_shard", "fsdp1_shard_grad_op", "fsdp1_no_shard",
              "fsdp1_hybrid_shard", "fsdp2")
# optimizer -> (states per parameter in the parameter dtype, extra float32 bytes per parameter)
OPTIMIZERS = {
    "adamw": (2, 0),          # torch.optim.AdamW: exp_avg, exp_avg_sq like the parameter
    "adamw_master": (0, 12),  # mixed precision (DeepSpeed's K=12): fp32 master, exp_avg, exp_avg_sq
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
}
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


@dataclasses.dataclass
class Breakdown:
    """Bytes per category (all of ``CATEGORIES``) at the estimated peak of one rank.

    ``phase`` names the phase where the peak falls; ``phases`` holds every phase's breakdown;
    ``host`` holds what CPU offload keeps in host memory; ``notes`` the assumptions made.
    """

    bytes: dict[str, int]
    phase: str = ""
    phases: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def __getitem__(self, category: str) -> int:
        return self.bytes[category]

    @property
    def total(self) -> int:
        """Sum over categories (bytes)."""
        return sum(self.bytes.values())

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state on the device at the optimizer step
        (bytes; the sharded ones under FSDP), as DeepSpeed's ZeRO formulas count them."""
        at_step = self.phases.get("optimizer_step", self.bytes)
        return sum(at_step[c] for c in ("params", "sharded_params", "grads", "sharded_grads",
                                         "optimizer_state", "quantized"))

    def table(self, unit: str = "GiB") -> str:
        """Text table of the non-zero categories and the total in ``unit`` (B, KiB, MiB, GiB, KB, MB, GB).
        Raises ValueError for another unit."""
        scale = unit_scale(unit)
        rows = [f"{c:<18}{v / scale:>12.3f} {unit}" for c, v in self.bytes.items() if v]
        rows.append(f"{'total':<18}{self.total / scale:>12.3f} {unit}   (peak phase: {self.phase})")
        if self.host:
            rows.append(f"{'host (offload)':<18}{sum(self.host.values()) / scale:>12.3f} {unit}")
        return "\n".join(rows)


def parameter_shapes(config: LlamaConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(unit, name, shape) of every parameter of ``Llama(config)``, in the order of its
    ``parameters()`` (the order an optimizer steps them in); unit is "root" or "layers.i"."""
    d, hd, f = config.dim, config.head_dim, config.ffn_hidden
    q_out, kv_out = config.n_heads * hd, config.n_kv_heads * hd
    layer = [("attention_norm.weight", (d,))]
    for linear, out in (("wq", q_out), ("wk", kv_out), ("wv", kv_out)):
        layer.append((f"attention.{linear}", (out, d)))
        if config.qkv_bias:
            layer.append((f"attention.{linear}.bias", (out,)))
    layer.append(("attention.wo", (d, q_out)))
    if config.qk_norm:
        layer += [("attention.q_norm.weight", (hd,)), ("attention.k_norm.weight", (hd,))]
    layer += [("ffn_norm.weight", (d,)),
              ("feed_forward.w1", (f, d)), ("feed_forward.w3", (f, d)), ("feed_forward.w2", (d, f))]
    shapes = [("root", "tok_embeddings.weight", (config.vocab_size, d))]
    for i in range(config.n_layers):
        shapes += [(f"layers.{i}", f"layers.{i}.{n}", s) for n, s in layer]
    shapes.append(("root", "norm.weight", (d,)))
    if not config.tie_embeddings:
        shapes.append(("root", "output.weight", (config.vocab_size, d)))
    return shapes


def activation_bytes(config: LlamaConfig, batch_size: int, seq_len: int, dtype=torch.float32,
                     activation_checkpointing: bool = False, lora_rank: int = 0) -> dict[str, int]:
    """Bytes saved for backward after forward, by part: ``per_block``, ``first_block`` (block 0's,
    less under QLoRA), ``blocks`` (all L), ``final_norm``, ``loss`` (what the loss keeps: its
    log-softmax output, 4TV, and the int64 labels, 8T, which are also given alone as
    ``labels``), ``input_ids`` (the int64 ids the embedding saves, 8T), ``total``; plus
    ``recompute`` (one block's activations rebuilt in backward under checkpointing, else 0),
    ``kept_per_block`` (what one block after the first keeps until its backward) and
    ``backward_transient``. Formula in the module docstring.

    ``lora_rank`` > 0 means QLoRA: only the adapters train, so a norm's weight is frozen and
    its normalised output is not saved for the weight's gradient (e*T*d less per norm), and
    the final norm's output feeds the frozen ``output`` projection, which saves nothing. The
    embedding is frozen too: it keeps no input ids, and block 0's input needs no gradient, so
    its attention norm keeps neither its float32 input nor its rsqrt (4*T*d + 4*T less)."""
    e = torch.empty((), dtype=dtype).element_size()
    T, d, f, h, V = batch_size * seq_len, config.dim, config.ffn_hidden, config.n_heads, config.vocab_size
    norm = 4 * T * d + 2 * e * T * d + 4 * T
    final_norm = norm
    if lora_rank:
        norm -= e * T * d
        final_norm -= 2 * e * T * d
    A, A_kv, h_kv = h * config.head_dim, config.n_kv_heads * config.head_dim, config.n_kv_heads
    block = 2 * norm + 4 * e * T * A + 4 * T * h + e * T * A + 4 * e * T * f
    if config.qk_norm:  # each keeps its float32 input, its rsqrt per head and (for the weight's
        # gradient, unless frozen under QLoRA) its normalised output; RoPE then keeps nothing of it
        block += (4 + (0 if lora_rank else e)) * T * (A + A_kv) + 4 * T * (h + h_kv)
    block += 7 * e * T * lora_rank  # LoRA: each adapted linear saves its A output for B
    first_block = block - (4 * T * d + 4 * T if lora_rank else 0)
    kept = e * T * d if activation_checkpointing else block
    kept_first = e * T * d if activation_checkpointing else first_block
    parts = {"per_block": block, "first_block": first_block,
             "blocks": (config.n_layers - 1) * kept + kept_first, "final_norm": final_norm,
             "labels": 8 * T, "loss": 4 * T * V + 8 * T, "input_ids": 0 if lora_rank else 8 * T,
             "recompute": (block if config.n_layers > 1 else first_block) if activation_checkpointing else 0,
             "backward_transient": 2 * e * T * f, "kept_per_block": kept}
    parts["total"] = parts["blocks"] + parts["final_norm"] + parts["loss"] + parts["input_ids"]
    return parts


def hybrid_shard_group_size(world_size: int, shard_group_size: int | None = None) -> int:
    """Ranks per shard group of ``fsdp1_hybrid_shard``: ``shard_group_size``, default one node of
    8 GPUs (min(8, world_size)), as PyTorch's HYBRID_SHARD shards within a node. Raises
    ValueError when the group does not divide ``world_size``, naming a group that would."""
    if shard_group_size is None:
        group = min(8, world_size)
        if world_size % group:
            fits = max(d for d in range(1, group + 1) if world_size % d == 0)
            raise ValueError(f"fsdp1_hybrid_shard shards within a node, 8 GPUs unless shard_group_size says "
                             f"otherwise; world_size {world_size} is not a whole number of 8-GPU nodes: pass "
                             f"shard_group_size (GPUs per node, e.g. {fits}), or a world size that is a "
                             "multiple of 8")
        return group
    if shard_group_size < 1 or world_size % shard_group_size:
        raise ValueError(f"shard_group_size ({shard_group_size}) must divide world_size ({world_size})")
    return shard_group_size


def _bytes_of(dtype) -> int:
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype or its name in torch (torch.bfloat16 or "
                         f"'bfloat16'), got {dtype!r}")
    return torch.empty((), dtype=resolved).element_size()


def _nf4_bytes(numel: int) -> int:
    """NF4 storage of a weight as ``to_nf4`` keeps it (double quantisation, as torchao):
    4-bit codes, an int8 scale per 64 values, a float32 factor per 256 scales, a float32 mean."""
    from fsdp_lab.qlora.nf4 import nf4_storage_bytes
    return nf4_storage_bytes(numel, NF4_BLOCK, NF4_SCALER_BLOCK, double_quant=True)


def _nf4_shard_bytes(numel: int, shards: int) -> int:
    """Bytes of rank 0's shard of an NF4 weight: FSDP2 shards by whole blocks (``nf4_fsdp.py``)."""
    from fsdp_lab.qlora.nf4_fsdp import all_gather_bytes, plan_shards
    plan = plan_shards(numel, NF4_BLOCK, NF4_SCALER_BLOCK, True, shards)
    return all_gather_bytes(plan, NF4_BLOCK, True) // shards


def estimate(config: LlamaConfig | str, *, world_size: int, strategy: str, param_dtype=torch.float32,
             grad_dtype=None, compute_dtype=None, optimizer: str = "adamw", batch_size: int,
             seq_len: int, activation_checkpointing: bool = False, cpu_offload: bool = False,
             qlora: bool = False, reshard_after_forward: bool = True, foreach: bool = False,
             lora_rank: int = 8, shard_group_size: int | None = None, device: str = "cpu") -> Breakdown:
    """Estimated per-rank memory (bytes per category) at the peak of one training step.

    Steady state: the step after the first (optimizer state exists; gradients were freed by
    ``zero_grad(set_to_none=True)``). ``param_dtype`` is the dtype parameters are stored in,
    ``grad_dtype`` (default param_dtype) that of gradients, ``compute_dtype`` (default
    param_dtype) that of activations and of FSDP's unsharded parameters. ``batch_size`` is per
    rank. ``foreach`` models the multi-tensor optimizer (the default on CUDA), which holds one
    full-size temporary; the per-parameter loop (CPU default) holds, at its most, a parameter's
    ``exp_avg_sq`` square root and its quotient by the bias correction, and the previous
    parameter's quotient.
    ``shard_group_size`` is the sharding group of ``fsdp1_hybrid_shard`` (default min(8, N): one
    node of 8 GPUs, as PyTorch's HYBRID_SHARD shards within a node).
    With ``qlora`` the block linears are frozen NF4 weights with trainable LoRA adapters of
    rank ``lora_rank``; everything else is frozen in ``param_dtype``.
    ``device`` ("cpu" or "cuda") is where the step runs: on CUDA, AdamW keeps its step counters
    (4 bytes per trainable tensor) in host memory (PyTorch's default, neither capturable nor
    fused), so they are not the device's.

    Raises ValueError for an unknown strategy/optimizer/device, bad sizes (``lora_rank`` too,
    with ``qlora``), non-float dtypes, a switch the
    strategy has no use for (``shard_group_size`` but for ``fsdp1_hybrid_shard``,
    ``reshard_after_forward=False`` but for ``fsdp2``), and for a ``fsdp1_hybrid_shard`` world that
    ``shard_group_size`` (or 8) does not divide; TypeError for a config that is neither a
    ``LlamaConfig`` nor a known name, and for a switch that is not True or False.
    """
    if isinstance(config, str):
        config = LlamaConfig.from_name(config)
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a LlamaConfig or one of the names {', '.join(CONFIGS)}, got a "
                        f"{type(config).__name__}; for a Hugging Face model (its folder, config.json, a dict or a "
                        f"transformers config) pass LlamaConfig.from_hf(...)")
    for name, value in (("activation_checkpointing", activation_checkpointing), ("cpu_offload", cpu_offload),
                        ("qlora", qlora), ("reshard_after_forward", reshard_after_forward), ("foreach", foreach)):
        check_bool(name, value)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    for name, value in (("world_size", world_size), ("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(name, value)
    if qlora:
        check_positive_int("lora_rank", lora_rank)
    if shard_group_size is not None and strategy != "fsdp1_hybrid_shard":
        raise ValueError(f"shard_group_size is the shard group of fsdp1_hybrid_shard, not of {strategy!r}. HSDP "
                         f"under FSDP2 is not modelled: a rank holds about what fsdp2 at "
                         f"world_size={shard_group_size} gives it")
    if not reshard_after_forward and strategy != "fsdp2":
        raise ValueError(f"reshard_after_forward is FSDP2's switch; {strategy!r} does not read it (FSDP1 keeps "
                         f"parameters gathered after forward with strategy='fsdp1_shard_grad_op')")
    p = _bytes_of(param_dtype)
    g = _bytes_of(grad_dtype if grad_dtype is not None else param_dtype)
    c = _bytes_of(compute_dtype if compute_dtype is not None else param_dtype)
    compute = compute_dtype if compute_dtype is not None else param_dtype
    compute = getattr(torch, compute) if isinstance(compute, str) else compute
    n_states, master_bytes = OPTIMIZERS[optimizer]
    notes = []

    sharded = strategy in ("fsdp1_full_shard", "fsdp1_shard_grad_op", "fsdp1_hybrid_shard", "fsdp2")
    shards = world_size
    if strategy == "fsdp1_hybrid_shard":
        shards = hybrid_shard_group_size(world_size, shard_group_size)
    flat = strategy.startswith("fsdp1")

    # ---- parameters: which are trainable, which quantised, how each is sharded ----------
    shapes = parameter_shapes(config)
    units: dict[str, int] = {}
    for unit, _, shape in shapes:
        units[unit] = units.get(unit, 0) + math.prod(shape)
    trainable, frozen, quant_numel, quant_bytes, quant_shard, largest_quant = [], [], 0, 0, 0, 0
    for unit, name, shape in shapes:
        leaf = name.split(".")[-1]
        if qlora and unit != "root" and leaf in LORA_TARGETS:
            quant_numel += math.prod(shape)
            largest_quant = max(largest_quant, math.prod(shape))
            quant_bytes += _nf4_bytes(math.prod(shape))
            quant_shard += _nf4_shard_bytes(math.prod(shape), shards) if sharded else 0
            out_f, in_f = shape
            trainable += [(unit, (lora_rank, in_f)), (unit, (out_f, lora_rank))]
        elif qlora:
            frozen.append((unit, shape))
        else:
            trainable.append((unit, shape))
    if qlora:
        notes.append(f"QLoRA: NF4 block {NF4_BLOCK}, scaler block {NF4_SCALER_BLOCK}; LoRA rank "
                     f"{lora_rank} on {', '.join(LORA_TARGETS)}")

    def fsdp2_local(shape) -> int:
        """Rank 0's elements of one FSDP2 parameter: chunked on dim 0, ceil(dim0 / N) rows."""
        return math.ceil(shape[0] / shards) * math.prod(shape[1:])

    def shard_numel(items) -> int:
        """Rank 0's share of the elements of ``items`` [(unit, shape)] under the strategy."""
        if not sharded:
            return sum(math.prod(s) for _, s in items)
        if flat:  # one flat parameter per unit, padded to a multiple of the group size
            per_unit: dict[str, int] = {}
            for unit, s in items:
                per_unit[unit] = per_unit.get(unit, 0) + math.prod(s)
            return sum(math.ceil(n / shards) for n in per_unit.values())
        return sum(fsdp2_local(s) for _, s in items)

    # one optimizer "step" tensor per parameter (FSDP1 with use_orig_params=True, the default,
    # also hands the optimizer the original parameters, not the flat ones)
    n_trainable_tensors = len(trainable)
    train_numel = shard_numel(trainable)
    frozen_numel = shard_numel(frozen)
    # FSDP1 keeps each unit's NF4 bytes in one flat uint8 parameter (ceil(bytes / N) per rank)
    quant_local = quant_bytes if not sharded else (math.ceil(quant_bytes / shards) if flat else quant_shard)
    full_train = sum(math.prod(s) for _, s in trainable)

    # FSDP1's NO_SHARD keeps whole parameters in FSDP's flat parameters: DDP's bytes, FSDP's categories
    no_shard = strategy == "fsdp1_no_shard"
    param_cat, grad_cat = ("sharded_params", "sharded_grads") if sharded or no_shard else ("params", "grads")
    steady = dict.fromkeys(CATEGORIES, 0)
    steady[param_cat] = (train_numel + frozen_numel) * p
    steady["quantized"] = quant_local
    steady["optimizer_state"] = train_numel * (n_states * p + master_bytes)
    if optimizer != "sgd" and optimizer != "sgd_momentum" and device == "cpu":
        steady["optimizer_state"] += 4 * n_trainable_tensors  # AdamW's float32 "step" per tensor
    grads = train_numel * g
    rope = 2 * config.max_seq_len * (config.head_dim // 2) * 4
    tokens = batch_size * seq_len
    # rotary tables and the int64 labels, which the loss lets go of before its gradient (the
    # forward_end peak) is computed; the input ids count as activations until the embedding's backward
    acts = activation_bytes(config, batch_size, seq_len, compute, activation_checkpointing,
                            lora_rank if qlora else 0)
    steady["other"] = rope + acts["labels"]

    host = {}
    if cpu_offload:
        if not sharded:
            raise ValueError("cpu_offload is modelled for the sharded strategies (fsdp1_*_shard, fsdp2); "
                             "use one of those or cpu_offload=False")
        host = {param_cat: steady[param_cat], grad_cat: grads, "optimizer_state": steady["optimizer_state"]}
        steady[param_cat] = steady["optimizer_state"] = 0
        notes.append("CPU offload: sharded parameters, gradients and optimizer state live in host memory")

    loss_grad = 8 * tokens * config.vocab_size
    # AdamW's temporaries. foreach takes the square roots of every exp_avg_sq at once (one list the
    # size of the trainable shard, then divided in place). The per-parameter loop computes
    # ``denom = exp_avg_sq.sqrt() / bias_correction`` one parameter at a time: the square root, the
    # quotient and the previous parameter's ``denom`` (not yet rebound) are alive together. Local
    # sizes: FSDP2's rank 0 rows; FSDP1's original parameters are views of the flat shard, at
    # most whole
    local = [fsdp2_local(s) if sharded and not flat else math.prod(s) for _, s in trainable]
    loop_peak = max((previous + 2 * n for previous, n in zip([0] + local, local)), default=0)
    opt_temp = (train_numel if foreach else loop_peak) * max(p, 4 if master_bytes else p)
    if optimizer.startswith("sgd"):
        opt_temp = 0

    # ---- phases ----------------------------------------------------------------------------
    phases: dict[str, dict[str, int]] = {"steady": dict(steady)}
    grads_on_device = 0 if cpu_offload else grads

    def phase(**extra) -> dict[str, int]:
        out = dict(steady)
        for k, v in extra.items():
            out[k] += v
        return out

    layer_numel = max((n for u, n in units.items() if u != "root"), default=0)
    root_numel = units["root"]
    # backward starts with the output projection: its (and the final norm's) gradient exists
    # while every block's activations are still alive; later blocks free more activations
    # than their gradients add, so this is the backward peak (the optimizer phase covers the end)
    head_grad = 0 if qlora else config.vocab_size * config.dim + config.dim
    layer_grad = (full_train / max(config.n_layers, 1)) if qlora else layer_numel
    # the first gradient a block's backward makes is its last linear's (w2): no smaller than the
    # largest trainable parameter of a block for the Llama (w1, w2, w3 are one size), so that stands in
    largest_block_grad = max((math.prod(s) for u, s in trainable if u != "root"), default=0)
    # at block 0's post-backward the root's and block 0's gradients are not reduced yet: their
    # sharded parts do not exist (FSDP reduces the root last)
    unreduced_at_end = shard_numel([(u, s) for u, s in trainable if u in ("root", "layers.0")]) * g
    bwd_acts = acts["total"] - acts["loss"] + acts["recompute"]
    # when the loss gradient is computed (the forward_end moment) the loss has let go of its labels
    loss_grad_acts = acts["total"] - acts["labels"]
    emb_grad = 0 if qlora else config.vocab_size * config.dim
    # FSDP1 keeps a unit's gradient as one flat tensor, made whole at the unit's first gradient: the
    # root unit's (the embedding's part too) from the output projection's backward to the end
    root_grad = 0 if qlora else root_numel
    # block 0 at the end of backward: its activations (recomputed under checkpointing, beside its kept input)
    acts["last_block"] = acts["first_block"] + (acts["blocks"] // max(config.n_layers, 1) if activation_checkpointing else 0)
    # QLoRA: each NF4 linear dequantizes its weight into a temporary in forward and in backward
    dequant_temp = largest_quant * c
    # under checkpointing the backward phase holds a recomputed block, so its gradient temporaries too
    bwd_temp = dequant_temp + (acts["backward_transient"] if activation_checkpointing else 0)
    if not sharded:
        phases["forward_end"] = phase(activations=loss_grad_acts, temporaries=loss_grad)
        # end of backward: block 0 still (re)computed
        end_acts = dict(activations=acts["last_block"] + acts["input_ids"],
                        temporaries=acts["backward_transient"] + dequant_temp)
        if no_shard:  # the root unit's flat gradient stays unsharded until its all-reduce, at the end
            phases["backward"] = phase(activations=bwd_acts, temporaries=bwd_temp,
                                       unsharded_grads=int((root_grad + layer_grad) * g))
            phases["backward_end"] = phase(**end_acts, unsharded_grads=root_grad * g,
                                           **{grad_cat: grads - root_grad * g})
        else:  # every gradient but the embedding's at the end
            phases["backward"] = phase(activations=bwd_acts, temporaries=bwd_temp, **{grad_cat: head_grad * g})
            phases["backward_end"] = phase(**end_acts, **{grad_cat: grads - emb_grad * g})
        phases["optimizer_step"] = phase(temporaries=opt_temp, **{grad_cat: grads})
        if strategy == "ddp" and world_size > 1:
            notes.append("DDP modelled with gradients all-reduced in place; torch's DistributedDataParallel "
                         "adds gradient buckets (one more gradient copy) unless gradient_as_bucket_view=True")
    else:
        keep_unsharded = strategy == "fsdp1_shard_grad_op" or (strategy == "fsdp2" and not reshard_after_forward)
        layers_unsharded = config.n_layers * layer_numel * c if keep_unsharded else 0
        # QLoRA: the NF4 linears are gathered as packed bytes (layer_quant bytes per block,
        # copied out of the flat all-gather buffer); norms and adapters in the compute dtype.
        layer_gathered = (layer_numel - quant_numel / max(config.n_layers, 1) + layer_grad) if qlora else layer_numel
        layer_quant = quant_bytes // max(config.n_layers, 1) if qlora else 0
        unsharded_fwd = root_numel * c + (layers_unsharded if not qlora else 0)
        if qlora and keep_unsharded:
            unsharded_fwd += config.n_layers * (layer_quant + int(layer_gathered * c))
        # backward of the last block: root stays gathered, this block and the prefetched next
        # are gathered, the head's full gradient (FSDP1: the root unit's whole flat gradient) waits
        # for the root's reduce-scatter at the end of backward, and this block's full gradient and
        # its reduce-scatter input coexist once
        gathered = unsharded_fwd if keep_unsharded else root_numel * c + 2 * (int(layer_gathered * c) + layer_quant)
        # the last all-gather's flat buffer (one block) is still held when forward ends
        phases["forward_end"] = phase(activations=loss_grad_acts, temporaries=loss_grad,
                                      unsharded_params=unsharded_fwd,
                                      comm_buffers=0 if keep_unsharded else int(layer_gathered * c) + layer_quant)
        if flat:
            # FSDP1 makes a unit's flat gradient whole at its first gradient, and reduce-scatters
            # that buffer itself
            phases["backward"] = phase(activations=bwd_acts, unsharded_params=gathered,
                                       unsharded_grads=int(root_grad * g + layer_grad * g),
                                       comm_buffers=int(layer_grad * g), temporaries=bwd_temp)
        else:
            # FSDP2's gradients arrive one parameter at a time. Two moments of the last block's
            # backward compete for the peak: its start (every activation alive, one of its
            # gradients, the next block's prefetched all-gather still in its flat output buffer),
            # and its post-backward (its activations freed, its whole gradient being copied into
            # its reduce-scatter input, the block still gathered)
            prefetched = int(layer_gathered * c) + layer_quant
            gathered_here = gathered - (0 if keep_unsharded else prefetched)
            if keep_unsharded or config.n_layers < 2:  # kept gathered, or no block before to prefetch
                prefetched = 0
            start = phase(activations=bwd_acts, unsharded_params=gathered_here,
                          unsharded_grads=int((head_grad + largest_block_grad) * g),
                          comm_buffers=prefetched, temporaries=bwd_temp)
            end = phase(activations=bwd_acts - acts["recompute"] - acts["kept_per_block"],
                        unsharded_params=gathered_here,
                        unsharded_grads=int((head_grad + layer_grad) * g),
                        comm_buffers=prefetched + int(layer_grad * g), temporaries=dequant_temp)
            phases["backward"] = max(start, end, key=lambda b: sum(b.values()))
        phases["backward_end"] = phase(activations=acts["last_block"] + acts["input_ids"],
                                       unsharded_params=root_numel * c + int(layer_gathered * c) + layer_quant,
                                       unsharded_grads=int((root_grad if flat else emb_grad) * g + layer_grad * g),
                                       comm_buffers=int(layer_grad * g),
                                       temporaries=acts["backward_transient"] + dequant_temp,
                                       **{grad_cat: 0 if cpu_offload else grads - unreduced_at_end})
        phases["optimizer_step"] = phase(**{grad_cat: grads_on_device}, temporaries=0 if cpu_offload else opt_temp)
        notes.append("FSDP transients: one block and its prefetched successor gathered in backward; "
                     "the root module stays gathered between forward and backward")
    peak_phase = max((k for k in phases if k != "steady"), key=lambda k: sum(phases[k].values()))
    if activation_checkpointing:
        notes.append("activation checkpointing: each block keeps its input; one block is recomputed at a time")
    return Breakdown(bytes=dict(phases[peak_phase]), phase=peak_phase, phases=phases, host=host, notes=notes)


def deepspeed_model_states(num_params: int, world_size: int, stage: int) -> int:
    """The ZeRO paper's per-GPU model-state bytes (the stages DeepSpeed implements) for fp16
    parameters with mixed-precision AdamW (2 + 2 + 12 bytes per parameter): stage 0: 16P,
    1: 4P + 12P/N, 2: 2P + 14P/N, 3: 16P/N. DeepSpeed's own ZeRO-3 estimator adds the largest
    layer whole and counts 18P/N. Raises KeyError for a stage outside 0-3."""
    P, N = num_params, world_size
    return {0: 16 * P, 1: 4 * P + 12 * P / N, 2: 2 * P + 14 * P / N, 3: 16 * P / N}[stage]


__all__ = ["Breakdown", "estimate", "activation_bytes", "parameter_shapes", "deepspeed_model_states",
           "hybrid_shard_group_size", "STRATEGIES", "OPTIMIZERS", "count_parameters"]
