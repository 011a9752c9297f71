"""``MemoryTracker(source="allocator")``: the same bookkeeping, fed by the allocators' own reports.

The default tracker (``memory.tracker``) is a ``TorchDispatchMode``: Python runs for every op,
a fixed cost per op that makes a step of a small-op model 1.3x to 1.8x slower on CPU. Here the
allocators report every allocation and free to a ledger in C++ (``allocation_log.cpp``, compiled
at first use), which books it at once, with no Python per allocation. Python tells the ledger
only the few events that give storages their roles, as they happen: a tensor saved for backward
and its release, a gradient accumulated, the optimizer's step, a tag or ``tag_scope``, a storage
resized, a storage registered from Python that died, a phase boundary. The ledger keeps
``StorageLedger``'s rules (``memory.ledger``), keyed by address instead of by storage, so the
categories and the peak's breakdown are the dispatch tracker's; results are read from it.

Where the two sources differ:

- a storage that existed before tracking counts if the tracked model or optimizer holds it, or if
  it is passed to the model's forward (the batch), or saved for backward; dispatch also counts any
  other pre-existing tensor an op reads (a lookup table the data loader keeps, say). A model input
  that nothing saves counts from the end of the forward (dispatch: from the first op reading it);
- memory an op allocates inside itself (a kernel's workspace, a scalar it wraps into a tensor,
  gloo's collective buffers) is seen here, as ``temporaries``, and not by dispatch. On gloo, how
  long those buffers live depends on the other ranks' timing, so a sharded step's peak moves from
  step to step here (by up to a tenth on the workshop's model at 2 ranks), as PyTorch's profiler's
  does, where dispatch's does not;
- the ledger hears the thread that entered the tracker and the threads that inherit its context
  (autograd's); another thread's allocations and frees (a communication library's workers) are
  not heard, except for storages it first learns of from Python (the model's and the optimizer's
  from before tracking, tagged ones), which are watched by weak reference;
- fake tensors allocate nothing, so there is nothing to hear (refused: use dispatch);
- results are frozen when the tracker exits (dispatch keeps following frees after it);
- one allocator tracker at a time in a process, and not together with PyTorch's profiler, which
  records memory from the same hook: each refuses to start while the other runs on the thread
  (with torch 2.6 and 2.11, not 2.13, a profiler refused so cannot start again in that process:
  torch leaves its trace half-prepared).
  On CPU, PyTorch logs once per process "Memory block of unknown size was allocated before the
  profiling started": a storage from before the tracker was freed; the tracker follows those
  itself.
"""

from __future__ import annotations

import collections.abc
import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fsdp_lab.memory import allocation_log, tags
from fsdp_lab.memory.tracker_base import TrackerBase, _is_plain, _plain_tensors, _state_tensors


