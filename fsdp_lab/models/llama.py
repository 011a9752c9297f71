"""A small, readable Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Three optional switches give the shapes of the Llama family's close relatives: ``qkv_bias``
(Qwen2's biases on the q, k and v projections), ``qk_norm`` (Qwen3's RMSNorm over each head of q
and k before the rotary embedding) and ``explicit_head_dim`` (heads wider or narrower than
``dim / n_heads``, as Mistral-Nemo and Qwen3 have).

Module names follow Meta's Llama reference code (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1`` ...) so wrapping policies and LoRA target lists can select modules by name.
Named configs range from a CPU-sized model to the exact shapes of Llama-2-7B and Llama-3-8B
(build those on the meta device; they are for memory questions, not for CPU training).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_lab.checks import check_bool, check_positive_int
from fsdp_lab.models.hf_config import llama_fields_from_hf

INIT_STD = 0.02  # std of the normal init for every linear and embedding weight


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a Llama model. Sizes are counts (tokens, features, layers, heads)."""

    name: str = "cpu"
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352  # intermediate size of the SwiGLU feed-forward
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    explicit_head_dim: int | None = None  # None: dim // n_heads, as in Llama
    qkv_bias: bool = False  # biases on wq, wk, wv (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            check_positive_int(f"LlamaConfig.{field}", getattr(self, field))
        for flag in ("tie_embeddings", "qkv_bias", "qk_norm"):
            check_bool(f"LlamaConfig.{flag}", getattr(self, flag))
        if self.explicit_head_dim is not None:
            check_positive_int("LlamaConfig.explicit_head_dim", self.explicit_head_dim)
        elif self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                             f"choose n_heads among the divisors of dim, or set explicit_head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}) "
                             f"for grouped-query attention; choose n_kv_heads among the divisors of n_heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be positive")

    @property
    def head_dim(self) -> int:
        """Features per attention head: ``explicit_head_dim``, or ``dim // n_heads`` without it."""
        return self.explicit_head_dim if self.explicit_head_dim is not None else self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LlamaConfig":
        """The named config (see ``CONFIGS``), with optional field overrides.

        Raises ValueError for an unknown name (the message lists the known ones) or bad overrides.
        """
        if name not in CONFIGS:
            raise ValueError(f"unknown Llama config {name!r}; known configs: {', '.join(CONFIGS)}; for a Hugging "
                             f"Face model (its folder, config.json or a dict) use LlamaConfig.from_hf(...)")
        return dataclasses.replace(CONFIGS[name], **overrides)

    @classmethod
    def from_hf(cls, source, **overrides) -> "LlamaConfig":
        """The shapes of a Hugging Face Llama, Mistral, Qwen2 or Qwen3 model: ``source`` is its folder (holding
        ``config.json``), the file, a dict or a ``transformers`` config. See ``hf_config.py`` for
        what it refuses (ValueError with the reason) and raises; ``overrides`` replace fields."""
        return cls(**{**llama_fields_from_hf(source), **overrides})


