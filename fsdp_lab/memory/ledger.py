"""The tracker's ledger: one record per live storage, running totals by category, and the
breakdown at the peak.

``StorageLedger`` holds the bookkeeping of ``MemoryTracker`` (``memory.tracker``), which feeds
it from dispatch and hooks: ``_see`` registers a storage once (by its ``_cdata``), a weak
reference on the storage takes its bytes off when it dies, ``_change`` moves a storage to a new
category, ``_resized`` follows ``UntypedStorage.resize_``. The peak's breakdown is copied only
when the total is about to leave a new high, so an allocation costs O(1). All sizes are bytes.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fsdp_lab.memory import tags
from fsdp_lab.memory.tags import CATEGORIES

# roles that being saved for backward turns into ``activations`` (stronger roles keep theirs)
SAVED_BECOME_ACTIVATIONS = ("temporaries", "other")


class _Info(weakref.ref):
    """What the tracker knows about one live storage; also the weak reference whose callback
    tells the tracker that the storage died (one object per storage keeps tracking cheap)."""

    __slots__ = ("key", "nbytes", "base", "saved", "tracker_ref")

    def __new__(cls, storage, key: int, nbytes: int, base: str, tracker_ref):
        return super().__new__(cls, storage, _storage_died)

    def __init__(self, storage, key: int, nbytes: int, base: str, tracker_ref):
        super().__init__(storage, _storage_died)
        self.key, self.nbytes, self.base, self.saved = key, nbytes, base, 0
        # a weak reference: the callback must not keep the tracker (and all its infos) alive
        self.tracker_ref = tracker_ref

    @property
    def category(self) -> str:
        if self.saved and self.base in SAVED_BECOME_ACTIVATIONS:
            return "activations"
        return self.base


def _storage_died(info: _Info) -> None:
    tracker = info.tracker_ref()
    if tracker is not None:
        tracker._free(info.key)


class StorageLedger:
    """Bytes of live storages by category, their per-category highs, and the peak's breakdown.

    Subclasses set ``_device_type`` (only storages on that device count) and ``_count_fake``
    (whether fake tensors count), and move ``_label`` to name the phase a peak falls in.
    """

    _device_type = "cpu"

    def _reset_ledger(self) -> None:
        self._live: dict[int, _Info] = {}
        self._totals = dict.fromkeys(CATEGORIES, 0)
        self._max = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._temps: set[int] = set()
        self._peak_total = -1
        self._peak_totals = dict(self._totals)
        self._peak_temps: set[int] = set()
        self._peak_label = "start"
        self._at_peak = False  # the running total is the peak and its breakdown is not copied yet
        self._self_ref = weakref.ref(self)
        self._label = "start"
        self._count_fake = False

    def _see(self, t: torch.Tensor, base: str | None, fresh: bool = False) -> _Info | None:
        """Register the storage behind ``t`` if new (category ``base``, or inferred).

        ``fresh``: ``t`` is the output of an op whose inputs were seen already, so a storage
        unknown so far was allocated by that op and cannot carry a tag yet.
        """
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage to count
            return None
        info = self._live.get(st._cdata)
        if info is not None:
            return info
        if t.device.type != self._device_type:  # checked only for new storages: it is slow
            return None
        if not self._count_fake and isinstance(t, FakeTensor):
            return None  # e.g. DTensor propagating shardings on fake tensors: no memory behind them
        return self._see_storage(st, base, look_up_tag=not fresh)

    def _see_storage(self, st, base: str | None, look_up_tag: bool = True) -> _Info:
        key = st._cdata
        info = self._live.get(key)
        if info is not None:
            return info
        tagged = tags.category_of(st) if look_up_tag and tags._tags else None  # the lookup is slow
        base = tagged or base or tags.current_scope() or "temporaries"
        info = _Info(st, key, st.nbytes(), base, self._self_ref)
        self._live[key] = info
        self._add(info, info.nbytes)
        return info

    def _add(self, info: _Info, nbytes: int) -> None:
        cat = info.category
        totals = self._totals
        totals[cat] += nbytes
        if totals[cat] > self._max[cat]:
            self._max[cat] = totals[cat]
        self._total += nbytes
        if cat == "temporaries":
            self._temps.add(info.key)
        if self._total > self._peak_total:
            # copying the breakdown at every new high would cost O(live storages) per
            # allocation; it is copied once, just before the total leaves the peak
            self._peak_total = self._total
            self._peak_label = self._label
            self._at_peak = True

    def _copy_peak(self) -> None:
        """The running breakdown is the peak's: keep a copy before it changes."""
        self._peak_totals = dict(self._totals)
        self._peak_temps = set(self._temps)
        self._at_peak = False

    def _free(self, key: int) -> None:
        info = self._live.pop(key, None)
        if info is None:
            return
        if self._at_peak:
            self._copy_peak()
        self._totals[info.category] -= info.nbytes
        self._total -= info.nbytes
        self._temps.discard(key)
        self._peak_temps.discard(key)  # the address may be reused by a storage that becomes a grad

    def _change(self, info: _Info, base: str | None = None, saved_delta: int = 0) -> None:
        """Move a storage to its new category (and fix the peak if it was a temporary then)."""
        old = info.category
        if base is not None:
            info.base = base
        info.saved += saved_delta
        new = info.category
        if new == old:
            return
        if self._at_peak and old != "temporaries":  # (a temporary's new role counts at the peak anyway)
            self._copy_peak()
        self._totals[old] -= info.nbytes
        self._totals[new] += info.nbytes
        if self._totals[new] > self._max[new]:
            self._max[new] = self._totals[new]
        if old == "temporaries":
            self._temps.discard(info.key)
            if info.key in self._peak_temps:
                self._peak_temps.discard(info.key)
                self._peak_totals["temporaries"] -= info.nbytes
                self._peak_totals[new] += info.nbytes
        elif new == "temporaries":
            self._temps.add(info.key)

    def _resized(self, st) -> None:
        info = self._live.get(st._cdata)
        if info is None:
            return
        new_bytes = st.nbytes()
        delta = new_bytes - info.nbytes
        if delta:
            info.nbytes = new_bytes
            if delta > 0:
                self._add(info, delta)
            else:
                if self._at_peak:
                    self._copy_peak()
                self._totals[info.category] += delta
                self._total += delta

    # ---- results -----------------------------------------------------------------------

    def peak(self) -> dict[str, int]:
        """{category: bytes} at the moment the tracked total was highest."""
        if self._at_peak:
            self._copy_peak()
        return dict(self._peak_totals)

    def peak_total(self) -> int:
        """Highest tracked total (bytes)."""
        return max(self._peak_total, 0)

    def current(self) -> dict[str, int]:
        """{category: bytes} of the storages alive now."""
        return dict(self._totals)

    def max_by_category(self) -> dict[str, int]:
        """{category: bytes}: the highest each category reached on its own (not at one moment)."""
        return dict(self._max)

    def live_bytes(self) -> int:
        """Sum of the sizes of all tracked storages alive now (bytes), counted storage by storage."""
        infos = list(self._live.values())  # copied in C: a storage dying meanwhile cannot break the loop
        return sum(info.nbytes for info in infos)
