"""Which ranks a flat parameter is split over (shard group) and copied across (replicate group).

    FULL_SHARD, SHARD_GRAD_OP: shard over the whole world, no replicas.
    NO_SHARD:                  no sharding (shard group of 1), replicate over the world.
    HYBRID_SHARD:              shard within groups of consecutive ranks (a node on GPUs),
                               replicate across them: world = shard size x replicas.

On CPU (no nodes) HYBRID_SHARD picks the largest divisor of the world size that is at most
its square root as the replica count, e.g. 4 ranks -> shard {0,1} and {2,3}, replicate
{0,2} and {1,3}. A world with no such split (1, 2, 3, 5, ...) is refused.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from fsdp_lab.fsdp1.api import ShardingStrategy

_hybrid_cache: dict[int, tuple] = {}  # world size -> (shard group, replicate group), per process


def resolve(process_group, strategy: ShardingStrategy):
    """Return ``(shard_group, replicate_group)``; None means "no such group" (size 1).

    Raises ValueError when ``process_group`` does not contain this rank or does not span the
    world, or when HYBRID_SHARD cannot split the world.
    """
    world = dist.get_world_size()
    if strategy == ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            shard, replicate = process_group
            _check_member(shard, "shard group")
            _check_member(replicate, "replicate group")
            if dist.get_world_size(shard) * dist.get_world_size(replicate) != world:
                raise ValueError(f"HYBRID_SHARD groups of {dist.get_world_size(shard)} x "
                                 f"{dist.get_world_size(replicate)} ranks do not make the world of {world}")
            return shard, replicate
        if process_group is not None:
            raise ValueError("HYBRID_SHARD takes process_group=None or a (shard_group, replicate_group) tuple")
        return _hybrid_groups(world)
    group = process_group if process_group is not None else dist.group.WORLD
    _check_member(group, "process_group")
    if dist.get_world_size(group) != world:
        raise ValueError(f"process_group has {dist.get_world_size(group)} ranks but the world has {world}: "
                         f"{strategy.name} shards over every rank. Pass process_group=None, or use "
                         f"HYBRID_SHARD with a (shard_group, replicate_group) tuple")
    if strategy == ShardingStrategy.NO_SHARD:
        return None, (group if world > 1 else None)
    return group, None


def _check_member(group, what: str) -> None:
    if dist.get_rank(group) < 0:
        raise ValueError(f"{what} does not contain rank {dist.get_rank()}: every rank must belong to the "
                         f"group it shards over")


def hybrid_shard_size(world: int) -> int:
    """Ranks per shard group for HYBRID_SHARD: the node size on GPUs (LOCAL_WORLD_SIZE or the
    GPU count), else world / (largest divisor <= sqrt(world)). Raises ValueError if the
    world cannot be split into >= 2 groups of >= 2 ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if 1 < local < world and world % local == 0:
        return local
    replicas = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    if replicas < 2:
        raise ValueError(f"HYBRID_SHARD needs a world that splits into >= 2 groups of >= 2 ranks; "
                         f"{world} does not factor. Use FULL_SHARD, or a world of 4, 6, 8, ... ranks")
    return world // replicas


def _hybrid_groups(world: int):
    if world in _hybrid_cache:  # nested units share the groups (new_group is collective)
        return _hybrid_cache[world]
    shard_size = hybrid_shard_size(world)
    replicas = world // shard_size
    rank = dist.get_rank()
    shard_group = replicate_group = None
    for g in range(replicas):  # every rank must create every group, in the same order
        ranks = list(range(g * shard_size, (g + 1) * shard_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            shard_group = group
    for i in range(shard_size):
        ranks = list(range(i, world, shard_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate_group = group
    _hybrid_cache[world] = (shard_group, replicate_group)
    return shard_group, replicate_group
