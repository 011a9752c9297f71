"""Lab 06's checkers fed the shipped stub, the shipped solution and typical wrong answers.

References inside the checkers: the mean gradient computed on one process (float32, and the
same sum in bf16), and torch.amp.GradScaler stepping the whole gradient on one process. All
answers of one exercise run in one launch (``SharedLaunch`` from test_workshop_labs).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.workshop import lab06
from test_workshop_labs import SharedLaunch, Shipped, refuse_launch

LAB06 = Shipped("06_mixed_precision")


# ----------------------------------------------------------------------------- the reduction


def megatron_optim_bug(local_grad, wire_dtype):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    k = local_grad.numel() // world
    buffer = local_grad / world
    reduced = torch.empty(k, dtype=wire_dtype)
    collectives.reduce_scatter_tensor(reduced, buffer.to(wire_dtype))
    local = buffer[rank * k:(rank + 1) * k]
    local += reduced.float()                           # added into the un-reduced slice
    return local


def summed(local_grad, wire_dtype):
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size(), dtype=wire_dtype)
    collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))
    return shard.float()


def row_shaped(local_grad, wire_dtype):
    import torch.distributed as dist
    world = dist.get_world_size()
    shard = torch.empty(local_grad.numel() // world, dtype=wire_dtype)
    collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))
    return (shard.float() / world).view(1, -1)         # the right values as one row


def fp32_wire(local_grad, wire_dtype):
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, local_grad, op="avg")
    return shard


def wire_dtype_returned(local_grad, wire_dtype):
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size(), dtype=wire_dtype)
    collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype), op="avg")
    return shard


def via_all_reduce(local_grad, wire_dtype):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    k = local_grad.numel() // world
    total = local_grad.to(wire_dtype)
    collectives.all_reduce(total)
    return total[rank * k:(rank + 1) * k].float() / world


def via_all_gather(local_grad, wire_dtype):
    """Right values: every rank gathers all the bf16 gradients and sums its slice itself."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    wire = local_grad.to(wire_dtype)
    everything = torch.empty(world * wire.numel(), dtype=wire_dtype)
    collectives.all_gather_into_tensor(everything, wire)
    k = wire.numel() // world
    return everything.view(world, -1)[:, rank * k:(rank + 1) * k].sum(0).float() / world


def local_only(local_grad, wire_dtype):
    import torch.distributed as dist
    return local_grad.chunk(dist.get_world_size())[dist.get_rank()].clone()


def torch_distributed(local_grad, wire_dtype):
    """A right answer that calls torch.distributed directly (the Timeline cannot see it; the check's
    own record of torch.distributed's calls does)."""
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size(), dtype=wire_dtype)
    dist.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))
    return shard.float() / dist.get_world_size()


def torch_distributed_fp32_wire(local_grad, wire_dtype):
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(shard, local_grad)
    return shard / dist.get_world_size()


def torch_distributed_all_reduce(local_grad, wire_dtype):
    """Right values through torch.distributed's all-reduce: every rank receives the whole sum."""
    import torch.distributed as dist
    whole = local_grad.to(wire_dtype)
    dist.all_reduce(whole)
    return whole.float().chunk(dist.get_world_size())[dist.get_rank()] / dist.get_world_size()


def two_ranks_hard_coded(local_grad, wire_dtype):
    """Right on the check's 2 ranks, but the world size is written in as 2."""
    shard = torch.empty(local_grad.numel() // 2, dtype=wire_dtype)
    collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))
    return shard.float() / 2


def divided_by_two(local_grad, wire_dtype):
    """The shard size follows the world size, the division is written in as 2."""
    import torch.distributed as dist
    shard = torch.empty(local_grad.numel() // dist.get_world_size(), dtype=wire_dtype)
    collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))
    return shard.float() / 2


REDUCE_WRONG = {"added_to_local_shard": megatron_optim_bug, "not_averaged": summed, "wire_not_bf16": fp32_wire,
                "returned_wire_dtype": wire_dtype_returned, "used_all_reduce": via_all_reduce,
                "not_reduce_scatter": via_all_gather, "no_collective": local_only, "wrong_shape": row_shaped}
# the same mistakes made through torch.distributed's own functions, which the check records too
DIRECT_WRONG = {"wire_not_bf16": torch_distributed_fp32_wire, "used_all_reduce": torch_distributed_all_reduce}
# right on 2 ranks, wrong on lab06.OTHER_WORLD: the world size is written in
FIXED_WORLD = [two_ranks_hard_coded, divided_by_two]
OTHER_WORLD = lab06.OTHER_WORLD


@pytest.fixture(scope="module")
def reduce_launch():
    solution = LAB06["reduce_grad_shard"][1]
    answers = [solution, torch_distributed, *REDUCE_WRONG.values(), *DIRECT_WRONG.values(), *FIXED_WORLD]
    return SharedLaunch(lab06._run_reduce, [(f,) for f in answers],
                        world_size=lab06.WORLD)


@pytest.fixture(scope="module")
def reduce_launch_other_world():
    """The check's second run, on lab06.OTHER_WORLD ranks: only answers right on 2 ranks get there."""
    solution = LAB06["reduce_grad_shard"][1]
    answers = [solution, torch_distributed, *FIXED_WORLD]
    return SharedLaunch(lab06._run_reduce, [(f,) for f in answers], world_size=OTHER_WORLD)


