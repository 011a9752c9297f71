"""``FullyShardedDataParallel.clip_grad_norm_``: the global gradient norm from the shards, then scale.

Sharded gradients are summed per rank and all-reduced over the shard group (every element
lives on exactly one rank of it; padding has zero gradient; replicas of HYBRID_SHARD and
NO_SHARD hold the same values, so they are not added again). Gradients of parameters FSDP
does not manage (ignored modules) are whole on every rank and added once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_lab import collectives
from fsdp_lab.fsdp1.runtime import owner_of, units_in

__all__ = ["clip_grad_norm"]


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of ``model`` so the global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm before clipping (a float32 tensor): the same on every rank, except that
    with ignored modules (gradients not reduced, so they differ between ranks) a finite norm adds
    this rank's own part of them, as PyTorch's FSDP1 does; the infinity norm takes the maximum
    over every rank's parts, so the ranks still agree.
    """
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    units = units_in(model)
    sharded = [i.param.grad for u in units for h in u._handles for i in h.infos if i.param.grad is not None]
    replicated = [p.grad for p in model.parameters() if p.grad is not None and owner_of(p) is None]
    device = units[0].compute_device if units else torch.device("cpu")

    def local(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        if inf:
            return torch.stack([g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                                for g in grads]).max().to(device)
        return sum(g.float().norm(norm_type) ** norm_type for g in grads).to(device)

    group = units[0].shard_group if units else None
    if inf:  # a maximum counts nothing twice: every rank's ignored gradients take part too
        total = torch.maximum(local(sharded), local(replicated))
        if group is not None:
            collectives.all_reduce(total, op="max", group=group)
    else:  # summing every rank's ignored part would count the same parameters once per rank
        total = local(sharded)
        if group is not None:
            collectives.all_reduce(total, op="sum", group=group)
        total = (total + local(replicated)) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.device, g.dtype))
    return total
