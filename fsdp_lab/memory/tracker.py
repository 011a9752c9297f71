"""MemoryTracker: where the bytes of one training step go, measured from tensor storages.

Every tensor's bytes live in a storage (``tensor.untyped_storage()``); views share it. The
tracker is a ``TorchDispatchMode``: each op's outputs (and any input it has not seen) are
looked up by storage, so each storage is counted once, and a weak reference on the storage
object removes its bytes the moment the storage dies. ``UntypedStorage.resize_`` (how FSDP
frees and refills unsharded parameters) bypasses dispatch, so it is patched while tracking.
Nothing here asks the allocator, which is why it works on CPU, on CUDA and on fake tensors.

What existed before tracking started counts only if the tracked model or optimizer holds it
(``memory.ownership``): storages of a model dropped earlier but not yet collected, or of
another live model, never count, so a run reads the same as in a fresh process.

A storage's category, strongest first:

1. an explicit tag (``fsdp_lab.memory.tags.tag``), from the moment it is set;
2. ``params``: the model's parameters; ``grads``: their ``.grad``; ``optimizer_state``: the
   tensors in ``optimizer.state``;
3. ``activations``: saved for backward (seen by ``saved_tensors_hooks``) while still saved,
   whether allocated in the step or before it (the batch's input ids and labels), except the
   model's buffers;
4. ``other``: storages that existed before tracking started (buffers, the batch);
5. ``temporaries``: everything else allocated while tracking, or the ``tag_scope`` default.

A storage that is a temporary at the moment of the peak and becomes a gradient, an optimizer
state, an activation or a tagged buffer right after (the op that allocates a gradient
returns before autograd stores it in ``.grad``) is counted in its final role in ``peak()``.

The bookkeeping (records, totals, peak) is ``memory.ledger.StorageLedger``; this module feeds it.
What it shares with the allocator-fed tracker (``source="allocator"``, ``memory.allocator_tracker``)
is ``memory.tracker_base.TrackerBase``: the hooks on the model and optimizer, and the results.
"""

from __future__ import annotations

import abc
from typing import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from fsdp_lab.memory import tags
from fsdp_lab.memory.allocator_tracker import AllocatorTracker
from fsdp_lab.memory.results import MemoryResult, format_rows, merge_ranks  # noqa: F401
from fsdp_lab.memory.ledger import SAVED_BECOME_ACTIVATIONS
from fsdp_lab.memory.tracker_base import TrackerBase, _is_plain, _plain_tensors, _tagged

# ops after which a known storage may have changed size
_RESIZING_OPS = {torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage,
                 torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.source_Tensor}
# tensor types that wrap inner tensors (DTensor, NF4): the tracker sees their inner ops instead
_WRAPPER_TYPES: dict[type, bool] = {}
# ops whose output is a view of their input: nothing new to count
_PASSTHROUGH_OPS = {torch.ops.aten.detach.default}



class _Saved:
    """A tensor held by autograd for backward; its death tells the tracker it was released."""

    __slots__ = ("tensor", "info", "tracker")

    def __init__(self, tensor, info, tracker):
        self.tensor, self.info, self.tracker = tensor, info, tracker

    def __del__(self):
        tracker = self.tracker
        # the info may belong to an earlier run of the tracker (it resets on enter)
        if tracker is not None and tracker._live.get(self.info.key) is self.info:
            tracker._change(self.info, saved_delta=-1)


