"""Memory tags: how the FSDP implementations tell the memory tracker what a tensor is.

Every byte the tracker sees lives in a storage (``tensor.untyped_storage()``). FSDP code
knows what it allocates (a sharded parameter, an all-gather output, a reduce-scatter
input) while the tracker only sees allocations, so the code that allocates calls
``tag(tensor, "comm_buffers")`` and the tracker looks the storage up with ``category_of``.

Tags are keyed by storage identity and held weakly: when the storage dies the tag goes
with it, and a storage shared by several views carries one tag. A later ``tag`` call on
the same storage overrides the earlier one (a buffer can change role, e.g. the unsharded
parameter that an all-gather output becomes).

A ``MemoryTracker`` that is running hears every ``tag`` call at once (``add_listener``), so a
storage is counted in its new role from the moment it is tagged, not from the next phase boundary.

``tag_scope(category)`` sets a default category for storages *allocated* inside the
``with`` block that nobody tagged explicitly; the tracker reads it with ``current_scope`` (the
allocator-fed tracker also hears each change, through the ``on_scope`` of its listener).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

# The one list of category names: the tracker, the estimator, plots, widgets and docs use these.
CATEGORIES: tuple[str, ...] = (
    "params",            # parameters of a model that is not sharded
    "sharded_params",    # this rank's shard of FSDP parameters (and fp32 masters)
    "unsharded_params",  # parameters gathered for compute (all-gather output viewed as params)
    "grads",             # gradients of a model that is not sharded
    "sharded_grads",     # this rank's shard of reduced gradients
    "unsharded_grads",   # full-size gradients produced by backward before reduce-scatter
    "optimizer_state",   # e.g. AdamW's exp_avg, exp_avg_sq, step
    "activations",       # tensors saved by autograd for backward
    "temporaries",       # short-lived results freed within the phase that made them
    "comm_buffers",      # all-gather inputs/outputs and reduce-scatter inputs held alive
    "quantized",         # NF4 packed codes and scales
    "other",             # anything else (buffers, RoPE tables, data)
)

_tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
_scope = threading.local()
_open_scopes = 0  # tag_scope blocks open in any thread
# (on_tag, on_scope) of each listener; on_scope may be None
_listeners: list[tuple[Callable[[torch.UntypedStorage, str], None], Callable[[str | None], None] | None]] = []


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(
            f"unknown memory category {category!r}; use one of: {', '.join(CATEGORIES)}"
        )


def tag(tensor: torch.Tensor, category: str) -> torch.Tensor:
    """Mark the storage behind ``tensor`` as belonging to ``category``; returns ``tensor``.

    Tensor subclasses that wrap inner tensors (DTensor, NF4Tensor) are tagged through
    their inner tensors. Raises ValueError for a category not in ``CATEGORIES``, TypeError when
    ``tensor`` is not a tensor.
    """
    _check_category(category)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tag() marks a tensor's storage; got {type(tensor).__name__}")
    for storage in _storages(tensor):
        _tags[storage] = category
        for on_tag, _ in _listeners:
            on_tag(storage, category)
    return tensor


def untag(tensor: torch.Tensor) -> None:
    """Forget the tag of every storage behind ``tensor`` (no error if none). A running tracker
    counts such a storage from then on as one allocated now without a tag (``temporaries``, or
    the open ``tag_scope``'s category)."""
    for storage in _storages(tensor):
        if _tags.pop(storage, None) is not None:
            for on_tag, _ in _listeners:
                on_tag(storage, None)


def add_listener(on_tag: Callable[[torch.UntypedStorage, str | None], None],
                 on_scope: Callable[[str | None], None] | None = None) -> None:
    """Until ``remove_listener(on_tag)``: call ``on_tag(storage, category)`` on every later ``tag``
    (``on_tag(storage, None)`` on an ``untag`` that removed one),
    and ``on_scope(category)``, when given, with the innermost ``tag_scope`` category (None
    outside any) each time a ``tag_scope`` block opens or closes."""
    _listeners.append((on_tag, on_scope))


def listened() -> bool:
    """Whether a listener (a running tracker) hears tags now: code on a hot path may tag only then."""
    return bool(_listeners)


def remove_listener(on_tag: Callable[[torch.UntypedStorage, str], None]) -> None:
    """Stop calling the listener added with ``on_tag`` (no error if it was not added)."""
    _listeners[:] = [pair for pair in _listeners if pair[0] != on_tag]


def _tell_scope(category: str | None) -> None:
    for _, on_scope in _listeners:
        if on_scope is not None:
            on_scope(category)


def category_of(storage: torch.UntypedStorage) -> str | None:
    """The category a storage was tagged with, or None if it was never tagged."""
    return _tags.get(storage)


@contextlib.contextmanager
def tag_scope(category: str) -> Iterator[None]:
    """Within the block, storages allocated and not tagged explicitly default to ``category``."""
    global _open_scopes
    _check_category(category)
    stack = _scope.__dict__.setdefault("stack", [])
    stack.append(category)
    _open_scopes += 1
    _tell_scope(category)
    try:
        yield
    finally:
        _open_scopes -= 1
        stack.pop()
        _tell_scope(stack[-1] if stack else None)


def current_scope() -> str | None:
    """The innermost ``tag_scope`` category of this thread, or None."""
    if not _open_scopes:  # asked once per new storage while tracking: the common answer is cheap
        return None
    stack = getattr(_scope, "stack", None)
    return stack[-1] if stack else None


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor, looking through wrapper subclasses."""
    if hasattr(tensor, "__tensor_flatten__"):
        inner_names, _ = tensor.__tensor_flatten__()
        found: list[torch.UntypedStorage] = []
        for name in inner_names:
            found.extend(_storages(getattr(tensor, name)))
        return found
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]
