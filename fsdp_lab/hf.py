"""Hugging Face interop: save QLoRA models with ``save_pretrained`` and export adapters for PEFT.

Works on an unsharded model (one process, or after gathering the full parameters): each
``LoRALinear`` holds a frozen base weight (plain or ``NF4Tensor``) and ``lora_a``
(rank x in) / ``lora_b`` (out x rank), the same shapes as PEFT's ``lora_A.weight`` /
``lora_B.weight``, with the same scaling ``alpha / rank``.

* ``plain_state_dict(model)``: the model's state dict with every NF4 weight dequantized to
  its nominal dtype, which safetensors can store.
* ``save_pretrained(model, directory)``: ``model.save_pretrained`` with that state dict.
* ``export_peft_adapters(model, directory)``: ``adapter_config.json`` +
  ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads onto the plain
  base model (keys ``base_model.model.<module>.lora_A.weight``, PEFT's own layout).

``transformers``, ``peft`` and ``safetensors`` come with the ``lab`` extra; this module
imports them only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.qlora.lora import LoRALinear
from fsdp_lab.qlora.nf4_tensor import is_nf4_shard, plain_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _check_unsharded(model: nn.Module, what: str) -> None:
    for name, param in model.named_parameters():
        if is_nf4_shard(param):
            raise ValueError(
                f"{what} needs the full model, but {name} is an NF4 shard; call it on the unsharded "
                f"model (one process, or after gathering the full parameters)")
        if type(param).__name__ == "DTensor" or getattr(param, "_is_flat_param", False):
            raise ValueError(
                f"{what} needs the full model, but {name} is sharded ({type(param).__name__}); call it "
                f"on the unsharded model (one process, or after gathering the full parameters)")


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each NF4 weight dequantized to its nominal dtype (a copy).

    Plain tensors are returned as they are (not copied). Raises ValueError on a sharded
    model, naming the parameter.
    """
    _check_unsharded(model, "plain_state_dict")
    return {k: plain_tensor(v) for k, v in model.state_dict().items()}


def save_pretrained(model: nn.Module, directory: str | os.PathLike, adapters: bool = True, **kwargs: Any) -> None:
    """``model.save_pretrained(directory, state_dict=plain_state_dict(model), **kwargs)``.

    ``adapters=False`` leaves the LoRA weights out: the files then hold exactly the plain
    model's keys, for ``from_pretrained`` + ``peft.PeftModel.from_pretrained``.

    For a Hugging Face model whose linear layers were quantized by ``apply_lora``: the NF4
    base weights are written dequantized (safetensors stores plain dtypes only). Adapters,
    if any, are written under their own keys (``...q_proj.lora_a``); to load into a plain
    model, ``merge_lora`` first or export them with ``export_peft_adapters``.
    Raises TypeError when ``model`` has no ``save_pretrained`` (not a transformers model).
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers PreTrainedModel, got {type(model).__name__}")
    state = plain_state_dict(model)
    if not adapters:
        lora = {f"{name}.{p}" for name in lora_modules(model) for p in ("lora_a", "lora_b")}
        state = {k: v for k, v in state.items() if k not in lora}
    model.save_pretrained(directory, state_dict=state, **kwargs)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every ``LoRALinear`` in ``model`` by qualified name (in module order)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def peft_adapter_state_dict(model: nn.Module, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """The LoRA weights under PEFT's keys: ``<prefix><module>.lora_A.weight`` / ``.lora_B.weight``.

    Tensors are detached, contiguous copies on CPU. Raises ValueError when the model has no
    ``LoRALinear`` (run ``apply_lora`` first) or is sharded.
    """
    _check_unsharded(model, "peft_adapter_state_dict")
    loras = lora_modules(model)
    if not loras:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; call fsdp_lab.qlora.apply_lora first")
    out = {}
    for name, lora in loras.items():
        out[f"{prefix}{name}.lora_A.weight"] = lora.lora_a.detach().to("cpu").contiguous().clone()
        out[f"{prefix}{name}.lora_B.weight"] = lora.lora_b.detach().to("cpu").contiguous().clone()
    return out


def peft_adapter_config(model: nn.Module, base_model_name_or_path: str | None = None,
                        task_type: str = "CAUSAL_LM") -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for the adapters in ``model`` (one rank and alpha for all).

    ``target_modules`` are the last name parts of the adapted layers (``q_proj``, ...).
    Raises ValueError when there are no adapters, when layers differ in rank or alpha (PEFT's
    ``rank_pattern`` is not written), or when they use dropout different from each other.
    """
    loras = lora_modules(model)
    if not loras:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; call fsdp_lab.qlora.apply_lora first")
    ranks = {(m.rank, m.alpha) for m in loras.values()}
    if len(ranks) != 1:
        raise ValueError(f"export needs one rank and alpha for all adapters, found (rank, alpha) = {sorted(ranks)}")
    dropouts = {getattr(m.dropout, "p", 0.0) for m in loras.values()}
    if len(dropouts) != 1:
        raise ValueError(f"export needs one dropout for all adapters, found {sorted(dropouts)}")
    (rank, alpha), = ranks
    targets = sorted({name.rpartition(".")[2] for name in loras})
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropouts.pop(),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft_adapters(model: nn.Module, directory: str | os.PathLike,
                         base_model_name_or_path: str | None = None, task_type: str = "CAUSAL_LM") -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``directory``.

    ``peft.PeftModel.from_pretrained(plain_model, directory)`` then computes what ``model``
    computes, with ``plain_model`` holding the base weights (for a QLoRA model: the
    dequantized NF4 weights, e.g. a model loaded from ``save_pretrained`` above).
    Raises ValueError as ``peft_adapter_config`` / ``peft_adapter_state_dict`` do.
    """
    from safetensors.torch import save_file

    config = peft_adapter_config(model, base_model_name_or_path, task_type)
    tensors = peft_adapter_state_dict(model)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})


__all__ = ["plain_state_dict", "save_pretrained", "lora_modules", "peft_adapter_state_dict",
           "peft_adapter_config", "export_peft_adapters"]
