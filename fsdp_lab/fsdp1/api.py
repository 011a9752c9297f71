"""The knobs of FSDP1, with PyTorch's names and defaults (``torch.distributed.fsdp.api``).

Nothing here runs: these are the enums and small dataclasses that
``fsdp_lab.fsdp1.FullyShardedDataParallel`` reads, and ``check_option_types``, which it calls
first so a value of the wrong type (a string for an enum) is refused instead of misread.
``MixedPrecision`` is shared with FSDP2's policy module and re-exported from ``fsdp_lab.precision``.
"""

from __future__ import annotations

import dataclasses
import enum

from fsdp_lab.checks import check_bool
from fsdp_lab.precision import MixedPrecision

__all__ = ["ShardingStrategy", "BackwardPrefetch", "CPUOffload", "MixedPrecision", "StateDictType"]


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks.

    FULL_SHARD: shard everything; free gathered parameters after forward, re-gather in backward.
    SHARD_GRAD_OP: shard everything at rest, but keep parameters gathered from forward through
        backward (one all-gather per step instead of two, more memory).
    NO_SHARD: replicate everything and all-reduce gradients (DistributedDataParallel).
    HYBRID_SHARD: FULL_SHARD inside a shard group (e.g. one node), replicate across groups
        (gradients all-reduced between the groups' matching ranks).
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    BACKWARD_PRE: before the current unit's gradient computation (more overlap, more memory).
    BACKWARD_POST: after the current unit's gradients exist, before its reduce-scatter.
    ``None`` (the keyword value) turns prefetching off: each unit gathers when backward reaches it.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns inside ``FullyShardedDataParallel.state_dict_type``.

    FULL_STATE_DICT: every original parameter at full shape (an all-gather per unit).
    SHARDED_STATE_DICT: each rank's own slices only (no communication), see ``state_dict.py``.
    """

    FULL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclasses.dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and their gradients in host memory;
    the optimizer step then runs on CPU and each all-gather first copies the shard to the device."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        check_bool("offload_params", self.offload_params)



def check_option_types(sharding_strategy, cpu_offload, backward_prefetch, mixed_precision, auto_wrap_policy,
                       **flags) -> None:
    """Check the types of ``FullyShardedDataParallel``'s option arguments (each may also be None)
    and that each of ``flags`` (name=value) is a bool.

    These are compared by identity deep inside FSDP (``strategy == ShardingStrategy.NO_SHARD``),
    so a string such as "SHARD_GRAD_OP" would silently behave as another strategy, and a flag
    given as "no" would read as True.
    Raises TypeError naming the argument, what it got and the value to pass instead.
    """
    for name, value in flags.items():
        check_bool(name, value)
    options = [("sharding_strategy", sharding_strategy, ShardingStrategy),
               ("backward_prefetch", backward_prefetch, BackwardPrefetch),
               ("cpu_offload", cpu_offload, CPUOffload), ("mixed_precision", mixed_precision, MixedPrecision)]
    for name, value, kind in options:
        if value is None or isinstance(value, kind):
            continue
        if issubclass(kind, enum.Enum):
            named = value.upper() if isinstance(value, str) else ""
            example = f"{kind.__name__}.{named if named in kind.__members__ else next(iter(kind.__members__))}"
            what = f"a {kind.__name__} member ({', '.join(kind.__members__)})"
        else:
            example = {CPUOffload: "CPUOffload(offload_params=True)",
                       MixedPrecision: "MixedPrecision(param_dtype=torch.bfloat16)"}[kind]
            what = f"a {kind.__name__}"
        raise TypeError(f"{name} must be {what} or None, got {value!r}; pass e.g. {name}={example}")
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(f"auto_wrap_policy must be callable (module, recurse, nonwrapped_numel) -> bool, e.g. "
                        f"ModuleWrapPolicy({{TransformerBlock}}), or None; got {auto_wrap_policy!r}")
