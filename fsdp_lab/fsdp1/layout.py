"""Where each parameter sits in a flat parameter, and which slice of it a rank keeps.

A unit's parameters (of one dtype and ``requires_grad``) are laid end to end in registration
order, padded with zeros to a multiple of the shard-group size N, and rank r keeps the
contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded / N``:

    flat (padded):  | p0 p0 p0 p0 p0 | p1 p1 p1 | p2 p2 p2 p2 p2 p2 | 0 0 |
    ranks (N = 4):  |    rank 0   |   rank 1  |   rank 2  |   rank 3   |

Nothing here allocates or communicates: ``FlatLayout`` is the arithmetic that the flat
parameter (``flat_param.py``) and its gradient (``flat_grad.py``) share.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["ParamInfo", "ShardingSpec", "FlatLayout", "ShardedParam", "padded_numel", "shard_boundaries"]


@dataclasses.dataclass
class ParamInfo:
    """One original parameter inside a flat parameter."""

    fqn: str                               # name relative to the FSDP unit's module
    shape: torch.Size                      # the original (full) shape
    numel: int
    offset: int                            # first element in the (unpadded) flat tensor
    param: nn.Parameter                    # the original object: the optimizer holds it
    uses: list[tuple[nn.Module, str]]      # every (module, attribute) holding it (tied weights)


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """Where a unit's flat parameters are split, computed on and stored.

    ``group``: the shard process group (None when ``size == 1``: nothing to split, as in
    NO_SHARD); ``rank`` and ``size``: this rank's index in it and its size; ``device``: where
    gathered parameters live and compute runs; ``offload``: keep shards and their gradients
    in host memory (``CPUOffload(offload_params=True)``).
    """

    group: object | None
    rank: int
    size: int
    device: torch.device
    offload: bool = False

    @classmethod
    def over(cls, group, device: torch.device, offload: bool = False) -> "ShardingSpec":
        """The spec for shard group ``group`` (None: a group of one) seen from this rank."""
        rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        return cls(group, rank, size, device, offload)

    @property
    def home(self) -> torch.device:
        """Where the shards (and sharded gradients) are stored."""
        return torch.device("cpu") if self.offload else self.device


@dataclasses.dataclass
class ShardedParam:
    """This rank's part of one parameter: ``local == full.reshape(-1)[start:end]``."""

    local: torch.Tensor    # (end - start,)
    start: int
    end: int
    shape: tuple[int, ...]  # the full parameter's shape


# sharded state dicts load with torch.load(weights_only=True)
torch.serialization.add_safe_globals([ShardedParam])


def padded_numel(total: int, world_size: int) -> int:
    """``total`` rounded up to a multiple of ``world_size`` (the flat length after padding)."""
    return math.ceil(total / world_size) * world_size


def shard_boundaries(numels: list[int], world_size: int, rank: int) -> list[tuple[int, int]]:
    """Which elements of each original parameter ``rank`` owns.

    ``numels``: element counts of the parameters in flattening order. Returns one
    ``(start, end)`` per parameter, in that parameter's own flattened index space; ``start ==
    end`` means the rank owns none of it. Raises ValueError for a rank outside the group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    shard = padded_numel(sum(numels), world_size) // world_size
    lo, hi = rank * shard, (rank + 1) * shard
    bounds, offset = [], 0
    for n in numels:
        start = min(max(lo - offset, 0), n)
        end = min(max(hi - offset, 0), n)
        bounds.append((start, max(start, end)))
        offset += n
    return bounds


class FlatLayout:
    """The flat arrangement of ``infos`` over a shard group of ``size`` ranks, seen from ``rank``.

    Sets each ``ParamInfo.offset`` (the parameters in the order given). ``bounds[i]`` is the
    range of parameter i this rank owns (in its own flattened indices), ``local_slices()[i]``
    the same range as offsets into this rank's shard.
    """

    def __init__(self, infos: list[ParamInfo], rank: int, size: int):
        offset = 0
        for info in infos:
            info.offset, offset = offset, offset + info.numel
        self.infos = infos
        self.rank, self.size = rank, size
        self.numel = offset
        self.padded_numel = padded_numel(self.numel, size)
        self.shard_numel = self.padded_numel // size
        self.shard_start = rank * self.shard_numel        # this rank's first element of the flat tensor
        self.bounds = shard_boundaries([i.numel for i in infos], size, rank)

    def local_slices(self) -> list[tuple[int, int]]:
        """For each parameter, its owned range as (start, end) offsets into this rank's shard."""
        lo = self.shard_start
        return [(i.offset + s - lo, i.offset + e - lo) for i, (s, e) in zip(self.infos, self.bounds)]

    def full_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index`` as a full-shape view of a padded flat tensor ``flat``."""
        info = self.infos[index]
        return flat[info.offset:info.offset + info.numel].view(info.shape)