class MemoryTracker(TrackerBase, TorchDispatchMode, metaclass=abc.ABCMeta):
    """Measure memory by category over one (or a few) training steps.

        with MemoryTracker(model, optimizer) as mt:
            model(batch).loss.backward(); optimizer.step()
        mt.peak(); mt.current(); mt.timeline(); mt.result()

    Args:
        model: the module whose parameters (and ``.grad``) are ``params``/``grads``; its
            children and the elements of its ModuleLists (``layers.0`` ...) mark phase
            boundaries in forward and backward. May be None.
        optimizer: its ``state`` tensors are ``optimizer_state``; its ``step`` is a phase.
        device: count only storages on this device (default: the model's parameter device,
            else cpu). Fake tensors count as the device they pretend to be on.
        phase_modules: names of submodules that mark phases (default: see ``model``).
        source: "dispatch" (default): every op seen from Python, on any device and on fake
            tensors; "allocator": the allocators' reports booked in C++ as they come, about 1.05x
            a small CPU step where dispatch costs 1.3x to 1.8x, but it compiles a C++ extension at
            first use and sees a few things differently (``memory.allocator_tracker`` lists them).

    Raises ValueError for a ``phase_modules`` name the model does not have, an unknown
    ``source``, or a CUDA ``device`` when this process sees no GPU; RuntimeError when entered
    while it is running already (make a second tracker to nest).
    """

    def __new__(cls, *args, source: str = "dispatch", **kwargs):
        if source not in ("dispatch", "allocator"):
            raise ValueError(f"MemoryTracker(source={source!r}): use 'dispatch' (the default: any device, "
                             "fake tensors) or 'allocator' (cheaper; compiles a C++ extension at first use)")
        if source == "allocator" and cls is MemoryTracker:
            # a TrackerBase, not a subclass (so __init__ is not called again): registered below
            return AllocatorTracker(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args, source: str = "dispatch", **kwargs):
        super().__init__(*args, **kwargs)

    # ---- bookkeeping -------------------------------------------------------------------

    def _classify(self, tensors: Iterable[torch.Tensor], base: str) -> None:
        """Register or move the storages of ``tensors`` to ``base`` (explicit tags still win)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for inner in _plain_tensors(t):
                info = self._see(inner, base)
                if info is not None and info.base != base and not _tagged(inner):
                    self._change(info, base=base)

    def _on_tag(self, st, category: str | None) -> None:
        """A storage was tagged (``category``) or untagged (None) while tracking: count it in
        its new role from now on (untagged: as a storage allocated now without a tag)."""
        if not self._tracks(st):
            return
        category = category or tags.current_scope() or "temporaries"
        info = self._live.get(st._cdata)
        if info is None:
            self._see_storage(st, category)
        elif info.base != category:
            self._change(info, base=category)

    # ---- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        # a storage no op has shown yet existed before tracking (the batch's input ids, which the
        # embedding saves before any op reads them): ``other``, as an op's unseen input would be
        info = self._see(t, "other") if _is_plain(t) else None
        counts = info is not None and info.base in SAVED_BECOME_ACTIVATIONS and info.key not in self._buffer_keys
        if not counts:
            if info is None or t.grad_fn is None:
                # a tensor without grad_fn can be kept as it is (no cycle through autograd's
                # graph), sparing a detach per save
                return t
            return _Saved(t.detach(), info, None)
        self._change(info, saved_delta=1)
        return _Saved(t.detach(), info, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    # ---- context manager ---------------------------------------------------------------

    def __enter__(self):
        self._check_not_running()
        self._reset()
        self._active = True
        self._ran = True
        # fake tensors are the measurement when the caller runs under FakeTensorMode; otherwise
        # they are some library's internal tracing and hold no memory
        self._count_fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        self._register_existing()
        self._install_hooks()
        tracker = self

        def wrap_resize(orig):
            def resize_(storage, size):
                result = orig(storage, size)
                tracker._resized(storage)
                return result
            return resize_

        self._hook_in(wrap_resize)
        self._mark("start")
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._unhook(exc)
        self._finish()
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let tensor subclasses (DTensor, NF4) unwrap first; their inner ops come back here.
        for t in types:
            wrapper = _WRAPPER_TYPES.get(t)
            if wrapper is None:
                wrapper = _WRAPPER_TYPES[t] = hasattr(t, "__tensor_flatten__")
            if wrapper:
                return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in _PASSTHROUGH_OPS:
            return out
        see, live = self._see, self._live
        for a in args:  # a storage unknown here existed before tracking (the batch, ...)
            if isinstance(a, torch.Tensor):
                try:
                    known = a.untyped_storage()._cdata in live
                except (RuntimeError, NotImplementedError):  # sparse, nested: nothing to count
                    known = True
                if not known:
                    see(a, "other")
            elif type(a) in (list, tuple):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        see(x, "other")
        if isinstance(out, torch.Tensor):
            see(out, None, True)
        elif type(out) in (list, tuple):
            for x in out:
                if isinstance(x, torch.Tensor):
                    see(x, None, True)
        if func in _RESIZING_OPS:
            self._resized(args[0].untyped_storage())
        return out


# What MemoryTracker(..., source="allocator") returns: a MemoryTracker to isinstance too.
MemoryTracker.register(AllocatorTracker)
