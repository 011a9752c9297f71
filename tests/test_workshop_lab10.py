"""Lab 10's checkers fed the shipped stub, the shipped solution and typical wrong answers.

The sharding checker's ranks run in one shared launch (``SharedLaunch``); its reference (the
same model trained in one process) runs for real. The PEFT checker runs in this process
against PEFT itself.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_workshop_labs import NAMESPACE, SharedLaunch, Shipped, refuse_launch  # noqa: E402

from fsdp_lab.fsdp2 import fully_shard  # noqa: E402
from fsdp_lab.qlora import LoRALinear  # noqa: E402
from fsdp_lab.workshop import lab10  # noqa: E402

NAMESPACE.setdefault("fully_shard", fully_shard)   # the lab's imports, as in its notebook
LAB10 = Shipped("10_hugging_face")


def root_only(model):
    fully_shard(model)
    return model


def layers_only(model):
    for layer in model.model.layers:
        fully_shard(layer)
    return model


def nothing(model):
    return model


def root_first(model):
    fully_shard(model)
    for layer in model.model.layers:
        fully_shard(layer)
    return model


def inner_model_as_root(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model)  # leaves lm_head, which sits beside model.model, unsharded
    return model


def inner_model_and_root(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model)
    fully_shard(model)
    return model


def attention_and_mlp(model):
    for layer in model.model.layers:
        fully_shard(layer.self_attn)   # smaller groups than the task's one per decoder layer
        fully_shard(layer.mlp)
    fully_shard(model)
    return model


def the_module_list(model):
    fully_shard(model.model.layers)   # a ModuleList is never called: its hooks never run
    fully_shard(model)
    return model


@pytest.fixture(scope="module")
def lab10_launch():
    solution = LAB10["shard_hf_model"][1]
    answers = [solution, root_only, layers_only, nothing, inner_model_as_root, inner_model_and_root,
               attention_and_mlp, the_module_list,
               root_first]   # last: it raises inside fully_shard, after which the ranks run nothing more
    return SharedLaunch(lab10._run_shard, [(answer,) for answer in answers], world_size=lab10.WORLD)


def test_shard_hf_model_verdicts(lab10_launch, monkeypatch):
    stub, solution = LAB10["shard_hf_model"]
    monkeypatch.setattr(lab10, "launch", refuse_launch)
    assert lab10.check_shard_hf_model(stub).mistake == "stub"
    monkeypatch.setattr(lab10, "launch", lab10_launch.launch)
    right = lab10.check_shard_hf_model(solution)
    assert right.solved and "3 parameter groups" in right.message
    assert lab10.check_shard_hf_model(root_only).mistake == "one_group"
    assert lab10.check_shard_hf_model(layers_only).mistake == "root_not_sharded"
    assert lab10.check_shard_hf_model(nothing).mistake == "not_sharded"
    assert lab10.check_shard_hf_model(root_first).mistake == "root_first"
    finer = lab10.check_shard_hf_model(attention_and_mlp)
    assert finer.mistake == "layers_not_groups" and "model.model.layers.0 first" in finer.message
    container = lab10.check_shard_hf_model(the_module_list)
    assert container.mistake == "container" and "model.model.layers is a ModuleList" in container.message
    inner = lab10.check_shard_hf_model(inner_model_as_root)
    assert inner.mistake == "root_not_sharded" and "not sharded: lm_head.weight." in inner.message
    assert "fully_shard(model)" in inner.message
    four = lab10.check_shard_hf_model(inner_model_and_root)
    assert four.solved and "4 parameter groups" in four.message and "model.model and the root" in four.message


def _adapters(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def no_prefix(model):
    return {f"{n}.lora_{x}.weight": getattr(m, f"lora_{x.lower()}") for n, m in _adapters(model) for x in "AB"}


def lower_case(model):
    return {f"base_model.model.{n}.lora_{x}.weight": getattr(m, f"lora_{x}") for n, m in _adapters(model) for x in "ab"}


def swapped(model):
    out = {}
    for n, m in _adapters(model):
        out[f"base_model.model.{n}.lora_A.weight"] = m.lora_b
        out[f"base_model.model.{n}.lora_B.weight"] = m.lora_a
    return out


def shifted(model):
    adapters = _adapters(model)
    out = {}
    for (n, _), (_, m) in zip(adapters, adapters[1:] + adapters[:1]):   # each key holds another layer's
        out[f"base_model.model.{n}.lora_A.weight"] = m.lora_a
        out[f"base_model.model.{n}.lora_B.weight"] = m.lora_b
    # shapes differ between attention and MLP layers; keep only same-shape layers' swaps valid
    for n, m in adapters:
        if out[f"base_model.model.{n}.lora_A.weight"].shape != m.lora_a.shape or \
                out[f"base_model.model.{n}.lora_B.weight"].shape != m.lora_b.shape:
            out[f"base_model.model.{n}.lora_A.weight"] = m.lora_a
            out[f"base_model.model.{n}.lora_B.weight"] = m.lora_b
    return out


def pre_scaled(model):
    return {f"base_model.model.{n}.lora_{x}.weight": getattr(m, f"lora_{x.lower()}") * (m.scaling if x == "B" else 1)
            for n, m in _adapters(model) for x in "AB"}


def bf16_copies(model):
    return {f"base_model.model.{n}.lora_{x}.weight": getattr(m, f"lora_{x.lower()}").to(torch.bfloat16)
            for n, m in _adapters(model) for x in "AB"}


def empty(model):
    return {}


def modules_not_tensors(model):
    return {f"base_model.model.{n}.lora_A.weight": m for n, m in _adapters(model)}


def only_lora_a(model):
    return {f"base_model.model.{n}.lora_A.weight": m.lora_a for n, m in _adapters(model)}


def test_peft_state_dict_verdicts():
    stub, solution = LAB10["peft_state_dict"]
    assert lab10.check_peft_state_dict(stub).mistake == "stub"
    right = lab10.check_peft_state_dict(solution)
    assert right.solved and "28 tensors" in right.message
    assert "14 adapted linears in 2 decoder layers" in right.message   # 7 projections per decoder layer
    assert lab10.check_peft_state_dict(no_prefix).mistake == "no_prefix"
    assert lab10.check_peft_state_dict(lower_case).mistake == "case"
    assert lab10.check_peft_state_dict(swapped).mistake == "swapped"
    assert lab10.check_peft_state_dict(shifted).mistake == "wrong_values"
    scaled = lab10.check_peft_state_dict(pre_scaled)
    assert scaled.mistake == "scaled" and "lora_alpha / r" in scaled.message
    assert lab10.check_peft_state_dict(bf16_copies).mistake == "dtype"
    assert lab10.check_peft_state_dict(empty).mistake == "empty"
    not_tensors = lab10.check_peft_state_dict(modules_not_tensors)
    assert not_tensors.mistake == "not_tensors" and "maps to a LoRALinear" in not_tensors.message
    missing = lab10.check_peft_state_dict(only_lora_a)
    assert missing.mistake == "wrong_keys" and "lora_B.weight, which you left out" in missing.message
