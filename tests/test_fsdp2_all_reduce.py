"""HSDP gradient accumulation with ``set_requires_all_reduce`` and ``set_is_last_backward``.

On a 2 x 2 mesh (2 replicas of 2 shards, 4 gloo ranks), microbatches before the last run with
``set_requires_all_reduce(False)``: each still reduce-scatters within its shard group, but the
reduced rows wait (no all-reduce across the replicas, no ``.grad``) until the last microbatch
adds them in and all-reduces once. References independent of the code under test: one process
summing every rank's microbatches, and PyTorch's ``fully_shard`` with the same calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

WORLD, MICROBATCHES, TOL = 4, 3, 1e-6
CONFIG = LlamaConfig.from_name("cpu", n_layers=2)


def _microbatch(rank: int, world: int, i: int):
    return shard_batch(global_batch(512, 4, 16, step=i), rank, world)


class TwoPaths(nn.Module):
    """``b`` runs only when asked: a parameter with no gradient in the last microbatch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, x, use_b: bool):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _accumulate(fully_shard, last_backward_too: bool):
    """Whole gradients after MICROBATCHES backwards of this rank's parts, the all-reduce only
    in the last; with what the tracker and the timeline saw after the first microbatch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.fsdp2 import full_tensor
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.timeline import Timeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Llama(CONFIG, seed=0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, out = dist.get_rank(), {}
    for i in range(MICROBATCHES):
        last = i == MICROBATCHES - 1
        model.set_requires_all_reduce(last)
        if last_backward_too:
            model.set_is_last_backward(last)
        if i == 0 and fully_shard.__module__.startswith("fsdp_lab"):
            with MemoryTracker(model) as tracker, Timeline() as timeline:
                model(_microbatch(rank, WORLD, i)).loss.backward()
                out["after first"] = dict(tracker.current())
            out["collectives"] = sorted({e.name for e in timeline.comm_events()})
            out["grads after first"] = [n for n, p in model.named_parameters() if p.grad is not None]
        else:
            model(_microbatch(rank, WORLD, i)).loss.backward()
    out["grads"] = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    return out


def _no_gradient_in_the_last_microbatch():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.fsdp2 import full_tensor, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(TwoPaths(), mesh=mesh)
    x = torch.randn(2 * WORLD, 6, generator=torch.Generator().manual_seed(1)).chunk(WORLD)[dist.get_rank()]
    model.set_requires_all_reduce(False)
    model(x, use_b=True).square().sum().backward()
    model.set_requires_all_reduce(True)
    model(x, use_b=False).square().sum().backward()
    return {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}


def _children_only():
    """A root without parameters of its own over two sharded children: the last microbatch
    reduces each child once (the end of backward must not reduce the kept rows again)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.timeline import Timeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
    for child in (model[0], model[2], model):
        fully_shard(child, mesh=mesh)
    x = torch.randn(2 * WORLD, 6, generator=torch.Generator().manual_seed(1)).chunk(WORLD)[dist.get_rank()]
    model.set_requires_all_reduce(False)
    model(x.requires_grad_()).square().sum().backward()
    model.set_requires_all_reduce(True)
    with Timeline() as timeline:
        model(x).square().sum().backward()
    return sorted(e.name for e in timeline.comm_events() if e.name != "all_gather")


def _not_the_last_backward():
    """1-D FSDP: a backward that is not the last leaves its last reduce-scatter in flight."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import full_tensor, fully_shard

    model = fully_shard(TwoPaths())
    x = torch.randn(2 * WORLD, 6, generator=torch.Generator().manual_seed(1)).chunk(WORLD)[dist.get_rank()]
    model.set_is_last_backward(False)
    model(x, use_b=True).square().sum().backward()
    out = {"set after the first": sorted(n for n, p in model.named_parameters() if p.grad is not None)}
    model.set_is_last_backward(True)
    model(x, use_b=True).square().sum().backward()
    out["grads"] = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters()}
    return out


def _ranks():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_lab.fsdp2 import fully_shard

    out = {"ours": _accumulate(fully_shard, False), "ours, is_last_backward": _accumulate(fully_shard, True),
           "two paths": _no_gradient_in_the_last_microbatch(), "not last": _not_the_last_backward(),
           "children only": _children_only(),
           "errors": []}
    from _torch_reference import TORCH_FSDP2_ON_CPU
    if TORCH_FSDP2_ON_CPU and hasattr(FSDPModule, "set_requires_all_reduce"):
        out["torch"] = _accumulate(torch_fully_shard, True)
    model = fully_shard(nn.Linear(2, 2))
    for method in (model.set_requires_all_reduce, model.set_is_last_backward):
        try:
            method("no")
        except TypeError as e:
            out["errors"].append(str(e))
    return out


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_ranks, world_size=WORLD, timeout=240)


@pytest.fixture(scope="module")
def one_process():
    """The mean over ranks of each rank's gradients summed over its microbatches."""
    model = Llama(CONFIG, seed=0)
    for i in range(MICROBATCHES):
        for rank in range(WORLD):
            model(_microbatch(rank, WORLD, i)).loss.backward()
    return {n: p.grad / WORLD for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["ours", "ours, is_last_backward"])
