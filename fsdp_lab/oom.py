"""Out-of-memory on purpose, and the protocol that keeps ranks in step when one runs out.

* ``memory_budget(nbytes, rank=...)``: an emulated device of ``nbytes`` bytes. A
  ``MemoryTracker`` counts every storage this rank allocates (see ``fsdp_lab.memory.tracker``);
  when the tracked total would pass the budget the allocation raises ``torch.OutOfMemoryError``,
  the type CUDA's caching allocator raises. Ranks not named track but never raise, so an
  asymmetric OOM (rank 1 fails in backward, rank 0 does not) runs on real gloo collectives.
* ``inject_oom(point, rank=...)``: raise ``torch.OutOfMemoryError`` at a named sync point
  (``fsdp_lab.sync_points``) on one rank, for fault-injection tests.
* ``memory_budget(..., fail_at=("backward", n))``: raise at the n-th allocation made in a phase
  (an OOM in the middle of forward or backward, not at a sync point); ``retry_above=`` counts
  emulated allocator retries (``BudgetTracker.alloc_retries``), as CUDA's ``num_alloc_retries``.
* ``agree(oom)`` and ``sync_hook``: the consensus (as in Composer): MAX of "I ran out of
  memory", MIN of "I am done with the batch" — one two-element MAX all-reduce, since
  MIN(done) = 1 - MAX(not done). Ranks still
  inside the batch answer "not done" from sync hooks that run before each FSDP collective,
  and raise ``PeerOutOfMemoryError`` there instead of entering a collective that would hang.
  On a timeline these all-reduces are named ``oom_sync``; the one-element flags ``AutoMicrobatch``
  agrees on after the optimizer step (did it run out, is a rank thrashing) are ``oom_flag``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from fsdp_lab import collectives, sync_points
from fsdp_lab.memory.tracker import MemoryTracker

__all__ = ["memory_budget", "BudgetTracker", "inject_oom", "PeerOutOfMemoryError", "agree", "sync_hook",
           "is_oom", "active_budget", "suspend_budget", "flag_group",
           "enable_sync_hooks", "disable_sync_hooks"]

_ACTIVE: list["BudgetTracker"] = []


class PeerOutOfMemoryError(RuntimeError):
    """Raised at a sync point on a rank whose peer ran out of memory (this rank did not)."""


def is_oom(error: BaseException) -> bool:
    """True for an out-of-memory error: ``torch.OutOfMemoryError`` (CUDA's and the emulated budget's)."""
    return isinstance(error, torch.OutOfMemoryError)


class BudgetTracker(MemoryTracker):
    """A ``MemoryTracker`` that raises ``torch.OutOfMemoryError`` when its total passes ``budget`` bytes.

    ``budget=None`` only tracks. The total includes what existed on entry (parameters,
    optimizer state): the budget is the whole emulated device. ``failures`` counts raises.
    """

    def __init__(self, model=None, optimizer=None, *, budget: int | None,
                 fail_at: tuple[str, int] | None = None, retry_above: int | None = None, **kwargs):
        super().__init__(model, optimizer, **kwargs)
        self.budget = budget
        self.fail_at = fail_at          # (phase prefix, n): the n-th allocation in that phase raises
        self.retry_above = retry_above  # allocations taking the total past this count a retry
        self.alloc_retries = 0
        self._phase_allocations = 0
        self.failures = 0
        self.failed_at: str | None = None
        self._armed = False
        self._suspended = 0

    def __enter__(self):
        out = super().__enter__()
        self._armed = True
        _ACTIVE.append(self)
        return out

    def __exit__(self, *exc):
        self._armed = False
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def _add(self, info, nbytes: int) -> None:
        super()._add(info, nbytes)
        if not self._armed or self._suspended or nbytes <= 0:
            return
        if self.retry_above is not None and self._total > self.retry_above >= self._total - nbytes:
            # CUDA's caching allocator, short of cached blocks, frees its cache and calls
            # cudaMalloc again (num_alloc_retries); here: crossing the line counts one retry
            self.alloc_retries += 1
        if self.fail_at is not None and self._label.startswith(self.fail_at[0]):
            self._phase_allocations += 1
            if self._phase_allocations == self.fail_at[1]:
                self.failures += 1
                self.failed_at = self._label
                raise torch.OutOfMemoryError(
                    f"injected out of memory at allocation {self.fail_at[1]} of phase {self.fail_at[0]!r} "
                    f"({self._label}), allocating {_mib(nbytes)} (fsdp_lab.oom.memory_budget fail_at)")
        if (self._armed and not self._suspended and self.budget is not None and nbytes > 0
                and self._total > self.budget):
            self.failures += 1
            self.failed_at = self._label  # the phase, e.g. "backward layers.1 start"
            over = self._total
            raise torch.OutOfMemoryError(
                f"emulated out of memory: tried to allocate {_mib(nbytes)} with {_mib(over - nbytes)} in use "
                f"of a {_mib(self.budget)} budget (fsdp_lab.oom.memory_budget)")

    def breakdown(self) -> str:
        """The categories alive now, largest first, as one line per category (MiB)."""
        rows = sorted(((b, c) for c, b in self.current().items() if b), reverse=True)
        return "\n".join(f"  {c:<17} {_mib(b):>12}" for b, c in rows) or "  (nothing tracked)"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def memory_budget(nbytes: int | None, rank: int | Iterable[int] | None = None, *, model=None,
                  optimizer=None, device=None, fail_at: tuple[str, int] | None = None,
                  retry_above: int | None = None) -> Iterator[BudgetTracker]:
    """Emulate a device of ``nbytes`` bytes on ``rank`` (an int, several ranks, or None = every rank).

    Yields the ``BudgetTracker`` (a ``MemoryTracker``: ``current()``, ``peak()`` ...). On other
    ranks it only tracks. Pass ``model``/``optimizer`` to have their tensors counted by
    category. ``fail_at=(phase, n)`` (on ``rank`` only) raises ``torch.OutOfMemoryError`` at the
    n-th allocation made while the tracker's phase label starts with ``phase`` ("forward",
    "backward"; labels need ``model``), once: an OOM in the middle of an allocation, not at a
    sync point. ``retry_above`` bytes: every allocation taking the total past it adds one to
    ``tracker.alloc_retries`` (an emulated caching-allocator retry). Raises ValueError for a
    budget that is not a positive int or a bad ``fail_at``.
    """
    if fail_at is not None and not (isinstance(fail_at, tuple) and len(fail_at) == 2
                                    and isinstance(fail_at[0], str) and isinstance(fail_at[1], int)
                                    and fail_at[1] >= 1):
        raise ValueError(f"fail_at takes (phase, n) with n >= 1, e.g. ('backward', 3); got {fail_at!r}")
    if nbytes is not None and (not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"memory_budget takes a positive number of bytes (or None), got {nbytes!r}")
    ranks = None if rank is None else ({rank} if isinstance(rank, int) else set(rank))
    applies = ranks is None or _rank() in ranks
    tracker = BudgetTracker(model, optimizer, budget=nbytes if applies else None, device=device,
                            fail_at=fail_at if applies else None, retry_above=retry_above)
    with tracker:
        yield tracker


def active_budget() -> BudgetTracker | None:
    """The innermost active ``BudgetTracker`` of this process, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def suspend_budget() -> Iterator[None]:
    """Within the block no budget raises (cleanup after an OOM must not fail again)."""
    for t in _ACTIVE:
        t._suspended += 1
    try:
        yield
    finally:
        for t in _ACTIVE:
            t._suspended -= 1


