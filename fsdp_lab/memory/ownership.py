"""Which storages belong to a model: those reachable from it (and its optimizer) by strong references.

Tags (``memory.tags``) say what a storage *is*; they do not say *whose* it is. A model that was
dropped but is still held by a reference cycle, or another model alive in the same process,
has tagged storages too. ``MemoryTracker`` counts a storage that existed before it started
only if the tracked model or optimizer reaches it, so a measurement reads the same after other
models were built and dropped as in a fresh process.

The walk follows what an object holds strongly: attributes, containers, a tensor's ``.grad``
and the inner tensors of wrapper subclasses (DTensor, NF4), bound methods' ``__self__`` and
closure cells. It never enters modules, classes or a function's globals (from there everything
in the process is reachable) and, like the garbage collector, it does not follow weak references.
"""

from __future__ import annotations

import gc
import types
from typing import Iterable

import torch

# objects whose references lead out of the model into the whole process
_OPAQUE = (type, types.ModuleType, types.CodeType, types.FrameType, types.BuiltinFunctionType,
           str, bytes, int, float, complex, bool, type(None))


def reachable_storage_ids(roots: Iterable[object]) -> set[int]:
    """``_cdata`` of every tensor storage reachable from ``roots`` by strong references.

    ``_cdata`` identifies a storage only while it lives: use the result at once.
    """
    found: set[int] = set()
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            stack.extend(_tensor_referents(obj, found))
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            if obj.__defaults__:
                stack.extend(obj.__defaults__)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        else:
            stack.extend(gc.get_referents(obj))
    return found


def _tensor_referents(t: torch.Tensor, found: set[int]) -> list[object]:
    """Record ``t``'s own storage (plain tensors) and return what else it holds."""
    more: list[object] = []
    if hasattr(type(t), "__tensor_flatten__"):  # a wrapper: its bytes are in its inner tensors
        names, _ = t.__tensor_flatten__()
        more.extend(getattr(t, name) for name in names)
    elif t.device.type != "meta":
        try:
            found.add(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):  # sparse or nested: no single storage
            pass
    if t.is_leaf and t.grad is not None:  # .grad of a non-leaf warns and is rarely kept
        more.append(t.grad)
    more.append(getattr(t, "__dict__", None))
    return more


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True
