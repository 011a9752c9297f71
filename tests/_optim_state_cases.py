"""What the optimizer-state tests of both FSDPs share: the model, optimizer and steps, and the
one-process run they are checked against (tests/test_fsdp1_optim_state.py, test_fsdp2_optim_state.py).
"""

from __future__ import annotations

import torch

from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

GLOBAL_BATCH, SEQ, TOL = 4, 16, 1e-6


def build_model(case: str):
    """The test Llama, with NF4 weights and LoRA adapters when ``case`` is "qlora"."""
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    if case == "qlora":
        from fsdp_lab.qlora import apply_lora

        torch.manual_seed(1)  # the adapters' init draws from the global generator
        apply_lora(model, rank=4, alpha=8, quantize_base=True)
    return model


def build_optimizer(model, reverse: bool = False):
    """AdamW in two groups, no decay for norms (chosen by name: under FSDP1 every parameter is 1-D);
    ``reverse``: each group lists its parameters in the opposite order."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1 if reverse else 1]
    return torch.optim.AdamW([{"params": [p for n, p in trainable if "norm" not in n], "weight_decay": 0.1},
                              {"params": [p for n, p in trainable if "norm" in n], "weight_decay": 0.0}],
                             lr=1e-3, eps=1e-4)


def take_step(model, optimizer, step: int, rank: int = 0, world: int = 1) -> None:
    """One optimizer step on this rank's part of global batch ``step``."""
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=step), rank, world)
    model(batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def one_process_run(case: str) -> tuple[dict, list, list, dict]:
    """In one process: the optimizer state after two steps by parameter name, its groups'
    hyperparameters and parameter names, and the trainable parameters after the third step."""
    model = build_model(case)
    optimizer = build_optimizer(model)
    for step in range(2):
        take_step(model, optimizer, step)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    group_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    take_step(model, optimizer, 2)
    return state, groups, group_names, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_diff(got: dict, want: dict) -> float:
    """Largest absolute difference between two dicts of tensors with the same keys."""
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)
