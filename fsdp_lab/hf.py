"""Hugging Face interop: save QLoRA models with ``save_pretrained`` and export adapters for PEFT.

Works on an unsharded model (one process, or after gathering the full parameters): each
``LoRALinear`` holds a frozen base weight (plain or ``NF4Tensor``) and ``lora_a``
(rank x in) / ``lora_b`` (out x rank), the same shapes as PEFT's ``lora_A.weight`` /
``lora_B.weight``, with the same scaling ``alpha / rank``.

* ``plain_state_dict(model)``: the model's state dict with every NF4 weight dequantized to
  its nominal dtype, which safetensors can store.
* ``save_pretrained(model, directory)``: ``model.save_pretrained`` with that state dict;
  with ``nf4="packed"`` the NF4 weights are written as their own bytes instead (codes and
  scales as plain uint8/int8/float32 tensors, the QLoRA settings in ``qlora_config.json``),
  and ``from_pretrained(directory)`` rebuilds the QLoRA model from them bit for bit.
* ``export_peft_adapters(model, directory)``: ``adapter_config.json`` +
  ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads onto the plain
  base model (keys ``base_model.model.<module>.lora_A.weight``, PEFT's own layout).

``transformers``, ``peft`` and ``safetensors`` come with the ``lab`` extra; this module
imports them only inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.fsdp1.runtime import clean_name, owner_of
from fsdp_lab.qlora.lora import LoRALinear, apply_lora, names_a_target
from fsdp_lab.qlora.nf4_tensor import is_nf4_shard, nf4_from_parts, nf4_parts, plain_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
QLORA_CONFIG = "qlora_config.json"
# an NF4 weight ``k`` is written as ``k`` (its packed codes) and ``k.nf4_<inner>`` for the rest
_NF4_SUFFIX = ".nf4_"


def _part_key(key: str, inner: str) -> str:
    """The safetensors key of one inner tensor of the NF4 weight ``key``."""
    return key if inner == "packed" else f"{key}{_NF4_SUFFIX}{inner}"


_GATHER_FIRST = ("call it on the unsharded model: in one process (gather the adapters with "
                 "fsdp_lab.qlora.lora_state_dict(model) on every rank and load them into a one-process "
                 "model with load_lora_state_dict), or under FSDP1 inside FSDP.summon_full_params(model)")


def _check_unsharded(model: nn.Module, what: str) -> None:
    for name, param in model.named_parameters():
        if is_nf4_shard(param):
            raise ValueError(f"{what} needs the full model, but {name} is an NF4 shard; {_GATHER_FIRST}")
        if type(param).__name__ == "DTensor" or getattr(param, "_is_flat_param", False):
            raise ValueError(f"{what} needs the full model, but {name} is sharded "
                             f"({type(param).__name__}); {_GATHER_FIRST}")
        unit = owner_of(param)  # FSDP1's original parameters are 1-D slices outside summon_full_params
        if unit is not None and not unit._summoned_whole:
            raise ValueError(f"{what} needs the full model, but {clean_name(name)} is sharded by FSDP1 "
                             f"(this rank holds a 1-D slice of it); {_GATHER_FIRST}")


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each NF4 weight dequantized to its nominal dtype (a copy).

    Plain tensors are returned as they are (not copied). Raises ValueError on a sharded
    model, naming the parameter.
    """
    _check_unsharded(model, "plain_state_dict")
    return {k: plain_tensor(v) for k, v in model.state_dict().items()}


def save_pretrained(model: nn.Module, directory: str | os.PathLike, adapters: bool = True,
                    nf4: str = "dequantize", **kwargs: Any) -> None:
    """``model.save_pretrained(directory, state_dict=..., **kwargs)`` for a QLoRA model.

    ``nf4="dequantize"`` (default): each NF4 base weight is written dequantized to its
    nominal dtype, so the files hold exactly the plain model's keys (``adapters=False``
    leaves the LoRA weights out) for transformers' ``from_pretrained`` +
    ``peft.PeftModel.from_pretrained``; adapters, if kept, are under this package's own keys
    (``...q_proj.lora_a``), which transformers' loader reports as unexpected and skips and PEFT
    does not read: for transformers and PEFT, save with ``adapters=False`` and write the adapters
    with ``export_peft_adapters``.

    ``nf4="packed"``: each NF4 weight ``k`` is written as its own bytes, ``k`` holding the
    packed 4-bit codes (uint8) and ``k.nf4_scales`` / ``k.nf4_scale_factors`` /
    ``k.nf4_scale_mean`` the rest, about a quarter of the bf16 size; ``qlora_config.json``
    records the LoRA and NF4 settings. Only ``fsdp_lab.hf.from_pretrained`` reads this back
    (transformers' own loader refuses the codes' shape). Adapters are always kept.

    Raises TypeError when ``model`` has no ``save_pretrained`` (not a transformers model),
    ValueError for a sharded model, an unknown ``nf4``, ``nf4="packed"`` with
    ``adapters=False``, or (packed) a model whose adapters differ in rank, alpha or NF4 settings.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers PreTrainedModel, got {type(model).__name__}")
    if nf4 not in ("dequantize", "packed"):
        raise ValueError(f"nf4 must be 'dequantize' or 'packed', got {nf4!r}")
    if nf4 == "packed":
        if not adapters:
            raise ValueError("nf4='packed' writes a QLoRA model whole, adapters included; for the base "
                             "weights alone use nf4='dequantize', adapters=False")
        state, settings = _packed_state_dict(model)
        model.save_pretrained(directory, state_dict=state, **kwargs)
        with open(os.path.join(directory, QLORA_CONFIG), "w") as f:
            json.dump(settings, f, indent=2)
        return
    state = plain_state_dict(model)
    if not adapters:
        lora = {f"{name}.{p}" for name in lora_modules(model) for p in ("lora_a", "lora_b")}
        state = {k: v for k, v in state.items() if k not in lora}
    model.save_pretrained(directory, state_dict=state, **kwargs)


def _packed_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict with each NF4 weight split into plain tensors, and the QLoRA settings."""
    _check_unsharded(model, "save_pretrained(nf4='packed')")
    settings = peft_adapter_config(model)
    nf4_settings = set()
    state = {}
    for key, value in model.state_dict().items():
        parts = nf4_parts(value)
        if parts is None:
            state[key] = value
            continue
        nf4_settings.add((value.block_size, value.scaler_block_size, value.double_quant))
        state.update({_part_key(key, inner): tensor for inner, tensor in parts.items()})
    if len(nf4_settings) > 1:
        raise ValueError(f"nf4='packed' needs one NF4 setting for all weights, found "
                         f"(block_size, scaler_block_size, double_quant) = {sorted(nf4_settings)}")
    quantized = bool(nf4_settings)
    block_size, scaler_block_size, double_quant = nf4_settings.pop() if quantized else (64, 256, True)
    qlora = {"target_modules": settings["target_modules"], "rank": settings["r"],
             "alpha": settings["lora_alpha"], "dropout": settings["lora_dropout"],
             "quantize_base": quantized, "block_size": block_size,
             "scaler_block_size": scaler_block_size, "double_quant": double_quant}
    return state, qlora


