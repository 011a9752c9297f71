"""Which submodules become their own FSDP unit (PyTorch's ``torch.distributed.fsdp.wrap``).

A *unit* is the granularity of communication: one flat parameter (per dtype/requires_grad),
one all-gather in forward, one in backward, one reduce-scatter. Smaller units mean a lower
peak (fewer parameters gathered at once) and more, smaller collectives.

A policy is called as ``policy(module, recurse, nonwrapped_numel)``, PyTorch's contract (so
PyTorch's own policies work here): with ``recurse=True`` it answers "should I look inside this
module's children?" and ``nonwrapped_numel`` counts every parameter of the module's subtree not
already in a unit or ignored; with ``recurse=False`` "should this module be wrapped?" and it
counts what its wrapped descendants left. A module not looked into is not wrapped either.
``recursive_wrap`` walks bottom-up, so inner units are made before the units that contain them.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (a set of classes); use with
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set | None = None,
                                exclude_wrap_modules: set | None = None) -> bool:
    """Wrap a module once its not-yet-wrapped parameters reach ``min_num_params`` (a count).

    Containers (ModuleList, ModuleDict) are never wrapped themselves (PyTorch's default
    ``exclude_wrap_modules``); ``force_leaf_modules`` are not looked into.
    """
    force_leaf = force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention}
    exclude = exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict}
    if recurse:  # a subtree below the size holds no child that reaches it
        return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(force_leaf))
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(exclude))


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes (PyTorch's ``ModuleWrapPolicy``)."""

    def __init__(self, module_classes: Iterable[type]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes or not all(isinstance(c, type) for c in self.module_classes):
            raise TypeError(f"ModuleWrapPolicy needs a non-empty set of nn.Module classes, got {module_classes!r}")

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({{{', '.join(c.__name__ for c in self.module_classes)}}})"


def recursive_wrap(module: nn.Module, policy: Callable, wrap: Callable[[nn.Module], nn.Module],
                   ignored: set[nn.Module], is_wrapped: Callable[[nn.Module], bool]) -> int:
    """Replace, bottom-up, each descendant of ``module`` that ``policy`` selects with ``wrap(it)``,
    PyTorch's ``_recursive_wrap``: a module is looked into only if ``policy(m, True, n)`` says so
    (``n``: its subtree's parameters not ignored nor in a unit, each counted once), and wrapped
    if ``policy(m, False, n - wrapped below)`` says so; a module not looked into is not wrapped.

    ``module`` itself is not wrapped here (the caller wraps the root). ``ignored``: every module
    of the ignored subtrees (their parameters count for nothing, also where shared). Returns the
    number of parameters wrapped in new units below ``module``.
    """
    ignored_params = {id(p) for m in ignored for p in m.parameters(recurse=False)}
    return _wrap(module, policy, wrap, ignored, ignored_params, is_wrapped, root=True)[1]


def _wrap(module, policy, wrap, ignored, ignored_params, is_wrapped, root=False) -> tuple[nn.Module, int]:
    """(the module, wrapped or not; how many of its parameters are now in units)."""
    if module in ignored or is_wrapped(module):
        return module, 0
    total = _unwrapped_numel(module, ignored_params, is_wrapped)
    if not policy(module, True, total):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        if child in ignored:
            continue
        new_child, count = _wrap(child, policy, wrap, ignored, ignored_params, is_wrapped)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += count
    if not root and policy(module, False, total - wrapped):
        return wrap(module), total
    return module, wrapped


def _unwrapped_numel(module: nn.Module, ignored_params: set[int], is_wrapped: Callable[[nn.Module], bool]) -> int:
    """Parameters (each counted once) of ``module``'s subtree that are neither ignored nor in a unit."""
    seen: set[int] = set()
    total, stack = 0, [module]
    while stack:
        current = stack.pop()
        for p in current.parameters(recurse=False):
            if id(p) not in seen and id(p) not in ignored_params:
                seen.add(id(p))
                total += p.numel()
        stack += [c for c in current.children() if not is_wrapped(c)]
    return total
