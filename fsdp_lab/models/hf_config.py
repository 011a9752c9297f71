"""A Hugging Face ``config.json`` as ``LlamaConfig`` fields: the shapes of your own Llama-family model.

``LlamaConfig.from_hf("path/to/model")`` (a folder holding ``config.json``, the file itself, a
dict, or a ``transformers`` config object) reads the sizes that fix every parameter's shape and
the activations' sizes, so that ``estimate`` and ``fsdp-lab estimate --config`` answer "will it
fit?" for a model whose weights are not here. Only architectures whose parameters are exactly
this package's Llama are accepted: ``model_type`` llama, mistral (any ``head_dim``, as
Mistral-Nemo's), qwen2 (biases on q, k and v: ``qkv_bias``) and qwen3 (RMSNorm on each head of q
and k: ``qk_norm``), with a SiLU-gated feed-forward and no other biases. Any other would be
estimated wrongly, so it is refused with the reason. RoPE scaling and sliding-window attention
change no shape and are not carried over (a ``Llama`` built from the result attends to every
earlier position with plain RoPE).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["llama_fields_from_hf", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _as_dict(source: Any) -> tuple[dict, str]:
    """(the config's fields, a name for it)."""
    if isinstance(source, dict):
        return source, source.get("_name_or_path") or source.get("model_type", "hf")
    if hasattr(source, "to_dict"):  # a transformers PretrainedConfig
        fields = source.to_dict()
        return fields, fields.get("_name_or_path") or fields.get("model_type", "hf")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {path!r}: pass a model folder (as save_pretrained "
                                    f"writes it) or the config.json file itself")
        with open(file, encoding="utf-8") as f:
            fields = json.load(f)
        folder = os.path.dirname(os.path.abspath(file))
        return fields, os.path.basename(folder) or fields.get("model_type", "hf")
    raise TypeError(f"from_hf takes a path, a dict or a transformers config, got {type(source).__name__}")


def _refusal(fields: dict) -> str | None:
    """Why this config's parameters would not be this package's Llama's, or None."""
    model_type = fields.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not one whose parameters are this package's Llama "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    if fields.get("mlp_bias"):
        return "it has biases in its MLP layers, which this package's Llama does not"
    # Qwen2 always has q, k and v biases (its attention_bias field is not read); the others'
    # attention_bias puts a bias on the output projection too, which this Llama does not have
    if model_type != "qwen2" and fields.get("attention_bias"):
        return "it has biases in every attention projection (the output's too), which this package's Llama does not"
    if fields.get("hidden_act", "silu") != "silu":
        return f"its MLP uses {fields['hidden_act']!r}, not the SiLU-gated (SwiGLU) feed-forward"
    if model_type == "qwen3" and "head_dim" in fields and not fields["head_dim"]:
        return "its head_dim is null, which transformers refuses for Qwen3"
    head_dim = _head_dim(fields)
    if head_dim % 2:
        return f"its head_dim {head_dim} is odd, and rotary embeddings turn pairs of features"
    return None


def _head_dim(fields: dict) -> int:
    """Features per attention head as transformers reads it: ``head_dim`` when given, else
    Qwen3's default of 128, else hidden_size / heads."""
    if fields.get("head_dim"):
        return fields["head_dim"]
    if fields["model_type"] == "qwen3" and "head_dim" not in fields:
        return 128
    return fields["hidden_size"] // fields["num_attention_heads"]


def llama_fields_from_hf(source: Any) -> dict[str, Any]:
    """``LlamaConfig``'s fields for a Hugging Face Llama, Mistral, Qwen2 or Qwen3 config (see the
    module docstring).

    Raises FileNotFoundError for a path without config.json, TypeError for another kind of
    source, ValueError naming a missing size or why the architecture is not this Llama.
    """
    fields, name = _as_dict(source)
    missing = [k for k in REQUIRED if fields.get(k) is None]
    if missing and isinstance(fields.get("text_config"), dict):
        raise ValueError(f"the config has no {', '.join(missing)} at its top level, but a text_config (a "
                         f"multimodal model's language part): pass that, from_hf(config['text_config'])")
    if missing:
        raise ValueError(f"the config has no {', '.join(missing)}: is it a causal language model's config.json?")
    for key in (*REQUIRED, "num_key_value_heads", "max_position_embeddings", "head_dim"):
        value = fields.get(key)  # named as the config names them (LlamaConfig's names differ)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"the config's {key} must be a positive int, got {value!r}")
    reason = _refusal(fields)
    if reason is not None:
        raise ValueError(f"cannot estimate {name!r} as a Llama: {reason}; an estimate from these shapes "
                         f"would be wrong. For an approximation, build LlamaConfig(...) with its sizes by hand")
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    values = dict(
        name=str(name), vocab_size=fields["vocab_size"], dim=fields["hidden_size"],
        n_layers=fields["num_hidden_layers"], n_heads=fields["num_attention_heads"],
        n_kv_heads=fields.get("num_key_value_heads") or fields["num_attention_heads"],
        ffn_hidden=fields["intermediate_size"], max_seq_len=fields.get("max_position_embeddings") or 2048,
        norm_eps=fields.get("rms_norm_eps") or 1e-6,
        rope_theta=fields.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        qkv_bias=fields["model_type"] == "qwen2", qk_norm=fields["model_type"] == "qwen3")
    head_dim = _head_dim(fields)
    if head_dim * fields["num_attention_heads"] != fields["hidden_size"]:
        values["explicit_head_dim"] = head_dim
    return values