def from_pretrained(directory: str | os.PathLike, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load a QLoRA model written by ``save_pretrained(model, directory, nf4="packed")``.

    Builds the model from ``directory``'s config (``model_class``, default
    ``transformers.AutoModelForCausalLM``; ``kwargs`` go to its ``from_config``, e.g.
    ``attn_implementation``), adds the adapters with the saved settings, and copies every
    tensor in: NF4 weights, adapters and the rest come back bit for bit. The float model is
    built once before quantization, so it must fit in CPU memory.
    Raises FileNotFoundError when ``directory`` is not a folder or has no ``qlora_config.json``
    (not written with ``nf4="packed"``: use transformers' ``from_pretrained``), ValueError when
    the files and the model built from the config disagree (the message names the keys).
    """
    import transformers
    from safetensors.torch import load_file

    directory = pathlib.Path(directory)
    settings_file = directory / QLORA_CONFIG
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory: pass the folder that "
                                "fsdp_lab.hf.save_pretrained(model, folder, nf4='packed') wrote")
    if not settings_file.exists():
        raise FileNotFoundError(
            f"{settings_file} not found: {directory} was not written by fsdp_lab.hf.save_pretrained(..., "
            f"nf4='packed'); load its base weights with transformers' from_pretrained, and adapters "
            f"that export_peft_adapters wrote with peft.PeftModel.from_pretrained")
    settings = json.loads(settings_file.read_text(encoding="utf-8"))
    config = transformers.AutoConfig.from_pretrained(directory)
    model = (model_class or transformers.AutoModelForCausalLM).from_config(config, **kwargs)
    apply_lora(model, settings["target_modules"], rank=settings["rank"], alpha=settings["alpha"],
               dropout=settings["dropout"], quantize_base=settings["quantize_base"],
               block_size=settings["block_size"], double_quant=settings["double_quant"])
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    saved: dict[str, torch.Tensor] = {}
    for file in files:
        saved.update(load_file(file))
    state = _rebuild_nf4_weights(model, saved)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_keys(model, set(state))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"{directory} does not match the model built from its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    return model.eval()


def _rebuild_nf4_weights(model: nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` with each NF4 weight's pieces joined into an NF4Tensor shaped as the model's."""
    state = {k: v for k, v in saved.items() if _NF4_SUFFIX not in k}
    for key, current in model.state_dict().items():
        names = nf4_parts(current)
        if names is None:
            continue
        keys = {inner: _part_key(key, inner) for inner in names}
        absent = [k for k in keys.values() if k not in saved]
        if absent:
            raise ValueError(f"NF4 weight {key} is incomplete in the checkpoint: {absent} missing")
        try:
            state[key] = nf4_from_parts({inner: saved[k] for inner, k in keys.items()}, current)
        except ValueError as error:
            raise ValueError(f"{key}: the checkpoint does not fit the model built from the config: {error}") from error
    return state


def _tied_keys(model: nn.Module, loaded: set[str]) -> set[str]:
    """Keys of parameters that are the same object as a loaded key's (tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {n for names in by_id.values() if any(k in loaded for k in names) for n in names}


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
        name = clean_name(name)  # inside FSDP1's summon_full_params, the names a plain model has
        out[f"{prefix}{name}.lora_A.weight"] = lora.lora_a.detach().to("cpu").contiguous().clone()
        out[f"{prefix}{name}.lora_B.weight"] = lora.lora_b.detach().to("cpu").contiguous().clone()
    return out


def peft_adapter_config(model: nn.Module, base_model_name_or_path: str | None = None,
                        task_type: str = "CAUSAL_LM") -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for the adapters in ``model`` (one rank and alpha for all).

    ``target_modules`` are the last name parts of the adapted layers (``q_proj``, ...) when those
    pick exactly the adapted layers, else their full names (adapters on some layers only).
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
    if {n for n, _ in model.named_modules() if names_a_target(n, targets)} != set(loras):
        targets = sorted(clean_name(n) for n in loras)  # PEFT and apply_lora match a full name exactly
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


__all__ = ["plain_state_dict", "save_pretrained", "from_pretrained", "lora_modules", "peft_adapter_state_dict",
           "peft_adapter_config", "export_peft_adapters"]
