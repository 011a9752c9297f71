"""Which submodules become their own FSDP unit (PyTorch's ``torch.distributed.fsdp.wrap``).

A *unit* is the granularity of communication: one flat parameter (per dtype/requires_grad),
one all-gather in forward, one in backward, one reduce-scatter. Smaller units mean a lower
peak (fewer parameters gathered at once) and more, smaller collectives.

A policy is called as ``policy(module, recurse, nonwrapped_numel)``, PyTorch's contract (so
PyTorch's own policies work here): with ``recurse=True`` it answers "should I look inside this
module's children?" and ``nonwrapped_numel`` counts every parameter of the module's subtree not
already in a unit or ignored; with ``recurse=False`` "should this module be wrapped?" and it
counts what its wrapped children left. ``recursive_wrap`` walks bottom-up, so inner units are
made before the units that contain them.
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
    """Replace, bottom-up, each child of ``module`` that ``policy`` selects with ``wrap(child)``.

    ``module`` itself is not wrapped here (the caller wraps the root). Returns the number of
    parameters of ``module`` left unwrapped. Ignored modules and already wrapped units are
    skipped (their parameters do not count).
    """
    if module in ignored or is_wrapped(module):
        return 0
    subtree = _unwrapped_numel(module, ignored, is_wrapped)
    if not policy(module, True, subtree):
        return subtree
    nonwrapped = sum(p.numel() for p in module.parameters(recurse=False))
    for name, child in list(module.named_children()):
        if child in ignored or is_wrapped(child):
            continue
        child_nonwrapped = recursive_wrap(child, policy, wrap, ignored, is_wrapped)
        if policy(child, False, child_nonwrapped):
            setattr(module, name, wrap(child))
        else:
            nonwrapped += child_nonwrapped
    return nonwrapped


def _unwrapped_numel(module: nn.Module, ignored: set[nn.Module], is_wrapped: Callable[[nn.Module], bool]) -> int:
    """Parameters (each counted once) of ``module``'s subtree outside ignored modules and units."""
    seen: set[int] = set()
    total, stack = 0, [module]
    while stack:
        current = stack.pop()
        for p in current.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        stack += [c for c in current.children() if c not in ignored and not is_wrapped(c)]
    return total