def inject_oom(point: str, *, rank: int, count: int = 1, skip: int = 0, module: str | None = None):
    """Raise ``torch.OutOfMemoryError`` at sync point ``point`` on ``rank``.

    Fires on the occurrences ``skip+1 .. skip+count`` (of ``point``, and of ``module`` if given).
    Registered ahead of other callbacks, so the OOM comes before any sync hook at the same point.
    Returns the handle; ``handle.remove()`` stops it. Raises ValueError for an unknown point.
    """
    if point not in sync_points.POINTS:
        raise ValueError(f"unknown sync point {point!r}; use one of {sync_points.POINTS}")
    seen = [0]

    def injector(p: str, name: str) -> None:
        if p != point or _rank() != rank or (module is not None and name != module):
            return
        seen[0] += 1
        if skip < seen[0] <= skip + count:
            raise torch.OutOfMemoryError(f"injected out of memory at {point} {name} on rank {rank}")

    return sync_points.register(injector, first=True)


_FLAG_GROUPS: dict[int, Any] = {}


def flag_group():
    """The gloo process group (all ranks) that carries the OOM flags; made on first call.

    Making it is a collective: every rank must call this (``AutoMicrobatch`` does, in its
    constructor). A group of its own keeps the flags apart from FSDP's collectives: a rank
    waiting on a flag never consumes another rank's all-gather, and on GPU the flags stay on
    the host (no device sync for a one-element tensor).
    """
    key = id(dist.group.WORLD)
    if key not in _FLAG_GROUPS:
        _FLAG_GROUPS.clear()
        _FLAG_GROUPS[key] = dist.new_group(backend="gloo")
    return _FLAG_GROUPS[key]


