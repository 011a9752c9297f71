"""ShardedLossScaler against torch.amp.GradScaler (one process) and across ranks.

* One process: the same model, data and injected overflows under torch's GradScaler and under
  ShardedLossScaler give the same scale after every update, skip the same steps and end with
  identical parameters.
* Two ranks: an inf in rank 1's shard only makes both ranks skip (the flag is all-reduced);
  with no overflow both step; the scale halves on both.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.grad_scaler import ShardedLossScaler, unscale_and_check

OVERFLOW_STEPS = {1, 2, 6}


def _train(use_torch: bool, steps: int = 9):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = (torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2) if use_torch
              else ShardedLossScaler(init_scale=8.0, growth_interval=2))
    scales, stepped = [], []
    for step in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        if step in OVERFLOW_STEPS:
            model.weight.grad[0, 0] = float("inf") if step != 6 else float("nan")
        before = model.weight.detach().clone()
        scaler.step(opt)
        stepped.append(not torch.equal(before, model.weight))
        scaler.update()
        scales.append(float(scaler.get_scale()))
    return scales, stepped, [p.detach().clone() for p in model.parameters()]


def test_matches_torch_grad_scaler():
    ours, theirs = _train(False), _train(True)
    assert ours[0] == theirs[0]                      # scale after every update
    assert ours[1] == theirs[1]                      # the same steps skipped
    assert ours[1].count(False) == len(OVERFLOW_STEPS)
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="init_scale"):
        ShardedLossScaler(init_scale=0)
    with pytest.raises(ValueError, match="backoff"):
        ShardedLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="scale must be"):
        unscale_and_check([torch.ones(2)], float("inf"))
    scaler = ShardedLossScaler()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already"):
        scaler.unscale_(opt)


def _ranks():
    import torch.distributed as dist
    rank = dist.get_rank()
    out = []
    for overflow in (True, False):
        param = torch.nn.Parameter(torch.ones(4))
        param.grad = torch.full((4,), 8.0)
        if overflow and rank == 1:
            param.grad[2] = float("inf")
        opt = torch.optim.SGD([param], lr=1.0)
        scaler = ShardedLossScaler(init_scale=8.0)
        stepped = scaler.step(opt)
        scaler.update()
        out.append((stepped, scaler.get_scale(), param.detach().clone()))
    return out


def test_ranks_agree_on_overflow():
    per_rank = fsdp_lab.launch(_ranks, world_size=2, timeout=120)
    for rank_out in per_rank:
        (stepped_inf, scale_inf, p_inf), (stepped, scale, p) = rank_out
        assert not stepped_inf and scale_inf == 4.0 and torch.equal(p_inf, torch.ones(4))
        assert stepped and scale == 8.0 and torch.equal(p, torch.zeros(4))  # 1 - 8/8