def test_reduce_grad_shard_verdicts(reduce_launch, reduce_launch_other_world, monkeypatch):
    stub, solution = LAB06["reduce_grad_shard"]
    monkeypatch.setattr(lab06, "launch", refuse_launch)
    assert lab06.check_reduce_grad_shard(stub).mistake == "stub"
    launches = {lab06.WORLD: reduce_launch, OTHER_WORLD: reduce_launch_other_world}

    def by_world(fn, *case, world_size, **kwargs):
        return launches[world_size].launch(fn, *case, world_size=world_size, **kwargs)

    monkeypatch.setattr(lab06, "launch", by_world)
    right = lab06.check_reduce_grad_shard(solution)
    # 8 elements: 32 bytes in float32, 16 in bf16 per reduce-scatter
    assert right.solved and "moved 16 bytes per reduce-scatter instead of 32" in right.message
    # the error has two sources: each rank's gradient rounded to bf16, and the bf16 sum across ranks
    assert "rounded to bf16 and the ranks' contributions summed in bf16" in right.message
    direct = lab06.check_reduce_grad_shard(torch_distributed)
    assert direct.solved and "moved 16 bytes per reduce-scatter instead of 32" in direct.message
    for name, answer in [*REDUCE_WRONG.items(), *DIRECT_WRONG.items()]:
        assert lab06.check_reduce_grad_shard(answer).mistake == name, name
    # right on 2 ranks: only the run on more ranks shows that 2 was written in
    hard_coded = lab06.check_reduce_grad_shard(two_ranks_hard_coded)
    assert hard_coded.mistake == "fixed_world" and "on 4 ranks" in hard_coded.message
    assert "input has 8 elements" in hard_coded.message and "get_world_size" in hard_coded.hint
    assert "rank 0" not in hard_coded.message  # which rank fails first is not deterministic
    halved = lab06.check_reduce_grad_shard(divided_by_two)
    assert halved.mistake == "fixed_world" and "2x the mean" in halved.message


# ----------------------------------------------------------------------------- loss scaling


def local_only(grads, scale):
    found = any(not torch.isfinite(g).all() for g in grads)
    for g in grads:
        g.mul_(1.0 / scale)
    return found


def isinf_only(grads, scale):
    found = torch.tensor([float(any(torch.isinf(g).any() for g in grads))])
    collectives.all_reduce(found, op="max")
    for g in grads:
        g.mul_(1.0 / scale)
    return bool(found.item())


def not_unscaled(grads, scale):
    found = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    collectives.all_reduce(found, op="max")
    return bool(found.item())


def last_shard_only(grads, scale):
    for g in grads:
        found = torch.tensor([0.0 if torch.isfinite(g).all() else 1.0])   # set anew for each shard
        g.mul_(1.0 / scale)
    collectives.all_reduce(found, op="max")
    return bool(found.item())


def multiplied(grads, scale):
    found = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    collectives.all_reduce(found, op="max")
    for g in grads:
        g.mul_(scale)                                  # instead of 1.0 / scale
    return bool(found.item())


def one_all_reduce_per_shard(grads, scale):
    found = torch.zeros(1)
    for g in grads:                                    # right flags, one all-reduce per shard
        flag = torch.tensor([0.0 if torch.isfinite(g).all() else 1.0])
        collectives.all_reduce(flag, op="max")
        found = torch.maximum(found, flag)
        g.mul_(1.0 / scale)
    return bool(found.item())


def summed_flag_returned(grads, scale):
    found = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    collectives.all_reduce(found)                      # a sum: 2.0 when both ranks overflow
    for g in grads:
        g.mul_(1.0 / scale)
    return found                                       # the tensor, not True or False


def returned_before_the_all_reduce(grads, scale):
    for g in grads:
        g.mul_(1.0 / scale)
        if not torch.isfinite(g).all():
            return True                                # the other rank waits in the all-reduce below
    found = torch.zeros(1)
    collectives.all_reduce(found, op="max")
    return bool(found.item())


SCALE_WRONG = {"local_only": local_only, "missed_nan": isinf_only, "not_unscaled": not_unscaled,
               "one_shard_only": last_shard_only, "multiplied_by_scale": multiplied,
               "several_collectives": one_all_reduce_per_shard, "not_a_bool": summed_flag_returned}


@pytest.fixture(scope="module")
def scale_launch():
    solution = LAB06["unscale_and_check"][1]
    return SharedLaunch(lab06._run_unscale, [(solution,)] + [(f,) for f in SCALE_WRONG.values()],
                        world_size=lab06.WORLD)


def test_unscale_and_check_verdicts(scale_launch, monkeypatch):
    stub, solution = LAB06["unscale_and_check"]
    monkeypatch.setattr(lab06, "launch", refuse_launch)
    assert lab06.check_unscale_and_check(stub).mistake == "stub"
    monkeypatch.setattr(lab06, "launch", scale_launch.launch)
    right = lab06.check_unscale_and_check(solution)
    assert right.solved and "divided by 1024" in right.message and "One all-reduce of 4 bytes" in right.message
    for name, answer in SCALE_WRONG.items():
        assert lab06.check_unscale_and_check(answer).mistake == name, name


def test_a_rank_that_returns_before_the_all_reduce_is_named():
    # a real launch: rank 0 returns early while rank 1 waits in the all-reduce, and gloo closes the pair
    verdict = lab06.check_unscale_and_check(returned_before_the_all_reduce)
    assert verdict.mistake in ("peer_left", "hang"), verdict
    assert "same collectives" in verdict.hint


def test_policy_losses_header_names_the_last_step(capsys):
    table = {"fp32": {"losses": [6.0, 4.0, 3.0]}, "bf16": {"losses": [6.0, 4.1, 3.1]}}
    lab06.print_policy_losses(table, {"bf16": 0.1})
    lines = capsys.readouterr().out.splitlines()
    assert "loss@1  loss@3 |" in lines[0] and "loss@50" not in lines[0]
    assert lines[2].endswith("≈3.1000 | ≈1.00e-01")
