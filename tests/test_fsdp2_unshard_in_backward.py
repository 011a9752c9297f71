"""``set_unshard_in_backward(False)``: an embedding sharded on its own is not gathered again in backward.

Its weight's gradient needs only the token ids, so the backward all-gather is saved and the
gradients stay the same. References independent of the code under test: one process's
gradients, the all-gathers counted by the timeline with the flag on and off, and PyTorch's
``fully_shard`` with the same call.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing

WORLD, TOL = 2, 1e-6
CONFIG = LlamaConfig.from_name("cpu", n_layers=2)


def _run(fully_shard, unshard_in_backward: bool, checkpointing: bool = False):
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import full_tensor
    from fsdp_lab.timeline import Timeline

    model = Llama(CONFIG, seed=0)
    if checkpointing:
        apply_activation_checkpointing(model)
    fully_shard(model.tok_embeddings)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.tok_embeddings.set_unshard_in_backward(unshard_in_backward)
    batch = shard_batch(global_batch(512, 4, 16, step=0), dist.get_rank(), WORLD)
    with Timeline() as timeline:
        model(batch).loss.backward()
    gathers = [e.args.get("module") for e in timeline.comm_events() if e.name == "all_gather"]
    return {"gathers": gathers, "grads": {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}}


def _linear_that_needs_its_weight():
    from fsdp_lab.fsdp2 import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[1])
    fully_shard(model)
    model[1].set_unshard_in_backward(False)
    try:
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _ranks():
    from torch.distributed.fsdp import FSDPModule

    from fsdp_lab.fsdp2 import fully_shard

    out = {("ours", flag): _run(fully_shard, flag) for flag in (True, False)}
    out["checkpointed"] = _run(fully_shard, False, checkpointing=True)
    out["linear"] = _linear_that_needs_its_weight()
    from _torch_reference import TORCH_FSDP2_ON_CPU
    if TORCH_FSDP2_ON_CPU and hasattr(FSDPModule, "set_unshard_in_backward"):
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        out["torch"] = _torch_grads(torch_fully_shard)
    try:
        fully_shard(torch.nn.Linear(2, 2)).set_unshard_in_backward("no")
    except TypeError as e:
        out["error"] = str(e)
    return out


def _torch_grads(torch_fully_shard):
    import torch.distributed as dist

    model = Llama(CONFIG, seed=0)
    torch_fully_shard(model.tok_embeddings)
    for layer in model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(model)
    model.tok_embeddings.set_unshard_in_backward(False)
    model(shard_batch(global_batch(512, 4, 16, step=0), dist.get_rank(), WORLD)).loss.backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_ranks, world_size=WORLD, timeout=240)


@pytest.fixture(scope="module")
def one_process():
    model = Llama(CONFIG, seed=0)
    for rank in range(WORLD):
        model(shard_batch(global_batch(512, 4, 16, step=0), rank, WORLD)).loss.backward()
    return {n: p.grad / WORLD for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", [("ours", True), ("ours", False), "checkpointed"], ids=str)
def test_gradients_are_one_process_mean(ranks, one_process, case):
    for rank in ranks:
        for name, expected in one_process.items():
            torch.testing.assert_close(rank[case]["grads"][name], expected, rtol=0, atol=TOL, msg=name)


def test_the_embedding_is_gathered_in_forward_only(ranks):
    for rank in ranks:
        with_flag, without = rank[("ours", True)]["gathers"], rank[("ours", False)]["gathers"]
        assert with_flag.count("tok_embeddings") == 2  # forward, and again in backward
        assert without.count("tok_embeddings") == 1
        assert sorted(g for g in with_flag if g != "tok_embeddings") == sorted(
            g for g in without if g != "tok_embeddings")
        # a recomputed forward still gathers what it needs; the embedding itself is not recomputed
        assert rank["checkpointed"]["gathers"].count("tok_embeddings") == 1


def test_matches_pytorch(ranks, torch_fsdp2_reference):
    if ranks[0].get("torch") is None:
        pytest.skip(f"torch {torch.__version__}'s FSDPModule has no set_unshard_in_backward")
    for rank in ranks:
        for name, theirs in rank["torch"].items():
            torch.testing.assert_close(rank[("ours", False)]["grads"][name], theirs, rtol=0, atol=TOL, msg=name)


def test_a_module_whose_backward_reads_its_weight_fails_in_backward(ranks):
    for rank in ranks:
        assert "out of bounds for storage of size 0" in rank["linear"]
    assert ranks[0]["error"] == "unshard_in_backward must be True or False, got 'no'"