class AllocatorTracker(TrackerBase):
    """``MemoryTracker`` measured from the allocators' reports; made by
    ``MemoryTracker(..., source="allocator")`` (same arguments, same results; ``TrackerBase``).

    Raises RuntimeError when the C++ ledger cannot be built (names the fix) or another allocator
    tracker is running; ValueError under ``FakeTensorMode``.
    """

    # ---- telling the ledger --------------------------------------------------------------
    # A storage the ledger first learns of from Python (it did not hear it allocated) is watched
    # by weak reference from then on: on CPU the allocator cannot report freeing a block allocated
    # before the ledger started (it never learnt its size), and another thread's frees are not heard.

    def _reset(self) -> None:
        super()._reset()
        self._ledger = None
        self._running = False
        self._final = False  # the results were copied from the ledger after it froze
        self._inputs: list = []  # the storages of the forward's inputs

    @staticmethod
    def _key_of(storage) -> int:
        return storage.data_ptr()

    def _see_storage(self, st, base: str | None, look_up_tag: bool = True):
        tagged = tags.category_of(st) if look_up_tag and tags._tags else None
        self._stamp_role(st, tagged or base or "temporaries")

    def _stamp_role(self, st, base: str) -> None:
        """``st`` plays ``base`` from now on."""
        self._ledger.role(st, st.data_ptr(), st.nbytes(), base)

    def _classify(self, tensors, base: str) -> None:
        category_of = tags.category_of if tags._tags else None
        for wrapper in self._ledger.roles(tensors, base, category_of):  # (books the plain ones itself)
            self._ledger.roles(_plain_tensors(wrapper), base, category_of, subclasses=True)

    def _on_tag(self, st, category: str | None) -> None:
        if st.device.type == self._device_type:
            self._stamp_role(st, category or tags.current_scope() or "temporaries")

    def _on_scope(self, category: str | None) -> None:
        self._ledger.scope(category)

    def _mark(self, label: str) -> None:
        if self._active:
            self._ledger.mark(label)

    def _watch_inputs(self) -> None:
        """The model's forward inputs count as ``other`` (the batch), as dispatch counts them."""
        in_backward = torch._C._current_graph_task_id

        def before(module, args, kwargs):
            if in_backward() == -1:
                self._inputs = [t.untyped_storage() for t in _tensors_in((args, kwargs))
                                if _is_plain(t) and t.device.type == self._device_type]

        def after(module, args, kwargs, output):
            if in_backward() == -1:
                for st in self._inputs:  # (a batch from before tracking: its free is not heard)
                    self._ledger.seen(st, st.data_ptr(), st.nbytes())
                self._inputs = []

        self._handles.append(self.model.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(after, with_kwargs=True))

    # ---- context manager ---------------------------------------------------------------

    def __enter__(self):
        self._check_not_running()
        if any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack()):
            raise ValueError("MemoryTracker(source='allocator') under FakeTensorMode: fake tensors allocate "
                             "nothing, so the allocator reports nothing; use source='dispatch' (the default)")
        ledger = allocation_log.new_ledger(self._device_type)
        self._reset()
        self._ledger = ledger
        self._ran = True
        # autograd's saved-tensor hooks call the ledger directly: no Python per saved tensor
        self._pack, self._unpack = ledger.pack, ledger.unpack
        self._active = True
        self._register_existing()
        if self.model is not None:  # a parameter or buffer saved for backward stays what it is
            ledger.never_save(list(self._buffer_keys) + [p.untyped_storage().data_ptr() for p in self._params
                                                         if _is_plain(p) and p.device.type == self._device_type])
        self._install_hooks()
        if self.model is not None:
            self._watch_inputs()
        try:
            ledger.start()
        except RuntimeError as error:
            for handle in self._handles:
                handle.remove()
            self._handles, self._active = [], False
            raise RuntimeError(f"MemoryTracker(source='allocator') cannot start: {error}; or use "
                               "source='dispatch'") from None
        self._running = True
        tracker, device_type = self, self._device_type

        def wrap_resize(orig):
            def resize_(storage, size):
                if not tracker._running or storage.device.type != device_type:
                    return orig(storage, size)
                tag = tags.category_of(storage) if tags._tags else None
                ledger.resize_from(storage.data_ptr(), int(size), tag)
                result = orig(storage, size)
                ledger.resize_to()
                return result
            return resize_

        self._hook_in(wrap_resize)
        ledger.scope(tags.current_scope())
        self._mark("start")
        return self

    def __exit__(self, *exc):
        try:
            self._running = False
            self._ledger.stop()
        finally:
            self._unhook(exc)
        self._finish()
        # results are final: nothing booked after this (a saved tensor released later, a watched
        # storage dying), and the watches are dropped
        self._ledger.freeze()
        self._copy_results()
        self._final = True
        return False

    # ---- results: copied from the ledger into ``StorageLedger``'s fields ----------------

    def _copy_results(self) -> None:
        """Bring the results ``TrackerBase`` reads up to the ledger's (once final, no more)."""
        if self._ledger is None or self._final:
            return
        booked = self._ledger.results()
        self._peak_totals, self._at_peak = booked["peak"], False
        self._peak_total, self._peak_label = booked["peak_total"], booked["peak_label"]
        self._totals, self._max = booked["current"], booked["max_by_category"]
        self._timeline = booked["timeline"]

    def _category_at(self, address: int) -> str | None:
        """The category the ledger gives the live allocation at ``address`` now (None: none there)."""
        return self._ledger.category_at(address)

    def _before_results(self) -> None:
        super()._before_results()
        self._copy_results()

    def peak_total(self) -> int:
        if self._ledger is not None and not self._final:  # (asked on CUDA as the tracker exits)
            return self._ledger.peak_total()
        return super().peak_total()

    def live_bytes(self) -> int:
        return self._ledger.live_bytes() if self._ledger is not None else 0



def _tensors_in(obj, depth: int = 0):
    """Tensors in nested lists, tuples, mappings and dataclasses (a batch object), a few levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 3:
        return
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, collections.abc.Mapping):
        items = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return
    for item in items:
        yield from _tensors_in(item, depth + 1)
