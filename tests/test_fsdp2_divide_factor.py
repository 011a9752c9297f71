"""``set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms``, as PyTorch's FSDPModule.

By default FSDP2 averages gradients over the ranks; with a divide factor f each gradient is the
sum of the ranks' gradients divided by f (f = 1: the sum, for a loss normalised by a global
token count). The references are independent of the code under test: one process summing the
gradients of each rank's half batch, and PyTorch's ``fully_shard`` with the same settings where
gloo runs them (a divide factor without forced sums makes PyTorch's reduce with NCCL's
PREMUL_SUM, which gloo lacks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

from _torch_reference import TORCH_FSDP2_ON_CPU

WORLD, TOL = 2, 1e-6
_TORCH_HAS_THE_METHODS = TORCH_FSDP2_ON_CPU and all(
    hasattr(torch.distributed.fsdp.FSDPModule, m) for m in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms"))
SETTINGS = [(None, False), (None, True), (1.0, True), (4.0, False)]  # (divide factor, force sum)


def _grads(fully_shard, factor, force_sum, hsdp=False, only_root=False):
    """Whole gradients after one backward of this rank's part of the batch, under these
    settings (``hsdp``: 2 replicas x 2 shards)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.fsdp2 import full_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in [model] if only_root else [*model.layers, model]:  # each call sets its module's own groups
        if factor is not None:
            module.set_gradient_divide_factor(factor)
        module.set_force_sum_reduction_for_comms(force_sum)
    model(shard_batch(global_batch(512, 4, 16, step=0), dist.get_rank(), dist.get_world_size())).loss.backward()
    return {n: full_tensor(p.grad).clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for n, p in model.named_parameters()}


def _ranks():
    from fsdp_lab.fsdp2 import fully_shard

    out = {"errors": []}
    for bad in (0.0, "2", True):
        try:
            fully_shard(torch.nn.Linear(2, 2)).set_gradient_divide_factor(bad)
        except (TypeError, ValueError) as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
    out["root only"] = _grads(fully_shard, 1.0, False, only_root=True)
    for factor, force_sum in SETTINGS:
        out[("ours", factor, force_sum)] = _grads(fully_shard, factor, force_sum)
        if _TORCH_HAS_THE_METHODS and (factor is None or force_sum):  # else PyTorch's uses PREMUL_SUM, not on gloo
            from torch.distributed.fsdp import fully_shard as torch_fully_shard
            out[("torch", factor, force_sum)] = _grads(torch_fully_shard, factor, force_sum)
    return out


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_ranks, world_size=WORLD, timeout=240)[0]


def _summed(world):
    """One process: the sum over ranks of the gradient of each rank's part of the batch."""
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    for rank in range(world):
        model(shard_batch(global_batch(512, 4, 16, step=0), rank, world)).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def summed():
    return _summed(WORLD)


def _hsdp_ranks():
    from fsdp_lab.fsdp2 import fully_shard

    return {factor: _grads(fully_shard, factor, False, hsdp=True) for factor in (None, 1.0, 3.0)}


def test_hsdp_sums_over_replicas_and_shards_before_dividing():
    got, total = fsdp_lab.launch(_hsdp_ranks, world_size=4, timeout=240)[0], _summed(4)
    for factor, divide in ((None, 4), (1.0, 1), (3.0, 3)):
        for name, grad in total.items():
            torch.testing.assert_close(got[factor][name], grad / divide, rtol=0, atol=TOL, msg=f"{factor} {name}")


@pytest.mark.parametrize("factor,force_sum", SETTINGS)
def test_gradients_are_the_ranks_sum_divided_by_the_factor(ranks, summed, factor, force_sum):
    got = ranks[("ours", factor, force_sum)]
    divide = WORLD if factor is None else factor
    for name, total in summed.items():
        torch.testing.assert_close(got[name], total / divide, rtol=0, atol=TOL, msg=name)


@pytest.mark.skipif(not _TORCH_HAS_THE_METHODS, reason=f"torch {torch.__version__}'s FSDPModule lacks them")
@pytest.mark.parametrize("factor,force_sum", [s for s in SETTINGS if s[0] is None or s[1]])
def test_gradients_match_pytorch(ranks, torch_fsdp2_reference, factor, force_sum):
    ours, theirs = ranks[("ours", factor, force_sum)], ranks[("torch", factor, force_sum)]
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=TOL, msg=name)


def test_a_divide_factor_must_be_a_positive_number(ranks):
    assert ranks["errors"] == ["ValueError: factor must be positive, got 0.0; 1.0 sums the ranks' gradients",
                               "TypeError: factor must be a number, got '2'",
                               "TypeError: factor must be a number, got True"]


def test_the_factor_is_the_modules_own_not_its_childrens(ranks, summed):
    got = ranks["root only"]
    for name, total in summed.items():
        expected = total / WORLD if name.startswith("layers.") else total  # the blocks keep the mean
        torch.testing.assert_close(got[name], expected, rtol=0, atol=TOL, msg=name)
