"""Save and load the LoRA adapters alone, under FSDP1, FSDP2 or no FSDP at all.

A QLoRA checkpoint is mostly the frozen base, which the user already has; the adapters are
what training produced. ``lora_state_dict`` gathers only them, whole, under the keys PEFT
uses inside ``adapter_model.safetensors`` without its ``base_model.model.`` prefix:

    layers.0.attention.wq.lora_A.weight   (rank x in_features)   our LoRALinear.lora_a
    layers.0.attention.wq.lora_B.weight   (out_features x rank)  our LoRALinear.lora_b

Module paths are the model's own (FSDP1's ``_fsdp_wrapped_module.`` removed), so a state dict
saved under one FSDP (or world size) loads under another. Under FSDP1 the trainable flat
parameters are gathered one at a time (never the NF4 bytes); under FSDP2 each adapter
DTensor is all-gathered; loading copies each rank's part and communicates nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_lab.fsdp1.runtime import clean_name, units_in
from fsdp_lab.fsdp1.state_dict import load_full_state_dict as _fsdp1_load_full
from fsdp_lab.fsdp2.state_dict import full_tensor, load_full_tensor
from fsdp_lab.qlora.lora import LoRALinear

__all__ = ["lora_state_dict", "load_lora_state_dict"]

_PEFT_NAMES = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}


def _adapters(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """PEFT key -> (LoRALinear, attribute) for every adapter of ``model``."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for attr, peft in _PEFT_NAMES.items():
                out[f"{clean_name(name)}.{peft}" if name else peft] = (module, attr)
    if not out:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; add them with fsdp_lab.qlora.apply_lora")
    return out


def lora_state_dict(model: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The LoRA adapters of ``model`` as whole float tensors on CPU, by PEFT key (see above).

    Works on a plain model, under ``fsdp_lab.fsdp1.FullyShardedDataParallel`` and under
    ``fsdp_lab.fsdp2.fully_shard``; sharded models all-gather, so every rank must call it.
    ``rank0_only``: the other ranks get ``{}``. Raises ValueError when the model has no adapters.
    """
    adapters = _adapters(model)
    key_of = {id(getattr(module, attr)): key for key, (module, attr) in adapters.items()}
    out: dict[str, torch.Tensor] = {}
    for unit in units_in(model):  # FSDP1: whole only the flat parameters holding adapters
        for handle in unit._handles:
            keys = [key_of.get(id(info.param)) for info in handle.infos]
            if not any(keys):
                continue
            with handle.full_params(writeback=False, offload_to_cpu=False, with_grads=False, materialize=True):
                for key, info in zip(keys, handle.infos):
                    if key is not None:
                        out[key] = info.param.detach().cpu().clone()
    for key, (module, attr) in adapters.items():  # FSDP2 DTensors, plain parameters
        if key not in out:
            out[key] = full_tensor(getattr(module, attr)).detach().cpu().clone()
    if rank0_only and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return {}
    return dict(sorted(out.items()))


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *, strict: bool = True
                         ) -> tuple[list[str], list[str]]:
    """Copy adapters saved by ``lora_state_dict`` (or PEFT's, minus ``base_model.model.``) into ``model``.

    Any world size and either FSDP on either side; each rank copies its own part, no
    collectives. Returns ``(missing, unexpected)`` keys. Raises KeyError under ``strict``
    when they are not both empty, ValueError for a shape mismatch (e.g. another LoRA rank).
    """
    adapters = _adapters(model)
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    missing = [k for k in adapters if k not in state]
    unexpected = [k for k in state if k not in adapters]
    if strict and (missing or unexpected):
        raise KeyError(f"LoRA state dict mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}; "
                       "was it saved from a model with the same target modules?")
    fsdp1: dict[str, torch.Tensor] = {}
    for key, (module, attr) in adapters.items():
        if key not in state:
            continue
        target, source = getattr(module, attr), state[key]
        shape = (module.rank, module.in_features) if attr == "lora_a" else (module.out_features, module.rank)
        if tuple(source.shape) != shape:  # (FSDP1 parameters are 1-D shards between passes)
            raise ValueError(f"{key}: saved shape {tuple(source.shape)}, the model's {shape} "
                             f"(LoRA rank {module.rank}); load adapters of the same rank and targets")
        if units_in(model):
            fsdp1[key.removesuffix(_PEFT_NAMES[attr]) + attr] = source
        else:
            load_full_tensor(target, source)
    if fsdp1:
        _fsdp1_load_full(model, fsdp1, strict=False)
    return missing, unexpected
