"""LoRA adapters on frozen (optionally NF4-quantized) linear layers: QLoRA.

A ``LoRALinear`` computes ``y = x W^T + b + dropout(x) A^T B^T * (alpha / rank)`` with W
and b frozen and only A (rank x in) and B (out x rank) trained. B starts at zero, so a
model is unchanged by wrapping. ``apply_lora`` wraps a model's projections in place (and
quantizes their weights to NF4 for QLoRA), ``merge_lora`` folds the adapters back into
plain ``nn.Linear`` layers for export.

The frozen weight stays a parameter named ``weight`` (and ``bias``) on the wrapper, so
FSDP shards it like any frozen parameter; the adapters are the parameters ``lora_a`` and
``lora_b`` of the same module.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.checks import check_bool, check_positive_int
from fsdp_lab.qlora.nf4 import to_nf4
from fsdp_lab.qlora.nf4_tensor import NF4Tensor

LLAMA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
# Hugging Face transformers' names for the same layers (Llama, Mistral, Qwen2, ...).
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = LLAMA_TARGETS + HF_TARGETS


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update.

    ``base``: an ``nn.Linear`` or any module whose ``weight`` is a 2-D (out x in) tensor,
    e.g. an ``NF4Tensor`` parameter; its ``weight`` and ``bias`` are reused and frozen.
    ``lora_a`` is initialised like PEFT (Kaiming-uniform, a=sqrt(5)), ``lora_b`` to zero;
    both take the weight's dtype and device. Scaling is ``alpha / rank``.
    Raises ValueError for rank <= 0 or dropout outside [0, 1), TypeError for a base
    without a 2-D weight.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"LoRALinear needs a module with a 2-D weight (out x in), got {type(base).__name__}")
        check_positive_int("LoRA rank", rank)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.out_features, self.in_features = weight.shape
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.weight = _frozen(weight)
        bias = getattr(base, "bias", None)
        self.bias = _frozen(bias) if bias is not None else None
        factory = {"dtype": weight.dtype, "device": weight.device}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, NF4Tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # NF4 weights dequantize inside F.linear
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return base + update * self.scaling

    def merged_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W + B A * scaling as a plain tensor (computed in float32, returned in ``dtype``)."""
        base = self.weight.dequantize(torch.float32) if self.quantized else self.weight.detach().float()
        update = self.lora_b.detach().float() @ self.lora_a.detach().float()
        return (base + update * self.scaling).to(dtype)

    def extra_repr(self) -> str:
        kind = "nf4" if self.quantized else str(self.weight.dtype).replace("torch.", "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha}, base={kind}, bias={self.bias is not None}")


def _frozen(param: torch.Tensor) -> nn.Parameter:
    """The same parameter with requires_grad off (wrapped in nn.Parameter if it was not one)."""
    if isinstance(param, nn.Parameter):
        return param.requires_grad_(False)
    return nn.Parameter(param.detach(), requires_grad=False)


ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer


