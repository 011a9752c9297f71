"""The knobs of FSDP1, with PyTorch's names and defaults (``torch.distributed.fsdp.api``).

Nothing here runs: these are the enums and small dataclasses that
``fsdp_lab.fsdp1.FullyShardedDataParallel`` reads, ``from_torch``, which turns PyTorch's own
objects of the same names into these, and ``check_option_types``, which it calls next so a
value of the wrong type (a string for an enum) is refused instead of misread.
``MixedPrecision`` is shared with FSDP2's policy module and re-exported from ``fsdp_lab.precision``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig,
                                    ShardedStateDictConfig)

from fsdp_lab.checks import check_bool
from fsdp_lab.precision import MixedPrecision

__all__ = ["ShardingStrategy", "BackwardPrefetch", "CPUOffload", "MixedPrecision", "StateDictType",
           "StateDictSettings", "FullStateDictConfig", "ShardedStateDictConfig", "FullOptimStateDictConfig",
           "ShardedOptimStateDictConfig"]


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
class StateDictSettings:
    """What ``state_dict()`` and ``optim_state_dict`` give (PyTorch's class of that name).

    The configs are PyTorch's own classes (re-exported here): ``FullStateDictConfig`` /
    ``FullOptimStateDictConfig`` (``offload_to_cpu``: tensors on CPU, else on the compute
    device; ``rank0_only``: the other ranks get an empty dict) and the ``Sharded`` ones, whose
    ``offload_to_cpu`` changes nothing here (the model's sharded entries are CPU copies, the
    optimizer's view its state). None: this package's default, CPU copies on every rank.
    """

    state_dict_type: StateDictType
    state_dict_config: Any = None
    optim_state_dict_config: Any = None

    @classmethod
    def checked(cls, state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> "StateDictSettings":
        """Settings from a type (ours or PyTorch's) and configs of its kind. Raises TypeError for
        another type, NotImplementedError for LOCAL_STATE_DICT, RuntimeError (PyTorch's error) for
        a config of the other kind (a Sharded config with FULL_STATE_DICT)."""
        kind = from_torch(state_dict_type, StateDictType)
        if not isinstance(kind, StateDictType):
            raise TypeError(f"state_dict_type must be StateDictType.FULL_STATE_DICT or SHARDED_STATE_DICT, "
                            f"got {state_dict_type!r}")
        prefix = "Full" if kind == StateDictType.FULL_STATE_DICT else "Sharded"
        for name, config, family in (("state_dict_config", state_dict_config, "StateDictConfig"),
                                     ("optim_state_dict_config", optim_state_dict_config, "OptimStateDictConfig")):
            if config is not None and type(config).__name__ != prefix + family:
                raise RuntimeError(f"{kind.name} takes {name}={prefix}{family}(...) or None, got {config!r}")
        return cls(kind, state_dict_config, optim_state_dict_config)

    def full_options(self, optim: bool = False) -> tuple[bool, bool]:
        """(offload_to_cpu, rank0_only) for a full model (or, with ``optim``, optimizer) state dict."""
        config = self.optim_state_dict_config if optim else self.state_dict_config
        if config is None:
            return True, False
        return bool(config.offload_to_cpu), bool(config.rank0_only)


@dataclasses.dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and their gradients in host memory;
    the optimizer step then runs on CPU and each all-gather first copies the shard to the device."""

    offload_params: bool = False

    def __post_init__(self) -> None:
        check_bool("offload_params", self.offload_params)



def from_torch(value, kind: type):
    """``value`` as this module's ``kind`` where it is PyTorch's class of that name
    (``torch.distributed.fsdp.ShardingStrategy.SHARD_GRAD_OP``, ``CPUOffload(True)``, its
    ``MixedPrecision``, ``StateDictType``), so code written for PyTorch's FSDP1 runs as it is;
    anything else unchanged (``check_option_types`` then names what to pass)."""
    origin = type(value)
    if not origin.__module__.startswith("torch.distributed.fsdp") or origin.__name__ != kind.__name__:
        return value
    if issubclass(kind, enum.Enum):
        if value.name not in kind.__members__:
            raise NotImplementedError(f"{kind.__name__}.{value.name} is not implemented in fsdp_lab's FSDP1; "
                                      f"use one of {', '.join(kind.__members__)}")
        return kind[value.name]
    if kind is CPUOffload:
        return CPUOffload(offload_params=value.offload_params)
    if kind is MixedPrecision:
        return MixedPrecision.coerce(value)
    return value


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
