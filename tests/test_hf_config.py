"""``LlamaConfig.from_hf`` and ``fsdp-lab estimate --config``: your own model's shapes from its config.json.

The reference is independent of the code under test: ``transformers`` builds the same model on
the meta device (no memory), and its parameter count and shapes must be ours; Llama-2-7B's count
is the published one (6,738,415,616).
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


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("mistral", False)])
def test_small_configs_give_the_transformers_models_shapes(family, tied):
    cls = transformers.LlamaConfig if family == "llama" else transformers.MistralConfig
    hf = cls(**SMALL, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    config = LlamaConfig.from_hf(hf)
    assert count_parameters(config) == _hf_parameter_count(hf)
    with torch.device("meta"):
        ours, theirs = Llama(config), transformers.AutoModelForCausalLM.from_config(hf)
    our_shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert our_shapes == sorted(tuple(p.shape) for p in theirs.parameters())
    assert (config.n_kv_heads, config.norm_eps, config.max_seq_len, config.tie_embeddings) == (2, 1e-5, 64, tied)


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


@pytest.mark.parametrize("change,words", [
    ({"model_type": "qwen2"}, "model_type 'qwen2' is not one whose parameters are this package's Llama"),
    ({"attention_bias": True}, "biases in attention or MLP layers"),
    ({"hidden_act": "gelu"}, "uses 'gelu', not the SiLU-gated"),
    ({"head_dim": 64}, "head_dim 64 x 6 heads is not hidden_size 96"),
    ({"intermediate_size": None}, "the config has no intermediate_size"),
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
                        (f"--config {tmp_path / 'qwen'}", "model_type 'qwen2'"),
                        ("--config x --model cpu", "not allowed with argument")):
        transformers.Qwen2Config(**SMALL).save_pretrained(tmp_path / "qwen")
        with pytest.raises(SystemExit) as info:
            cli.main(["estimate", *argv.split()])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: fsdp-lab estimate") and words in err and "Traceback" not in err
