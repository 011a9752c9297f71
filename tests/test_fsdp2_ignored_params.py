"""``fully_shard(..., ignored_params=...)``: parameters FSDP2 leaves alone, as PyTorch's does.

An ignored parameter is not sharded, and its gradient is not reduced: each rank trains it on its
own batch, so the ranks' copies drift apart. The reference is PyTorch's ``fully_shard`` with the
same ``ignored_params``, rank by rank; one launch on 2 ranks runs both.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

from _torch_reference import TORCH_FSDP2_ON_CPU


def _train(fully_shard):
    import torch.distributed as dist

    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    for layer in model.layers:
        fully_shard(layer, ignored_params={layer.ffn_norm.weight})
    fully_shard(model, ignored_params={model.output.weight})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        model(shard_batch(global_batch(512, 4, 16, step=step), rank, world)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in model.state_dict().items()}
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()
             if n in ("output.weight", "layers.0.ffn_norm.weight", "layers.0.attention_norm.weight")}
    return local, kinds


def _ranks():
    from fsdp_lab.fsdp2 import fully_shard

    out = {"ours": _train(fully_shard), "errors": {}}
    if TORCH_FSDP2_ON_CPU:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        if "ignored_params" in inspect.signature(torch_fully_shard).parameters:  # torch >= 2.7
            out["torch"] = _train(torch_fully_shard)
    for name, bad in (("a module", torch.nn.Linear(2, 2)), ("a tensor list", [torch.ones(2)])):
        try:
            fully_shard(torch.nn.Linear(2, 2), ignored_params=bad)
            out["errors"][name] = None
        except TypeError as e:
            out["errors"][name] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_ranks, world_size=2, timeout=240)


def test_ignored_parameters_train_as_in_pytorch_on_every_rank(ranks, torch_fsdp2_reference):
    if "torch" not in ranks[0]:
        pytest.skip(f"torch {torch.__version__}'s fully_shard takes no ignored_params")
    for rank in ranks:
        ours, theirs = rank["ours"][0], rank["torch"][0]
        assert ours.keys() == theirs.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    # not reduced: each rank's copy followed its own gradient
    assert not torch.equal(ranks[0]["ours"][0]["output.weight"], ranks[1]["ours"][0]["output.weight"])


def test_ignored_parameters_stay_plain(ranks):
    kinds = ranks[0]["ours"][1]
    assert kinds == {"output.weight": "Parameter", "layers.0.ffn_norm.weight": "Parameter",
                     "layers.0.attention_norm.weight": "DTensor"}


def test_ignored_params_of_the_wrong_kind_name_the_fix(ranks):
    errors = ranks[0]["errors"]
    assert "ignored_params must be a set of nn.Parameters" in errors["a module"]
    assert "ignored_params must hold nn.Parameters, got a Tensor" in errors["a tensor list"]
