"""``MemoryTracker(source="allocator")``: the same ledger, fed by the allocators' own reports.

The default tracker (``memory.tracker``) is a ``TorchDispatchMode``: Python runs for every op,
a fixed cost per op that makes a step of a small-op model 1.3x to 1.8x slower on CPU. Here the
allocators report every allocation and free to a log in C++ (``allocation_log.cpp``, compiled at
first use), with no Python per allocation. Python stamps only the few events that give storages
their roles, each with the log's length at that moment: a tensor saved for backward and its
release, a gradient accumulated, the optimizer's step, a tag or ``tag_scope``, a storage
resized, a phase boundary. Reading a result replays the log and the stamps in order into the
same ``StorageLedger``, keyed by address instead of by storage, so the category rules and the
peak's bookkeeping are the dispatch tracker's.

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
- the log hears the thread that entered the tracker and the threads that inherit its context
  (autograd's); another thread's allocations and frees (a communication library's workers) are
  not heard, except for storages registered from Python (the model's, tagged ones), which are
  watched by weak reference;
- fake tensors allocate nothing, so there is nothing to log (refused: use dispatch);
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
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fsdp_lab.memory import allocation_log, tags
from fsdp_lab.memory.ledger import SAVED_BECOME_ACTIVATIONS, _Info
from fsdp_lab.memory.tracker_base import TrackerBase, _is_plain, _plain_tensors, _state_tensors


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NO_STAMP = float("inf")


class _Record:
    """A live allocation in the replay: what ``_Info`` is to the dispatch tracker, without the
    weak reference (the log says when it is freed)."""

    __slots__ = ("key", "nbytes", "base", "saved")
    category = _Info.category

    def __init__(self, key: int, nbytes: int, base: str):
        self.key, self.nbytes, self.base, self.saved = key, nbytes, base, 0


class _Stamped:
    """A tensor held by autograd for backward; its death is stamped into the log's order."""

    __slots__ = ("tensor", "token", "stamps", "position")

    def __init__(self, tensor, token, stamps, position):
        self.tensor, self.token, self.stamps, self.position = tensor, token, stamps, position

    def __del__(self):
        self.stamps.append((self.position(), "release", self.token))


