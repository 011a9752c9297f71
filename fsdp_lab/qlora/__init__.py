"""QLoRA: NF4 4-bit frozen weights (``nf4``) and LoRA adapters (``lora``).

Importing the package also registers ``nf4_handle.NF4FlatParamHandle`` with FSDP1, so NF4
parameters get their own flat parameters under ``fsdp_lab.fsdp1`` (FSDP2 finds NF4's
``fsdp_*`` methods by itself).
"""

from fsdp_lab.qlora.nf4 import NF4_CODEBOOK, build_nf4_codebook, to_nf4
from fsdp_lab.qlora.nf4_tensor import NF4Tensor, nf4_linear
from fsdp_lab.qlora.lora import LoRALinear, apply_lora, lora_parameter_counts, merge_lora
from fsdp_lab.qlora.nf4_handle import NF4FlatParamHandle, ShardedNF4
from fsdp_lab.qlora.adapters import load_lora_state_dict, lora_state_dict

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
    "NF4FlatParamHandle",
    "ShardedNF4",
    "lora_state_dict",
    "load_lora_state_dict",
]
