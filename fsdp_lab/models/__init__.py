"""Models and data for the labs: a small Llama with named configs, and synthetic token batches."""
from fsdp_lab.models.data import Batch, global_batch, markov_chain, shard_batch, synthetic_batch
from fsdp_lab.models.llama import (
    CONFIGS,
    Attention,
    CausalLMOutput,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    apply_activation_checkpointing,
    count_parameters,
    parameter_breakdown,
)

__all__ = [
    "CONFIGS", "Attention", "Batch", "CausalLMOutput", "FeedForward", "Llama", "LlamaConfig", "RMSNorm",
    "TransformerBlock", "apply_activation_checkpointing", "count_parameters", "global_batch",
    "markov_chain", "parameter_breakdown", "shard_batch", "synthetic_batch",
]
