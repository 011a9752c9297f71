"""Mixed-precision policies shared by FSDP1 and FSDP2.

Two policy classes with PyTorch's names and defaults:

* ``MixedPrecisionPolicy`` (FSDP2, ``torch.distributed.fsdp.MixedPrecisionPolicy``):
  ``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``.
* ``MixedPrecision`` (FSDP1, ``torch.distributed.fsdp.MixedPrecision``):
  ``param_dtype``, ``reduce_dtype``, ``buffer_dtype``, ``keep_low_precision_grads``,
  ``cast_forward_inputs``, ``cast_root_forward_inputs``.

``None`` means "keep the parameter's own dtype", as in PyTorch. The helpers below are the
one place that decides which dtype a buffer gets at each phase, so both implementations
agree (see docs/precision.md for the table).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_float_dtype(field: str, dtype: torch.dtype | None) -> None:
    """Raise TypeError unless ``dtype`` is None or a floating dtype we can compute in."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{field} must be a torch.dtype or None, got {dtype!r}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{field}={dtype} is not a floating dtype; FSDP casts parameters and reduces "
            f"gradients in one of {', '.join(str(d) for d in _FLOAT_DTYPES)}"
        )


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy (same fields and defaults as PyTorch's).

    param_dtype: dtype of the all-gathered (unsharded) parameters used for compute.
    reduce_dtype: dtype of gradients on the wire in reduce-scatter / all-reduce.
    output_dtype: dtype the module's floating outputs are cast to.
    cast_forward_inputs: cast floating forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            check_float_dtype(field, getattr(self, field))


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed-precision config (same fields and defaults as PyTorch's).

    keep_low_precision_grads: leave ``.grad`` in ``param_dtype`` instead of upcasting
    to the sharded parameter's dtype after the reduce-scatter.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            check_float_dtype(field, getattr(self, field))


def compute_dtype(policy_param_dtype: torch.dtype | None, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype parameters are gathered and used in: the policy's, else the parameter's own."""
    return policy_param_dtype or orig_dtype


def reduce_dtype(policy: Any, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in.

    PyTorch's rule: ``reduce_dtype`` if set, else ``param_dtype`` if set, else the
    parameter's own dtype.
    """
    return policy.reduce_dtype or policy.param_dtype or orig_dtype


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating tensor in a nested list/tuple/dict to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if isinstance(tree, (list, tuple)):
        cast = [cast_floating(x, dtype) for x in tree]
        return type(tree)(*cast) if hasattr(tree, "_fields") else type(tree)(cast)
    if isinstance(tree, dict):
        return {k: cast_floating(v, dtype) for k, v in tree.items()}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(
            tree, **{f.name: cast_floating(getattr(tree, f.name), dtype) for f in dataclasses.fields(tree)}
        )
    return tree
