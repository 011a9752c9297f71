"""Measure one training step of the Llama under a strategy, to set beside ``estimate``.

``measure_step`` builds ``Llama(config)`` on this rank, applies the strategy the estimate models
(DDP with in-place all-reduce, FSDP1 wrapping every block, FSDP2 on every block and the root,
optionally QLoRA), takes a warm-up step and returns the ``MemoryTracker`` result of the second.
"""

from __future__ import annotations

import torch

from fsdp_lab.models.llama import LlamaConfig

MEASURABLE = ("ddp", "fsdp1_full_shard", "fsdp1_shard_grad_op", "fsdp1_no_shard", "fsdp2")


def measure_step(config: LlamaConfig | str, *, strategy: str, batch_size: int, seq_len: int,
                 param_dtype=torch.float32, activation_checkpointing: bool = False,
                 reshard_after_forward: bool = True, foreach: bool = False, seed: int = 0,
                 qlora: bool = False, lora_rank: int = 8):
    """Run two training steps of ``Llama(config)`` under ``strategy`` on this rank and return the
    MemoryTracker result of the second (steady state), to set beside :func:`estimate`.

    Call it inside ``fsdp_lab.launch`` or ``fsdp_lab.simulated_world`` (or alone for "ddp" with
    one process). "ddp" all-reduces gradients in place (no buckets); FSDP1 wraps every block.
    ``qlora``: NF4 base weights with LoRA adapters of ``lora_rank`` on the block linears
    (``fsdp_lab.qlora.apply_lora``), AdamW on the adapters only.
    Raises ValueError for a strategy that cannot be measured here (``MEASURABLE`` lists them).
    """
    import torch.distributed as dist

    from fsdp_lab import collectives
    from fsdp_lab.dist import current_device
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama, TransformerBlock, apply_activation_checkpointing

    if strategy not in MEASURABLE:
        raise ValueError(f"strategy {strategy!r} cannot be measured by measure_step; use one of "
                         f"{', '.join(MEASURABLE)}")
    config = LlamaConfig.from_name(config) if isinstance(config, str) else config
    device = current_device()
    model = Llama(config, seed=seed).to(device=device, dtype=param_dtype)
    if qlora:
        from fsdp_lab.qlora import apply_lora
        from fsdp_lab.qlora.lora import LLAMA_TARGETS
        torch.manual_seed(seed)
        apply_lora(model, LLAMA_TARGETS, rank=lora_rank, quantize_base=True)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    # estimate()'s param_dtype is the dtype parameters are stored (and trained) in, as in
    # PyTorch's FSDP; fsdp_lab's default policies would keep float32 masters of a bf16 model.
    own_dtype = {"main_params_dtype": None, "main_grads_dtype": None}
    if strategy == "fsdp2":
        from fsdp_lab.fsdp2 import fully_shard
        from fsdp_lab.precision import MixedPrecisionPolicy
        policy = MixedPrecisionPolicy(**own_dtype)
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif strategy.startswith("fsdp1"):
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
        from fsdp_lab.precision import MixedPrecision
        sharding = {"fsdp1_full_shard": ShardingStrategy.FULL_SHARD, "fsdp1_no_shard": ShardingStrategy.NO_SHARD,
                    "fsdp1_shard_grad_op": ShardingStrategy.SHARD_GRAD_OP}[strategy]
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                         sharding_strategy=sharding, mixed_precision=MixedPrecision(**own_dtype))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=foreach)
    vocab = config.vocab_size
    rank = dist.get_rank() if dist.is_initialized() else 0
    replicated = strategy == "ddp" and dist.is_initialized() and dist.get_world_size() > 1

    def step(i):
        batch = global_batch(vocab, batch_size, seq_len, seed=seed + rank, step=i).to(device)
        loss = model(batch).loss
        loss.backward()
        if replicated:
            for p in model.parameters():
                collectives.all_reduce(p.grad, op="avg")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(0)
    with MemoryTracker(model, optimizer) as tracker:
        step(1)
    return tracker.result()


__all__ = ["measure_step", "MEASURABLE"]