CONFIGS: dict[str, LlamaConfig] = {
    "cpu": LlamaConfig(),
    "cpu-tied": LlamaConfig(name="cpu-tied", tie_embeddings=True),
    "llama2-7b": LlamaConfig(name="llama2-7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=32, ffn_hidden=11008, max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": LlamaConfig(name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, ffn_hidden=14336, max_seq_len=8192, norm_eps=1e-5,
                             rope_theta=500000.0),
}


def parameter_breakdown(config: LlamaConfig) -> dict[str, int]:
    """Parameter counts by part, computed from the config alone (no model is built).

    Keys: ``embeddings``, ``attention_per_layer``, ``feed_forward_per_layer``, ``norms_per_layer``,
    ``per_layer``, ``layers`` (all blocks), ``final_norm``, ``output`` (0 when tied to the
    embeddings) and ``total``.
    """
    d, hd = config.dim, config.head_dim
    attention = d * (config.n_heads * hd)           # wq
    attention += 2 * d * (config.n_kv_heads * hd)   # wk, wv: only the kv heads are stored
    attention += (config.n_heads * hd) * d          # wo
    if config.qkv_bias:
        attention += (config.n_heads + 2 * config.n_kv_heads) * hd
    if config.qk_norm:
        attention += 2 * hd                         # q_norm, k_norm: one weight per head feature
    feed_forward = 3 * d * config.ffn_hidden        # w1 (gate), w3 (up), w2 (down)
    norms = 2 * d                                   # attention_norm, ffn_norm
    per_layer = attention + feed_forward + norms
    parts = {
        "embeddings": config.vocab_size * d,
        "attention_per_layer": attention,
        "feed_forward_per_layer": feed_forward,
        "norms_per_layer": norms,
        "per_layer": per_layer,
        "layers": config.n_layers * per_layer,
        "final_norm": d,
        "output": 0 if config.tie_embeddings else config.vocab_size * d,
    }
    parts["total"] = parts["embeddings"] + parts["layers"] + parts["final_norm"] + parts["output"]
    return parts


def count_parameters(config: LlamaConfig) -> int:
    """Number of parameters (elements) of ``Llama(config)``, counting a tied weight once."""
    return parameter_breakdown(config)["total"]


@dataclass
class CausalLMOutput:
    """What ``Llama.forward`` returns: logits (batch, seq, vocab) and the mean loss (or None)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq_len, head_dim // 2), float32: angle = position * theta^(-2i/head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (i, i + head_dim/2) of x (batch, heads, seq, head_dim) by position angles.

    This is the "rotate half" layout; the pairing differs from Meta's interleaved one, the maths does not.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads: each kv head serves n_heads / n_kv_heads query heads."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        if config.qk_norm:  # one weight per head feature, shared by the heads (Qwen3)
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:  # kv head j serves query heads j*repeats .. (j+1)*repeats - 1
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up and w2 the down projection."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(...)).

    With ``checkpoint_activations`` set (see ``apply_activation_checkpointing``) the block keeps
    only its input for backward and recomputes the rest; parameter names do not change.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.checkpoint_activations = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama. ``Llama(config, seed=0)`` gives the same weights every time.

    Built under ``with torch.device("meta"):`` it allocates nothing and skips initialisation;
    after ``to_empty(device=...)`` call ``init_weights(seed)`` (it also refills the rotary tables).
    """

    def __init__(self, config: LlamaConfig | str = "cpu", seed: int = 0):
        super().__init__()
        self.config = LlamaConfig.from_name(config) if isinstance(config, str) else config
        cfg = self.config
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: state_dict() holds parameters only.
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, generator_device: str | torch.device = "cpu") -> "Llama":
        """Re-initialise every parameter in place from ``torch.Generator().manual_seed(seed)``.

        Norm weights get ones, biases zeros; every other parameter (linear, embedding) gets N(0, 0.02^2), drawn
        in float32 on ``generator_device`` in ``named_parameters()`` order and copied into the
        parameter's own device and dtype, so values do not depend on the global RNG or on where
        the model lives. The rotary tables are recomputed too. Tensors on the meta device are
        skipped. Under ``fsdp_lab.fsdp2.fully_shard`` (after ``to_empty``) each rank keeps its rows
        of every draw: the same values as one process, one whole parameter at a time. Returns self.
        """
        generator = torch.Generator(device=generator_device).manual_seed(seed)
        for name, param in self.named_parameters():
            if param.is_meta:
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32, device=generator_device)
                values.normal_(0.0, INIT_STD, generator=generator)
                if hasattr(param, "device_mesh"):  # an FSDP2 shard: keep this rank's rows
                    from fsdp_lab.fsdp2.state_dict import load_full_tensor

                    load_full_tensor(param, values.to(param.dtype))
                else:
                    param.copy_(values)
        if not self.rope_cos.is_meta:
            cfg = self.config
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        return self

    def blocks(self) -> list[TransformerBlock]:
        """The transformer blocks in order (found by type, so wrappers around them do not matter)."""
        return [m for m in self.modules() if isinstance(m, TransformerBlock)]

    def forward(self, input_ids, labels: torch.Tensor | None = None) -> CausalLMOutput:
        """Logits for ``input_ids`` (batch, seq) of token ids; with ``labels`` also the loss.

        ``input_ids`` may be a ``Batch`` (anything with ``.input_ids`` and ``.labels``). The loss is
        the mean cross-entropy over all label positions not equal to -100, computed in float32.
        Raises ValueError for a wrong shape/dtype or a sequence longer than ``max_seq_len``.
        """
        if hasattr(input_ids, "input_ids"):
            labels = input_ids.labels if labels is None else labels
            input_ids = input_ids.input_ids
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be a (batch, seq) int64 tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}; "
                             f"use shorter sequences or a config with a larger max_seq_len")
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return CausalLMOutput(logits=logits, loss=loss)


def apply_activation_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn activation checkpointing on (or off) for every ``TransformerBlock`` in ``model``, in place.

    Each block then runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: it saves
    only its input and recomputes its forward during backward. Parameter names are unchanged, so
    state dicts and name-based wrapping still match. Returns ``model``; raises ValueError if it
    holds no TransformerBlock.
    """
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} contains no TransformerBlock to checkpoint")
    for block in blocks:
        block.checkpoint_activations = enabled
    return model