def test_accumulated_gradients_are_one_process_mean(ranks, one_process, case):
    for rank in ranks:
        for name, expected in one_process.items():
            torch.testing.assert_close(rank[case]["grads"][name], expected, rtol=0, atol=TOL, msg=name)


def test_matches_pytorch(ranks, torch_fsdp2_reference):
    if "torch" not in ranks[0]:
        pytest.skip(f"torch {torch.__version__}'s FSDPModule has no set_requires_all_reduce")
    for rank in ranks:
        for name, theirs in rank["torch"]["grads"].items():
            torch.testing.assert_close(rank["ours, is_last_backward"]["grads"][name], theirs, rtol=0, atol=TOL,
                                       msg=name)


def test_a_microbatch_before_the_last_reduce_scatters_and_keeps_its_rows_sharded(ranks):
    """No all-reduce, no ``.grad``, no unsharded gradient left; the kept rows are one shard of
    every parameter: by hand, float32, half the rows (2 shards) of the CPU Llama's 2 blocks."""
    d, f, vocab = 128, 352, 512
    block = 2 * d * d + 2 * 64 * d + 3 * f * d + 2 * d
    shard_bytes = 4 * (2 * vocab * d + d + 2 * block) // 2
    for rank in ranks:
        ours = rank["ours"]
        assert ours["collectives"] == ["all_gather", "reduce_scatter"]
        assert ours["grads after first"] == []
        assert ours["after first"]["unsharded_grads"] == 0
        assert ours["after first"]["sharded_grads"] == shard_bytes


def test_rows_kept_for_a_parameter_without_a_gradient_in_the_last_microbatch_still_arrive(ranks):
    model = TwoPaths()
    x = torch.randn(2 * WORLD, 6, generator=torch.Generator().manual_seed(1)).chunk(WORLD)
    for rank in range(WORLD):
        model(x[rank], use_b=True).square().sum().backward()
    b_only_first = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("b.")}
    for rank in range(WORLD):
        model(x[rank], use_b=False).square().sum().backward()
    expected = {n: p.grad / WORLD for n, p in model.named_parameters()}
    for rank in ranks:
        for name, grad in expected.items():
            torch.testing.assert_close(rank["two paths"][name], grad, rtol=0, atol=TOL, msg=name)
    assert all(g.abs().sum() > 0 for g in b_only_first.values())


def test_a_backward_that_is_not_the_last_leaves_its_reduce_scatter_in_flight(ranks):
    """Its gradients arrive with the next microbatch (here: the forward finishes it), so after
    the last backward they are both microbatches' mean over ranks."""
    model = TwoPaths()
    x = torch.randn(2 * WORLD, 6, generator=torch.Generator().manual_seed(1)).chunk(WORLD)
    for _ in range(2):
        for rank in range(WORLD):
            model(x[rank], use_b=True).square().sum().backward()
    for rank in ranks:
        assert rank["not last"]["set after the first"] == []
        for name, p in model.named_parameters():
            torch.testing.assert_close(rank["not last"]["grads"][name], p.grad / WORLD, rtol=0, atol=TOL, msg=name)


def test_the_last_microbatch_reduces_each_group_once(ranks):
    for rank in ranks:
        assert rank["children only"] == ["all_reduce", "all_reduce", "reduce_scatter", "reduce_scatter"]


def test_the_switches_take_bools_only(ranks):
    assert ranks[0]["errors"] == ["requires_all_reduce must be True or False, got 'no'",
                                  "is_last_backward must be True or False, got 'no'"]
