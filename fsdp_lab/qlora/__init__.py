"""QLoRA: NF4 4-bit frozen weights (``nf4``) and LoRA adapters (``lora``)."""

from fsdp_lab.qlora.nf4 import NF4_CODEBOOK, build_nf4_codebook, to_nf4
from fsdp_lab.qlora.nf4_tensor import NF4Tensor, nf4_linear
from fsdp_lab.qlora.lora import LoRALinear, apply_lora, lora_parameter_counts, merge_lora

__all__ = [
    "NF4_CODEBOOK",
    "build_nf4_codebook",
    "to_nf4",
    "NF4Tensor",
    "nf4_linear",
    "LoRALinear",
    "apply_lora",
    "lora_parameter_counts",
    "merge_lora",
]