def _flags(oom: int, not_done: int) -> tuple[int, int]:
    """(MAX of ``oom``, MIN of done) over all ranks in one all-reduce: MIN(done) = 1 - MAX(not done)."""
    if not dist.is_initialized():
        return oom, not_done
    with suspend_budget():  # a flag lives in host memory, not on the device a budget emulates
        t = torch.tensor([oom, not_done], dtype=torch.int32)
    collectives.all_reduce(t, op="max", group=flag_group(), name="oom_sync")
    return int(t[0]), int(t[1])


def _flag(value: int, op: str) -> int:
    """``value`` reduced with ``op`` over all ranks: one one-element all-reduce, named ``oom_flag``.

    A name of its own so a timeline tells these flags (``AutoMicrobatch``: did the optimizer step
    run out, is a rank thrashing) from the two-element ``oom_sync`` of the hooks and ``agree()``.
    """
    if not dist.is_initialized():  # one process: nobody to agree with
        return value
    with suspend_budget():  # as in _flags
        t = torch.tensor([value], dtype=torch.int32)
    collectives.all_reduce(t, op=op, group=flag_group(), name="oom_flag")
    return int(t.item())


_SYNC_OWNERS: "weakref.WeakSet" = weakref.WeakSet()
_SYNC_HANDLE: list = []


def enable_sync_hooks(owner: object) -> None:
    """Install ``sync_hook`` (once per process, however many owners ask) until ``owner`` disables it or dies."""
    _SYNC_OWNERS.add(owner)
    if not _SYNC_HANDLE:
        _SYNC_HANDLE.append(sync_points.register(sync_hook))


def disable_sync_hooks(owner: object) -> None:
    """Withdraw ``owner``'s request; the hook goes when no owner is left."""
    _SYNC_OWNERS.discard(owner)
    if not _SYNC_OWNERS and _SYNC_HANDLE:
        _SYNC_HANDLE.pop().remove()


def sync_hook(point: str, module_name: str) -> None:
    """Registered at FSDP's collective points while hooks are on: learn of a peer's OOM before
    entering a collective that peer will never join. Raises ``PeerOutOfMemoryError``."""
    if point not in sync_points.COLLECTIVE_POINTS and point != "optimizer_step":
        return
    if not _SYNC_OWNERS:  # every owner is gone
        if _SYNC_HANDLE:
            _SYNC_HANDLE.pop().remove()
        return
    someone_oomed, _ = _flags(0, 1)  # "I did not run out, and I am still inside the batch"
    if someone_oomed:
        raise PeerOutOfMemoryError(f"another rank ran out of memory (noticed before {point} {module_name})")


def agree(oom: bool) -> bool:
    """After the batch (finished or broken), loop until every rank is done; True if any rank OOMed.

    Each round is MAX(oom) and MIN(done=1); ranks still in the batch answer done=0 from
    their sync hooks, so the loop waits for them without a collective that could hang.
    """
    any_oom = bool(oom)
    if not dist.is_initialized():
        return any_oom
    while True:
        any_oom, someone_not_done = _flags(int(any_oom), 0)
        if not someone_not_done:
            return bool(any_oom)
