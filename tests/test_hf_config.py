"""``LlamaConfig.from_hf`` and ``fsdp-lab estimate --config``: your own model's shapes from its config.json.

The reference is independent of the code under test: ``transformers`` builds the same model on
the meta device (no memory), and its parameter count and shapes must be ours; with its weights
copied into ours, its logits must be ours; Llama-2-7B's, Qwen2.5-7B's and Qwen3-0.6B's counts are
the published ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_lab.memory.estimate import estimate
from fsdp_lab.models import Llama, LlamaConfig, count_parameters

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)


def _hf_parameter_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied weight once, as count_parameters


def _hf_config(family: str, **fields):
    """A small config of ``family``; "mistral-nemo" is Mistral with heads wider than hidden/heads."""
    if family == "mistral-nemo":
        return transformers.MistralConfig(**SMALL, head_dim=24, **fields)
    if family == "qwen3":  # Qwen3's heads are set apart from hidden_size too
        return transformers.Qwen3Config(**SMALL, head_dim=12, **fields)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family]
    return cls(**SMALL, **fields)


FAMILIES = [("llama", False), ("llama", True), ("mistral", False), ("mistral-nemo", False),
            ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_small_configs_give_the_transformers_models_shapes(family, tied):
    hf = _hf_config(family, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    config = LlamaConfig.from_hf(hf)
    assert count_parameters(config) == _hf_parameter_count(hf)
    with torch.device("meta"):
        ours, theirs = Llama(config), transformers.AutoModelForCausalLM.from_config(hf)
    our_shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert our_shapes == sorted(tuple(p.shape) for p in theirs.parameters())
    assert (config.n_kv_heads, config.norm_eps, config.max_seq_len, config.tie_embeddings) == (2, 1e-5, 64, tied)
    assert (config.qkv_bias, config.qk_norm) == (family == "qwen2", family == "qwen3")
    assert config.explicit_head_dim == {"mistral-nemo": 24, "qwen3": 12}.get(family)


# transformers' names -> this package's (after "model." for the decoder's own parameters)
HF_NAMES = {"embed_tokens": "tok_embeddings", "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
            "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
            "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
            "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"}


def _our_name(hf_name: str) -> str:
    if hf_name.startswith("lm_head."):
        return "output." + hf_name.removeprefix("lm_head.")
    name = hf_name.removeprefix("model.")
    for theirs, ours in HF_NAMES.items():
        name = name.replace(theirs + ".", ours + ".")
    return name


@pytest.mark.parametrize("family,tied", FAMILIES)
def test_a_model_built_from_the_config_computes_what_transformers_computes(family, tied):
    """Every weight random (biases and norm weights too), copied by name: same logits in float32."""
    hf = _hf_config(family, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(hf).eval()
    ours = Llama(LlamaConfig.from_hf(hf)).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        state = {_our_name(k): v for k, v in theirs.state_dict().items()}
        missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and (missing == [] or (tied and missing == ["output.weight"]))
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids).logits
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("make,published", [
    # Qwen2.5-7B: untied, q/k/v biases; its model card's 7.61B is this sum of its weights' sizes
    (lambda: transformers.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                      num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                      tie_word_embeddings=False), 7_615_616_512),
    # Qwen3-0.6B: tied, head_dim 128 beside 1024 / 16 heads; its card: 0.6B, 0.44B without embeddings
    (lambda: transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                      num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128, tie_word_embeddings=True), 596_049_920),
])
def test_published_qwen_configs_have_the_published_sizes(make, published):
    config = LlamaConfig.from_hf(make())
    assert count_parameters(config) == published
    if config.tie_embeddings:
        assert round((published - config.vocab_size * config.dim) / 1e9, 2) == 0.44
    else:
        assert round(published / 1e9, 2) == 7.62  # the card rounds 7.6156 down to 7.61


def test_llama2_7b_config_folder_is_the_published_model(tmp_path):
    transformers.LlamaConfig(max_position_embeddings=4096).save_pretrained(tmp_path / "llama-2-7b")
    config = LlamaConfig.from_hf(tmp_path / "llama-2-7b")
    assert config.name == "llama-2-7b"
    assert count_parameters(config) == 6_738_415_616
    named = LlamaConfig.from_name("llama2-7b")
    shape = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "tie_embeddings")
    assert [getattr(config, f) for f in shape] == [getattr(named, f) for f in shape]
    # the file itself, and an older config.json with rope_theta at the top level, read the same
    old = json.loads((tmp_path / "llama-2-7b" / "config.json").read_text())
    old.pop("rope_parameters")
    old["rope_theta"] = 500000.0
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert LlamaConfig.from_hf(tmp_path / "old.json").rope_theta == 500000.0
    assert LlamaConfig.from_hf(tmp_path / "llama-2-7b" / "config.json").rope_theta == 10000.0


def test_cli_estimates_a_config_folder_like_the_named_model(tmp_path, capsys):
    from fsdp_lab import cli

    transformers.LlamaConfig(max_position_embeddings=4096).save_pretrained(tmp_path / "my-llama")
    cli.main(f"estimate --config {tmp_path / 'my-llama'} --world-size 8 --unit GB".split())
    out = capsys.readouterr().out
    assert out.startswith("my-llama (6.74 B parameters), fsdp2, world size 8")
    named = estimate("llama2-7b", world_size=8, strategy="fsdp2", param_dtype=torch.bfloat16,
                     batch_size=1, seq_len=4096)
    assert f"{named.model_states / 1e9:.3f} GB" in out


def test_a_qwen3_config_without_head_dim_has_transformers_default_of_128():
    fields = transformers.Qwen3Config(**SMALL).to_dict()
    fields.pop("head_dim")
    config = LlamaConfig.from_hf(fields)
    assert config.head_dim == 128
    assert count_parameters(config) == _hf_parameter_count(transformers.Qwen3Config(**SMALL))
    with pytest.raises(ValueError, match="head_dim is null"):
        LlamaConfig.from_hf({**fields, "head_dim": None})


@pytest.mark.parametrize("change,words", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not one whose parameters are this package's Llama"),
    ({"attention_bias": True}, "biases in every attention projection (the output's too)"),
    ({"mlp_bias": True}, "biases in its MLP layers"),
    ({"hidden_act": "gelu"}, "uses 'gelu', not the SiLU-gated"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"intermediate_size": None}, "the config has no intermediate_size"),
    ({"num_hidden_layers": "32"}, "the config's num_hidden_layers must be a positive int, got '32'"),
    ({"num_key_value_heads": 0}, "the config's num_key_value_heads must be a positive int, got 0"),
    ({"vocab_size": None, "text_config": {"vocab_size": 64}}, "pass that, from_hf(config['text_config'])"),
])
def test_configs_of_other_shapes_are_refused_with_the_reason(change, words):
    fields = transformers.LlamaConfig(**SMALL).to_dict()
    fields.update(change)
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_hf(fields)
    assert words in str(info.value)


def test_cli_reports_a_missing_or_refused_config_as_a_usage_error(tmp_path, capsys):
    from fsdp_lab import cli

    for argv, words in ((f"--config {tmp_path / 'nowhere'}", "no config.json at"),
                        (f"--config {tmp_path / 'gemma'}", "model_type 'gemma'"),
                        ("--config x --model cpu", "not allowed with argument")):
        transformers.GemmaConfig(**SMALL).save_pretrained(tmp_path / "gemma")
        with pytest.raises(SystemExit) as info:
            cli.main(["estimate", *argv.split()])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: fsdp-lab estimate") and words in err and "Traceback" not in err