class AllocatorTracker(TrackerBase):
    """``MemoryTracker`` measured from the allocators' reports; made by
    ``MemoryTracker(..., source="allocator")`` (same arguments, same results; ``TrackerBase``).

    Raises RuntimeError when the C++ log cannot be built (names the fix) or another allocator
    tracker is running; ValueError under ``FakeTensorMode``.
    """

    # ---- feeding the ledger ------------------------------------------------------------

    def _reset(self) -> None:
        super()._reset()
        self._log = None
        self._running = False
        self._taken = 0  # log reports replayed so far
        self._stamps: list[tuple] = []
        self._stamp_index = 0  # stamps replayed so far
        self._saved_by_token: dict[int, _Record] = {}
        self._tokens = 0
        self._scope: str | None = None
        self._next_alloc_base: str | None = None
        self._never_saved: set[int] = set()
        self._roles: dict[int, tuple] = {}  # storage -> (watch, address, role) last stamped
        # Storages registered from Python are watched by weak reference: on CPU the allocator
        # cannot report freeing a block allocated before the log started (it never learnt its
        # size), so a storage from before tracking is seen to die this way. A watch is known by
        # its id(); ``_watches`` keeps each alive, ``_watched`` is the record it follows.
        self._watches: dict[int, weakref.ref] = {}
        self._watched: dict[int, _Record] = {}
        self._inputs: list[tuple[int, int, int]] = []  # (address, bytes, watch) of the forward's inputs

    def _stamp(self, *event) -> None:
        """Record an event at the log's current length; before or after the log runs, apply it."""
        if self._running:
            self._stamps.append((self._log.position(), *event))
        else:
            self._apply(event)

    def _watch(self, st) -> int:
        ref = weakref.ref(st, self._stamp_gone)
        self._watches[id(ref)] = ref
        return id(ref)

    def _register(self, key: int, nbytes: int, base: str, watch: int | None = None) -> _Record | None:
        if not key or not nbytes:  # a storage resized to nothing has no address to follow
            return None
        if key in self._live:  # freed where the log could not hear it; the address is reused
            self._free(key)
        record = _Record(key, nbytes, base)
        self._live[key] = record
        self._add(record, nbytes)
        if watch is not None:
            self._watched[watch] = record
        return record

    def _record(self, key: int) -> _Record | None:
        """The record at ``key``; an allocation the replay kept as a plain (bytes, role) pair
        becomes a record the first time a stamp needs it."""
        entry = self._live.get(key)
        if type(entry) is tuple:
            entry = self._live[key] = _Record(key, *entry)
        return entry

    def _free(self, key: int) -> None:
        self._record(key)
        super()._free(key)

    def _set_role(self, key: int, nbytes: int, base: str, watch: int) -> None:
        record = self._record(key)
        if record is None:
            self._register(key, nbytes, base, watch)
        elif record.base != base:
            self._change(record, base=base)

    def _apply(self, event: tuple) -> None:
        kind = event[0]
        if kind == "save":
            _, key, nbytes, token, watch = event
            record = self._record(key) or self._register(key, nbytes, "other", watch)
            if record is not None and record.base in SAVED_BECOME_ACTIVATIONS and key not in self._buffer_keys:
                self._change(record, saved_delta=1)
                self._saved_by_token[token] = record
        elif kind == "release":
            record = self._saved_by_token.pop(event[1], None)
            if record is not None and self._live.get(record.key) is record:
                self._change(record, saved_delta=-1)
        elif kind == "role":
            self._set_role(*event[1:])
        elif kind == "gone":  # a storage registered from Python died
            self._watches.pop(event[1], None)
            record = self._watched.pop(event[1], None)
            if record is not None and self._live.get(record.key) is record:
                self._free(record.key)
        elif kind == "seen":  # a model input: counts as ``other`` if nothing claimed it yet
            record = self._record(event[1]) or self._register(event[1], event[2], "other")
            if record is not None:  # (a batch from before tracking: the log will not see it freed)
                self._watched[event[3]] = record
        elif kind == "mark":
            self._label = event[1]
            self._timeline.append((event[1], dict(self._totals)))
        elif kind == "scope":
            self._scope = event[1]
        elif kind == "resize_from":  # the allocation a resize makes keeps the storage's role
            _, key, size, tag = event
            record = self._record(key)
            self._next_alloc_base = (tag or (record.base if record is not None else None)) if size else None
        elif kind == "resize_to":
            self._next_alloc_base = None

    def _catch_up(self) -> None:
        """Replay the reports and stamps logged since the last call.

        The loop is ``StorageLedger._add``/``_free`` written out, with the running totals in local
        variables (handed back to the ledger around each stamp), since it runs once per report:
        a few thousand a step."""
        if not self._running:
            return
        addresses, deltas = self._log.take(self._taken)
        stamps, index, position = self._stamps, self._stamp_index, self._taken
        live, totals, maxes, temps = self._live, self._totals, self._max, self._temps
        total, peak_total, at_peak = self._total, self._peak_total, self._at_peak
        next_stamp = stamps[index][0] if index < len(stamps) else _NO_STAMP
        default, pending = self._scope or "temporaries", self._next_alloc_base
        for address, delta in zip(addresses, deltas):
            if next_stamp <= position:  # a stamp at position p came just before report p
                self._total, self._peak_total, self._at_peak = total, peak_total, at_peak
                while index < len(stamps) and stamps[index][0] <= position:
                    self._apply(stamps[index][1:])
                    index += 1
                total, peak_total, at_peak = self._total, self._peak_total, self._at_peak
                next_stamp = stamps[index][0] if index < len(stamps) else _NO_STAMP
                default, pending = self._scope or "temporaries", self._next_alloc_base
            position += 1
            if delta < 0:
                entry = live.pop(address, None)
                if entry is not None:
                    if at_peak:
                        self._copy_peak()
                        at_peak = False
                    nbytes, category = entry if type(entry) is tuple else (entry.nbytes, entry.category)
                    totals[category] -= nbytes
                    total -= nbytes
                    temps.discard(address)
                    self._peak_temps.discard(address)
                continue
            base = default
            if pending is not None:  # the allocation a resize made: the storage's own role
                base = pending
                pending = self._next_alloc_base = None
            if address in live:  # freed where the log could not hear it; the address is reused
                self._total, self._peak_total, self._at_peak = total, peak_total, at_peak
                self._free(address)
                total, at_peak = self._total, self._at_peak
            live[address] = (delta, base)  # a record only if a stamp needs one (``_record``)
            totals[base] += delta
            if totals[base] > maxes[base]:
                maxes[base] = totals[base]
            if base == "temporaries":
                temps.add(address)
            total += delta
            if total > peak_total:
                peak_total, at_peak = total, True
                self._peak_label = self._label
        self._total, self._peak_total, self._at_peak = total, peak_total, at_peak
        while index < len(stamps) and stamps[index][0] <= position:
            self._apply(stamps[index][1:])
            index += 1
        self._taken, self._stamp_index = position, index

    # ---- what TrackerBase's hooks call -------------------------------------------------

    @staticmethod
    def _key_of(storage) -> int:
        return storage.data_ptr()

    def _see_storage(self, st, base: str | None, look_up_tag: bool = True):
        tagged = tags.category_of(st) if look_up_tag and tags._tags else None
        self._stamp_role(st, tagged or base or "temporaries")

    def _stamp_role(self, st, base: str) -> None:
        """``st`` plays ``base`` from now on. A storage stamped with the same role before and still
        alive is skipped (the optimizer's state is classified at every step's end)."""
        cdata, key = st._cdata, st.data_ptr()
        known = self._roles.get(cdata)
        if known is not None and known[1] == key and known[2] == base and known[0]() is not None:
            return
        watch = self._watch(st)
        self._roles[cdata] = (self._watches[watch], key, base)
        self._stamp("role", key, st.nbytes(), base, watch)

    def _classify(self, tensors, base: str) -> None:
        look_up, on_cpu = bool(tags._tags), self._device_type == "cpu"
        for t in tensors:
            for inner in (t,) if type(t) in _PLAIN else _plain_tensors(t):
                if not (inner.is_cpu if on_cpu else inner.device.type == self._device_type):
                    continue
                st = inner.untyped_storage()
                self._stamp_role(st, (tags.category_of(st) if look_up else None) or base)

    def _on_tag(self, st, category: str) -> None:
        if st.device.type == self._device_type:
            self._stamp_role(st, category)

    def _on_scope(self, category: str | None) -> None:
        self._stamp("scope", category)

    def _mark(self, label: str) -> None:
        if self._active:
            self._stamp("mark", label)

    def _pack(self, t: torch.Tensor):
        if type(t) not in _PLAIN and not _is_plain(t):
            return t
        if not (t.is_cpu if self._device_type == "cpu" else t.device.type == self._device_type):
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._never_saved:  # a parameter or buffer: never an activation
            return t
        self._tokens += 1
        self._stamps.append((self._log.position(), "save", key, st.nbytes(), self._tokens, self._watch(st)))
        # a tensor without grad_fn is kept as it is (no cycle through autograd's graph): no detach
        kept = t.detach() if t.grad_fn is not None else t
        return _Stamped(kept, self._tokens, self._stamps, self._log.position)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if type(packed) is _Stamped else packed

    def _watch_inputs(self) -> None:
        """The model's forward inputs count as ``other`` (the batch), as dispatch counts them."""
        in_backward = torch._C._current_graph_task_id

        def before(module, args, kwargs):
            if in_backward() == -1:
                self._inputs = [(st.data_ptr(), st.nbytes(), self._watch(st)) for t in _tensors_in((args, kwargs))
                                if _is_plain(t) and t.device.type == self._device_type
                                for st in (t.untyped_storage(),)]

        def after(module, args, kwargs, output):
            if in_backward() == -1:
                for key, nbytes, watch in self._inputs:
                    self._stamp("seen", key, nbytes, watch)
                self._inputs = []

        self._handles.append(self.model.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(after, with_kwargs=True))

    # ---- context manager ---------------------------------------------------------------

    def __enter__(self):
        if any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack()):
            raise ValueError("MemoryTracker(source='allocator') under FakeTensorMode: fake tensors allocate "
                             "nothing, so the allocator reports nothing; use source='dispatch' (the default)")
        log = allocation_log.load()
        self._reset()
        self._log = log
        stamps, position = self._stamps, log.position

        def stamp_gone(ref):  # (holds the stamps, not the tracker: no cycle through the storage)
            stamps.append((position(), "gone", id(ref)))
        self._stamp_gone = stamp_gone
        self._active = True
        self._register_existing()
        if self.model is not None:  # a parameter or buffer saved for backward stays what it is
            self._never_saved = self._buffer_keys | {p.untyped_storage().data_ptr() for p in self._params
                                                     if _is_plain(p) and p.device.type == self._device_type}
        self._install_hooks()
        if self.model is not None:
            self._watch_inputs()
        try:
            log.start(self._device_type)
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
                tracker._stamp("resize_from", storage.data_ptr(), int(size), tag)
                result = orig(storage, size)
                tracker._stamp("resize_to")
                return result
            return resize_

        self._hook_in(wrap_resize)
        self._stamp("scope", tags.current_scope())
        self._mark("start")
        return self

    def __exit__(self, *exc):
        try:
            self._catch_up()
        finally:
            self._running = False
            self._log.stop()
            self._unhook(exc)
        self._finish()
        # results are final: drop the watches (no more stamps) and what the replay kept
        for kept in (self._stamps, self._watches, self._watched, self._roles, self._saved_by_token):
            kept.clear()
        return False

    # ---- results: replay what was logged so far first ----------------------------------

    def peak(self) -> dict[str, int]:
        self._catch_up()
        return super().peak()

    def peak_total(self) -> int:
        self._catch_up()
        return super().peak_total()

    def current(self) -> dict[str, int]:
        self._catch_up()
        return super().current()

    def max_by_category(self) -> dict[str, int]:
        self._catch_up()
        return super().max_by_category()

    def live_bytes(self) -> int:
        self._catch_up()
        return sum(entry[0] if type(entry) is tuple else entry.nbytes for entry in list(self._live.values()))

    def timeline(self) -> list[tuple[str, dict[str, int]]]:
        self._catch_up()
        return super().timeline()


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