def names_a_target(name: str, targets: Sequence[str]) -> bool:
    """Whether the module called ``name`` is picked by ``target_modules=targets`` given as a list:
    the name is one of them or ends with ``"." + target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that makes the logits: Hugging Face's ``get_output_embeddings()``, else a child
    named ``output`` (this package's Llama) or ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    found = getter() if callable(getter) else None
    return found if isinstance(found, nn.Module) else getattr(model, "output", None) or getattr(model, "lm_head", None)


def _targeted(model: nn.Module, target_modules: Sequence[str] | str) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module ``target_modules`` names (see ``apply_lora``)."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if target_modules == ALL_LINEAR:
        output = _output_layer(model)
        return [(n, m) for n, m in named if isinstance(m, nn.Linear) and m is not output]
    if isinstance(target_modules, str):  # as PEFT: a regular expression for the whole name (or a suffix)
        try:
            pattern = re.compile(target_modules)
        except re.error:
            pattern = None
        return [(n, m) for n, m in named if (pattern is not None and pattern.fullmatch(n))
                or names_a_target(n, (target_modules,))]
    return [(n, m) for n, m in named if names_a_target(n, target_modules)]


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def apply_lora(
    model: nn.Module,
    target_modules: Sequence[str] | str = DEFAULT_TARGETS,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    quantize_base: bool = True,
    block_size: int = 64,
    double_quant: bool = True,
) -> nn.Module:
    """Wrap the linear layers whose name ends with one of ``target_modules`` in ``LoRALinear``.

    In place; returns ``model``. A module matches when its qualified name equals a target
    or ends with ``"." + target`` (``layers.0.attention.wq`` matches ``"wq"``). As in PEFT, one
    string instead of a list is also a regular expression the whole name must match
    (``r".*\\.(wq|wv)"``), and ``"all-linear"`` takes every ``nn.Linear`` but the output
    layer. The default targets are this package's Llama names (``wq``...``w3``) and Hugging Face's
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``). With
    ``quantize_base`` their weights become ``NF4Tensor`` parameters (QLoRA). Afterwards
    only ``lora_a``/``lora_b`` parameters require grad; everything else is frozen.
    Raises ValueError for rank <= 0, when nothing matches (the message lists the linear
    layers there are) or when a layer already has adapters; TypeError when a matched
    module is not an ``nn.Linear`` or ``quantize_base``/``double_quant`` is not a bool.
    """
    check_positive_int("LoRA rank", rank)
    check_bool("quantize_base", quantize_base)
    check_bool("double_quant", double_quant)
    matched = _targeted(model, target_modules)
    if not matched:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        shown = ", ".join(linears[:30]) + (" ..." if len(linears) > 30 else "")
        given = repr(target_modules) if isinstance(target_modules, str) else list(target_modules)
        raise ValueError(
            f"no module matched target_modules={given}; linear layers in the model: "
            f"{shown or '(none)'}. Pass name suffixes from that list."
        )
    for name, module in matched:
        if isinstance(module, LoRALinear):
            raise ValueError(f"{name} already has LoRA adapters; apply_lora once per model")
        if not isinstance(module, nn.Linear):
            raise TypeError(
                f"{name} matched target_modules but is a {type(module).__name__}, not nn.Linear; "
                f"pass target_modules naming only linear layers")
    for name, module in matched:
        if quantize_base:
            nf4 = to_nf4(module.weight.detach(), block_size=block_size, double_quant=double_quant)
            module.weight = nn.Parameter(nf4, requires_grad=False)
        _set_submodule(model, name, LoRALinear(module, rank, alpha, dropout))
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            param.requires_grad_(isinstance(module, LoRALinear) and pname in ("lora_a", "lora_b"))
    return model


class LoRAParameterCounts(NamedTuple):
    """Parameter counts (elements, NF4 weights counted by their nominal numel)."""

    trainable: int
    total: int

    @property
    def trainable_fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0


def lora_parameter_counts(model: nn.Module) -> LoRAParameterCounts:
    """How many parameter elements train (requires_grad) vs how many there are in all."""
    params = list(model.parameters())
    return LoRAParameterCounts(
        trainable=sum(p.numel() for p in params if p.requires_grad),
        total=sum(p.numel() for p in params),
    )


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every ``LoRALinear`` by a plain ``nn.Linear`` with W + B A * scaling.

    For export: NF4 weights are dequantized (float32 arithmetic, stored in the weight's
    nominal dtype); the merged layers have requires_grad on like any new ``nn.Linear``.
    In place; returns ``model`` (or the new ``nn.Linear`` if ``model`` itself is a ``LoRALinear``).
    """

    def merged(lora: LoRALinear) -> nn.Linear:
        dtype, device = lora.weight.dtype, lora.weight.device
        linear = nn.Linear(lora.in_features, lora.out_features, bias=lora.bias is not None,
                           dtype=dtype, device=device)
        with torch.no_grad():
            linear.weight.copy_(lora.merged_weight(dtype))
            if lora.bias is not None:
                linear.bias.copy_(lora.bias)
        return linear

    if isinstance(model, LoRALinear):
        return merged(model)
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        _set_submodule(model, name, merged(module))
    return model
