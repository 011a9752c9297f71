"""Mixed-precision policies shared by FSDP1 and FSDP2.

Two policy classes with PyTorch's names and defaults:

* ``MixedPrecisionPolicy`` (FSDP2, ``torch.distributed.fsdp.MixedPrecisionPolicy``):
  ``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs`` (torch 2.15
  added ``param_dtype_override_fn``, a per-parameter compute dtype, which is not here).
* ``MixedPrecision`` (FSDP1, ``torch.distributed.fsdp.MixedPrecision``):
  ``param_dtype``, ``reduce_dtype``, ``buffer_dtype``, ``keep_low_precision_grads``,
  ``cast_forward_inputs``, ``cast_root_forward_inputs``.

``None`` means "keep the parameter's own dtype", as in PyTorch, except that gradients with no
``reduce_dtype`` are reduced in ``param_dtype``: FSDP1's rule, and FSDP2's up to torch 2.14
(torch 2.15's ``fully_shard`` reduces them in the parameter's own dtype; this rule does not
follow the installed torch, so a lab's figures do not change with it). The helpers below are the
one place that decides which dtype a buffer gets at each phase, so both implementations
agree (see docs/precision.md for the table).

Both classes also take three optional fields that separate what PyTorch's ``reduce_dtype``
folds together (Megatron-FSDP's names):

* ``main_params_dtype`` (default float32): dtype of the sharded master weights the optimizer
  updates; ``None`` keeps the model's own dtype. Applied to trainable floating parameters
  only: frozen or quantized parameters need no master copy and keep their own dtype.
* ``main_grads_dtype`` (default float32): dtype gradients are accumulated in across
  microbatches (the no-sync buffer and the sharded gradient); ``None`` = the reduce dtype
  for the unsharded buffer, the master weights' dtype for the sharded one.
* ``grad_comm_dtype`` (default None = the ``reduce_dtype`` rule): dtype of gradients on
  the wire. Where it differs from the accumulation dtype, a temporary buffer (tagged
  ``comm_buffers``) holds the gradient only for the collective.

For a float32 model these defaults change nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from fsdp_lab.checks import check_bool

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_MAIN_FIELDS = ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype")


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
    """FSDP2's mixed-precision policy: PyTorch's four fields with PyTorch's defaults, and three
    from Megatron-FSDP (``main_*`` and ``grad_comm_dtype``), whose float32 defaults give a
    bf16 model float32 master shards and gradients (docs/precision.md).

    param_dtype: dtype of the all-gathered (unsharded) parameters used for compute.
    reduce_dtype: dtype of gradients on the wire in reduce-scatter / all-reduce.
    output_dtype: dtype the module's floating outputs are cast to.
    cast_forward_inputs: cast floating forward inputs to ``param_dtype``.
    main_params_dtype: master-weight dtype (default float32; None = the model's own).
    main_grads_dtype: gradient accumulation dtype across microbatches (default float32).
    grad_comm_dtype: gradient dtype on the wire (default None = reduce_dtype rule).

    Raises TypeError naming the field for a dtype that is not floating (int, bool, ...) or a
    flag that is not a bool.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = torch.float32
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype", *_MAIN_FIELDS):
            check_float_dtype(field, getattr(self, field))
        check_bool("cast_forward_inputs", self.cast_forward_inputs)

    @classmethod
    def coerce(cls, policy: Any) -> "MixedPrecisionPolicy":
        """``policy`` as this class: itself, or PyTorch's ``torch.distributed.fsdp.MixedPrecisionPolicy``
        converted field by field.

        PyTorch's policy has four of this class's fields; the converted one keeps PyTorch's
        behaviour for the rest (``main_params_dtype=None``: master weights stay in the model's
        dtype; ``main_grads_dtype=None``: gradients accumulate as PyTorch's FSDP2 does). Raises
        TypeError for anything else, naming the class to import.
        """
        if isinstance(policy, cls):
            return policy
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        except ImportError:  # pragma: no cover - torch builds without distributed
            TorchPolicy = None
        if TorchPolicy is not None and isinstance(policy, TorchPolicy):
            return cls(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                       output_dtype=policy.output_dtype, cast_forward_inputs=policy.cast_forward_inputs,
                       main_params_dtype=None, main_grads_dtype=None)
        raise TypeError(
            f"mp_policy must be a MixedPrecisionPolicy (fsdp_lab.fsdp2.MixedPrecisionPolicy, or PyTorch's "
            f"torch.distributed.fsdp.MixedPrecisionPolicy), got {type(policy).__module__}.{type(policy).__name__}; "
            f"for FSDP1 use fsdp_lab.precision.MixedPrecision instead")


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed-precision config: PyTorch's fields with PyTorch's defaults, and the three
    Megatron-FSDP fields of ``MixedPrecisionPolicy`` (float32 masters of a bf16 model by default).

    keep_low_precision_grads: leave ``.grad`` in ``param_dtype`` instead of upcasting
    to the sharded parameter's dtype after the reduce-scatter.
    main_params_dtype, main_grads_dtype, grad_comm_dtype: as in ``MixedPrecisionPolicy``.

    Raises TypeError naming the field for a dtype that is not floating (int, bool, ...) or a
    flag that is not a bool.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = torch.float32
    grad_comm_dtype: torch.dtype | None = None

    @classmethod
    def coerce(cls, policy: Any) -> Any:
        """``policy`` as this class where it is PyTorch's ``torch.distributed.fsdp.MixedPrecision``
        (converted field by field, with PyTorch's master and gradient dtypes:
        ``main_params_dtype=None``, ``main_grads_dtype=None``); anything else as it is (the
        caller's type check names what to pass)."""
        try:
            from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
        except ImportError:  # pragma: no cover - torch builds without distributed
            return policy
        if not isinstance(policy, TorchMixedPrecision):
            return policy
        return cls(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                   buffer_dtype=policy.buffer_dtype, keep_low_precision_grads=policy.keep_low_precision_grads,
                   cast_forward_inputs=policy.cast_forward_inputs,
                   cast_root_forward_inputs=policy.cast_root_forward_inputs,
                   main_params_dtype=None, main_grads_dtype=None)

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype", *_MAIN_FIELDS):
            check_float_dtype(field, getattr(self, field))
        for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            check_bool(field, getattr(self, field))


def compute_dtype(policy_param_dtype: torch.dtype | None, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype parameters are gathered and used in: the policy's, else the parameter's own."""
    return policy_param_dtype or orig_dtype


def reduce_dtype(policy: Any, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in.

    ``reduce_dtype`` if set, else ``param_dtype`` if set, else the parameter's own dtype:
    PyTorch's rule for FSDP1, and for FSDP2 up to torch 2.14 (2.15 skips ``param_dtype``).
    """
    return policy.reduce_dtype or policy.param_dtype or orig_dtype


def main_params_dtype(policy: Any, orig_dtype: torch.dtype, trainable: bool = True) -> torch.dtype:
    """The dtype of the sharded master weights.

    ``torch.promote_types(orig_dtype, policy.main_params_dtype)`` for a trainable floating
    parameter: a bf16 model gets float32 masters by default, a float32/float64 model keeps
    its own dtype (the master copy never narrows a parameter). The parameter's own dtype
    when ``main_params_dtype`` is None or the parameter is frozen.
    """
    wanted = getattr(policy, "main_params_dtype", None)
    if wanted is None or not trainable or not orig_dtype.is_floating_point:
        return orig_dtype
    return torch.promote_types(orig_dtype, wanted)


def accumulation_dtype(main_grads: torch.dtype | None, incoming: torch.dtype, fallback: torch.dtype) -> torch.dtype:
    """The dtype a gradient buffer accumulates in across microbatches.

    ``incoming`` is the dtype autograd produces the gradient in (the compute dtype). With
    ``main_grads`` set: ``torch.promote_types(incoming, main_grads)`` (never narrower than
    the computed gradient, so a float64 model keeps float64); else ``fallback`` (PyTorch FSDP2's
    choice: the reduce dtype for the unsharded buffer, the master dtype for the sharded one).
    """
    return torch.promote_types(incoming, main_grads) if main_grads is not None else fallback


def grad_comm_dtype(policy: Any, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients travel in: ``grad_comm_dtype`` if set, else ``reduce_dtype(policy, orig_dtype)``."""
    return getattr(policy, "grad_comm_dtype", None) or reduce_dtype(policy, orig_dtype)


@dataclasses.dataclass(frozen=True)
class ParamDtypes:
    """The dtypes of one parameter's life under a policy, decided once by :func:`param_dtypes`.

    ``compute``: gathered and used in forward and backward; ``master``: the sharded weight the
    optimizer updates (and its state); ``wire``: gradients travel in it across ranks;
    ``accumulation``: the sharded gradient sums microbatches and arriving reductions in (kept
    apart from ``.grad`` when it is not ``master``); ``unsharded_accumulation``: the full gradient
    kept aside without gradient sync sums in.
    """

    compute: torch.dtype
    master: torch.dtype
    wire: torch.dtype
    accumulation: torch.dtype
    unsharded_accumulation: torch.dtype


def param_dtypes(policy: Any, orig_dtype: torch.dtype, trainable: bool = True) -> ParamDtypes:
    """Every dtype of a parameter of ``orig_dtype`` under ``policy`` (see :class:`ParamDtypes`).

    The rules are PyTorch's where it has the field (compute: ``param_dtype``, else the
    parameter's own; the no-sync buffer: the reduce dtype) and Megatron-FSDP's for the others
    (master: :func:`main_params_dtype`; wire: :func:`grad_comm_dtype`; accumulation:
    :func:`accumulation_dtype` of ``main_grads_dtype``, else the master dtype).
    """
    compute = compute_dtype(policy.param_dtype, orig_dtype)
    master = main_params_dtype(policy, orig_dtype, trainable)
    main_grads = getattr(policy, "main_grads_dtype", None)
    return ParamDtypes(
        compute=compute, master=master, wire=grad_comm_dtype(policy, orig_dtype),
        accumulation=accumulation_dtype(main_grads, compute, master),
        unsharded_accumulation=accumulation_dtype(main_grads, compute, reduce_dtype(policy, orig_dtype)),
    )


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating tensor in nested containers to ``dtype`` (None: unchanged).

    Containers keep their own class, as in PyTorch's ``_apply_to_tensors``: dataclasses
    (Hugging Face's ``ModelOutput`` is one, and a dict) are rebuilt with
    ``dataclasses.replace``, namedtuples with their fields, dict subclasses (OrderedDict,
    defaultdict) as a copy of themselves, lists and tuples as their own type.
    """
    if dtype is None:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() and tree.dtype != dtype else tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {f.name: cast_floating(getattr(tree, f.name), dtype)
                   for f in dataclasses.fields(tree) if f.init}
        return dataclasses.replace(tree, **changes)
    if isinstance(tree, (list, tuple)):
        cast = [cast_floating(x, dtype) for x in tree]
        return type(tree)(*cast) if hasattr(tree, "_fields") else type(tree)(cast)
    if isinstance(tree, dict):
        if type(tree) is dict:
            return {k: cast_floating(v, dtype) for k, v in tree.items()}
        out = copy.copy(tree)  # keeps the subclass and its state (a defaultdict's factory)
        for k, v in tree.items():
            out[k] = cast_floating(v, dtype)
        return out
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (in order)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in tensors_in(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in tensors_in(x)]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [t for f in dataclasses.fields(tree) for t in tensors_in(getattr(tree, f.name))]
    return []
