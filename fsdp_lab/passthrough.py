"""Know when a module's backward is done: an identity on its inputs whose backward calls back.

Autograd runs a node once the gradients of all its outputs exist. Passing a module's inputs
through one identity node before the module runs therefore gives a callback that fires as
soon as the gradients w.r.t. those inputs exist, i.e. right after the module's own backward.
FSDP2 reduces a group's gradients there (PyTorch's ``RegisterPostBackwardFunction``), FSDP1
frees its frozen flat parameters there, and ``unit_timing`` ends a unit's backward span there.

Unlike ``torch.autograd.graph.register_multi_grad_hook(mode="all")``, whose hooks and the
nodes they watch refer to each other, the node holds the callback only as long as the graph
lives: no reference cycle keeps the callback's owner (a whole sharded model) alive.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

__all__ = ["call_after_input_grads"]


def _may_hold_tensors(x: Any) -> bool:
    """Whether pytree would look inside ``x``: a tuple, list, dict or deque (their subclasses, as
    named tuples, too) or a type registered with pytree (Hugging Face's model outputs are)."""
    return isinstance(x, (tuple, list, dict, collections.deque)) or type(x) in SUPPORTED_NODES


class _PassThrough(torch.autograd.Function):
    """Identity on ``tensors``; its backward calls ``callback()`` and passes the gradients on."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def call_after_input_grads(callback: Callable[[], None], args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Route every tensor in ``(args, kwargs)`` that requires grad through one identity node.

    Returns ``(args, kwargs, hooked)``: the inputs to call the module with (the same nesting)
    and whether any tensor was routed. ``callback()`` runs once per backward through them,
    when the gradients w.r.t. all routed tensors exist. With no tensor requiring grad the
    inputs come back unchanged and ``callback`` never runs.
    """
    if not any(map(_may_hold_tensors, (*args, *kwargs.values()))):
        # No containers (a block's usual call): no pytree, whose flatten makes a reference
        # cycle (a recursive closure) at every call, garbage for the collector.
        flat, spec = [*args, *kwargs.values()], None
    else:
        flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not positions:
        return args, kwargs, False
    routed = _PassThrough.apply(callback, *(flat[i] for i in positions))
    for i, tensor in zip(positions, routed):
        flat[i] = tensor
    if spec is None:
        args, kwargs = tuple(flat[:len(args)]), dict(zip(kwargs, flat[len(args):]))
    else:
        args, kwargs = tree_unflatten(flat, spec)
    return args, kwargs, True
