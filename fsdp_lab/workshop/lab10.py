"""Checkers for lab 10 (a Hugging Face model under FSDP and QLoRA).

* ``check_shard_hf_model(shard_hf_model)``: ``shard_hf_model(model)`` applies fsdp_lab's
  ``fully_shard`` to a ``LlamaForCausalLM``. Reference: the same model trained in one
  process on the same global batch (losses to 1e-6), plus how many parameter groups the
  answer made (one per decoder layer and one for the root).
* ``check_peft_state_dict(peft_state_dict)``: ``peft_state_dict(model)`` maps a QLoRA model's
  adapters to PEFT's keys. Reference: PEFT itself: the keys ``peft.get_peft_model_state_dict``
  gives for the same LoRA config, and the logits of ``peft.PeftModel.from_pretrained`` loading
  the answer onto the plain (dequantized) base, against the QLoRA model's logits.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import CHECK_TIMEOUT, checker, correct, mistake

WORLD = 2
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 2, 4, 8, 128
RANK, ALPHA = 4, 8


def tiny_llama(seed: int = 0):
    """A 2-layer, hidden-64 ``LlamaForCausalLM`` from a config, seeded random weights, float32."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def token_batch(step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of step ``step``'s global batch of token ids (same on every call)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // world
    return ids[rank * per:(rank + 1) * per]


def train_losses(model, rank: int = 0, world: int = 1) -> list[float]:
    """SGD steps on ``model``; the global mean loss of each step (averaged over ranks)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = token_batch(step, rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(losses)
        losses /= world
    return losses.tolist()


def _run_shard(answer):
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import FSDPModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_llama()
    try:
        result = answer(model)
    except ValueError as error:
        # fully_shard refuses a container at once (as PyTorch's does): it is never called itself, so
        # the hooks it would get never run. The model's containers are named for the verdict.
        if "fully_shard cannot shard an nn." not in str(error):
            raise
        containers = [(name, type(m).__name__) for name, m in model.named_modules()
                      if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
        return {"containers": containers, "groups": [], "plain": [], "unsharded_layers": [], "losses": None,
                "n_layers": len(model.model.layers)}
    model = result if isinstance(result, torch.nn.Module) else model
    groups = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]   # "" is the root
    containers = []
    plain = [n for n, p in model.named_parameters() if type(p).__name__ != "DTensor"]
    unsharded_layers = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, FSDPModule)]
    losses = train_losses(model, rank, world) if not plain and not containers else None
    return {"groups": groups, "plain": plain, "containers": containers, "unsharded_layers": unsharded_layers,
            "n_layers": len(model.model.layers), "losses": losses}


def _explain_shard(error: BaseException, text: str):
    # fully_shard meeting a parameter that is already a DTensor: an outer module was sharded first
    if "is a DTensor already: fully_shard of a module above it ran first" in text:
        return mistake("root_first", "fully_shard met parameters that an earlier fully_shard had already made "
                                     "DTensors: the root was sharded before its decoder layers and took their "
                                     "parameters into its group. fully_shard each decoder layer first, then "
                                     "the root: FSDP2 shards bottom-up")
    return None


def _losses_text(losses: list[float]) -> str:
    # float32 losses: the last digits depend on the CPU's kernels, so they are printed after a "≈"
    return ", ".join(f"≈{x:.4f}" for x in losses)


@checker("shard_hf_model", hint="call fully_shard(layer) for each layer in model.model.layers, "
                                 "then fully_shard(model) for the root", explain=_explain_shard)
def check_shard_hf_model(shard_hf_model):
    """Run ``shard_hf_model`` on 2 ranks, train, compare with one process."""
    out = launch(_run_shard, shard_hf_model, world_size=WORLD, timeout=CHECK_TIMEOUT)[0]
    groups, plain = out["groups"], out["plain"]
    if out["containers"]:
        listed = " or ".join(f"model.{name} is a {kind}" for name, kind in out["containers"])
        name = f"model.{out['containers'][0][0]}"
        return mistake("container", f"fully_shard refused a container: {listed}, a container of modules that is "
                                    "never called itself, so the hooks fully_shard would put on it would never "
                                    f"run; fully_shard each layer in {name} instead, then the model")
    if not groups:
        return mistake("not_sharded", "no module of the model became an FSDPModule; call "
                                      "fully_shard on the decoder layers and on the model")
    if plain:
        listed = ", ".join(plain) if len(plain) <= 4 else f"{', '.join(plain[:4])}, ..."
        if "" not in groups and "model" in groups:
            # model.model holds the layers, embeddings and norm; lm_head sits beside it in the root
            return mistake("root_not_sharded",
                           f"{len(plain)} parameter(s) not sharded: {listed}. You sharded model.model, which "
                           "leaves out what sits beside it in LlamaForCausalLM; call fully_shard(model), the "
                           "whole LlamaForCausalLM, last")
        return mistake("root_not_sharded",
                       f"{len(plain)} parameter(s) not sharded: {listed}. The embeddings, final norm and "
                       "lm_head belong to the root; call fully_shard(model) last")
    if groups == [""]:
        return mistake("one_group", "only the root is a parameter group: the whole model is all-gathered at "
                                    "once, so no rank ever holds less than the full model; shard each decoder "
                                    "layer before the root")
    if out["unsharded_layers"]:
        missing, total = out["unsharded_layers"], out["n_layers"]
        inner = sorted(g for g in groups if g.startswith("model.layers."))
        yours = f"; your groups inside them: {', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''}" if inner else ""
        return mistake("layers_not_groups", f"{len(missing)} of {total} decoder layers are not their own group "
                                            f"(model.model.layers.{missing[0]} first){yours}: the task asks for "
                                            "one fully_shard per decoder layer, so each is gathered whole, one "
                                            "layer at a time")
    reference = train_losses(tiny_llama())
    if not torch.allclose(torch.tensor(out["losses"]), torch.tensor(reference), atol=1e-6, rtol=0):
        return mistake("wrong_losses", f"losses {_losses_text(out['losses'])} differ from those of the same "
                                       f"model trained in one process, {_losses_text(reference)}")
    # named as the learner reaches them from `model`, deepest first: the order they are sharded in
    deepest_first = sorted(groups, key=lambda name: (-(name.count(".") + bool(name)), name))
    names = [f"model.{name}" if name else "the root" for name in deepest_first]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return correct(f"{len(groups)} parameter groups ({listed}); on {WORLD} ranks the losses "
                   f"({_losses_text(out['losses'])}) equal those of the same model trained in one process "
                   "(to 1e-6): a transformers model is sharded like any other nn.Module")


def _qlora_model():
    from fsdp_lab.qlora import apply_lora

    model = tiny_llama()
    torch.manual_seed(1)
    apply_lora(model, rank=RANK, alpha=ALPHA)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_b"):
                m.lora_b.normal_(0, 0.02)
    return model


def _peft_reference_keys(config: dict) -> set[str]:
    import peft

    lora = peft.LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                           target_modules=config["target_modules"], task_type="CAUSAL_LM")
    return set(peft.get_peft_model_state_dict(peft.get_peft_model(tiny_llama(), lora)))


@checker("peft_state_dict", hint="for each LoRALinear `name, m` in model.named_modules(): "
                                  "'base_model.model.' + name + '.lora_A.weight' -> m.lora_a and "
                                  "'.lora_B.weight' -> m.lora_b")
def check_peft_state_dict(peft_state_dict):
    """Load the answer's adapters with PEFT onto the plain base; compare logits with the QLoRA model's."""
    import peft
    import transformers
    from safetensors.torch import save_file

    from fsdp_lab import hf

    model = _qlora_model()
    answer = peft_state_dict(model)
    if not isinstance(answer, dict):
        return mistake("not_a_dict", f"return a dict of key -> tensor, got {type(answer).__name__}")
    not_tensors = [(k, v) for k, v in answer.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        key, value = not_tensors[0]
        return mistake("not_tensors", f"{key!r} maps to a {type(value).__name__}, not a tensor: map each key "
                                      "to the adapter's tensor itself (module.lora_a or module.lora_b)")
    if not answer:
        return mistake("empty", "the dict is empty: no module matched. The adapters are the modules for which "
                                "isinstance(module, LoRALinear) holds, found by model.named_modules()")
    config = hf.peft_adapter_config(model)
    expected = _peft_reference_keys(config)
    keys = set(answer)
    if keys != expected:
        example = sorted(expected)[0]
        if {k.lower() for k in keys} == {k.lower() for k in expected}:
            return mistake("case", f"PEFT's names are lora_A / lora_B (capitals), e.g. {example}")
        if not any(k.startswith("base_model.model.") for k in keys):
            return mistake("no_prefix", f"PEFT's keys start with 'base_model.model.' (the PeftModel wraps "
                                        f"the model): e.g. {example}, you gave {sorted(keys)[0]}")
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        shown = [f"PEFT has {missing[0]}, which you left out" if missing else "",
                 f"you gave {extra[0]}, which PEFT does not have" if extra else ""]
        return mistake("wrong_keys", f"{len(keys & expected)} of {len(expected)} keys match PEFT's; "
                                     + "; ".join(s for s in shown if s))
    for key, tensor in answer.items():
        name = key[len("base_model.model."):].rsplit(".", 2)[0]
        lora = model.get_submodule(name)
        want = lora.lora_a if ".lora_A." in key else lora.lora_b
        if tuple(tensor.shape) != tuple(want.shape):
            return mistake("swapped", f"{key} has shape {list(tensor.shape)}, PEFT expects {list(want.shape)}: "
                                      "lora_A is our lora_a (rank x in), lora_B our lora_b (out x rank)")
        if tensor.dtype != want.dtype:
            return mistake("dtype", f"{key} is {tensor.dtype}, the adapter is {want.dtype}: a copy in another "
                                    "dtype rounds it; map each key to the adapter tensor itself")
        value, adapter = tensor.detach(), want.detach()
        if not torch.equal(value, adapter):
            factor = float((value * adapter).sum() / (adapter * adapter).sum())
            if torch.allclose(value, factor * adapter, rtol=1e-5, atol=1e-8):
                return mistake("scaled", f"{key} holds the adapter times {factor:.4g}: PEFT multiplies by "
                                         "lora_alpha / r itself (adapter_config.json), so store the adapters "
                                         "as they are")
    ids = token_batch(0)
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    with tempfile.TemporaryDirectory() as directory:
        base = tiny_llama()
        base.load_state_dict({k: v for k, v in hf.plain_state_dict(model).items() if "lora_" not in k})
        save_file({k: v.detach().clone().contiguous() for k, v in answer.items()},   # one copy per key
                  os.path.join(directory, hf.ADAPTER_WEIGHTS))
        with open(os.path.join(directory, hf.ADAPTER_CONFIG), "w") as f:
            json.dump(config, f)
        loaded = peft.PeftModel.from_pretrained(base, directory).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=ids).logits
    diff = (theirs - ours).abs().max().item()
    if diff > 1e-5:
        return mistake("wrong_values", f"PEFT's logits differ from the QLoRA model's by up to {diff:.3g}; "
                                       "each key must hold that layer's own adapter")
    del transformers
    # counted from the answer's keys: base_model.model.<linear>.lora_A.weight, <linear> = model.layers.<i>.<...>
    linears = {key[len("base_model.model."):].rsplit(".", 2)[0] for key in answer}
    layers = {name.split(".layers.", 1)[1].split(".", 1)[0] for name in linears if ".layers." in name}
    return correct(f"PEFT loaded your {len(answer)} tensors (lora_A and lora_B of {len(linears)} adapted linears "
                   f"in {len(layers)} decoder layers) onto the plain model with the dequantized base weights, "
                   "and its logits equal the QLoRA model's: the adapters travel, the NF4 base does not need to")
