"""Named points in FSDP's schedule where other code may run (and raise).

FSDP (fsdp_lab's FSDP1 and FSDP2) calls ``fire(point, module_name)`` at the moments that matter for cross-rank safety:

* ``"pre_forward"``, ``"pre_backward"``, ``"post_backward"``: a unit's forward pre-hook, its
  pre-backward hook and its post-backward hook (where fault injection aims);
* ``"all_gather"`` and ``"reduce_scatter"``: right before a unit's collective is issued, after
  its buffers are allocated (fired by ``fsdp_lab.collectives`` through ``before_issue``, after the
  collective's own buffers too), so nothing can fail between the last sync and the collective;
* ``"optimizer_step"`` (module name ""): fired by ``AutoMicrobatch.train_step`` after the last
  microbatch's backward and before the optimizer step, not by FSDP itself.

``register(fn)`` adds ``fn(point, module_name)``; it returns a handle whose ``remove()``
takes it away again. With nothing registered ``fire`` is one ``if`` (no cost in a
training step). An exception raised by a callback propagates out of FSDP's hook: that is how
the sync hooks of ``fsdp_lab.automicrobatch`` stop a rank before a collective that would hang.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["POINTS", "COLLECTIVE_POINTS", "register", "fire", "SyncPointHandle"]

POINTS = ("pre_forward", "pre_backward", "post_backward", "all_gather", "reduce_scatter", "optimizer_step")
COLLECTIVE_POINTS = ("all_gather", "reduce_scatter")

_callbacks: list[Callable[[str, str], None]] = []


class SyncPointHandle:
    """``remove()`` unregisters the callback (idempotent)."""

    def __init__(self, fn: Callable[[str, str], None]):
        self._fn = fn

    def remove(self) -> None:
        if self._fn is not None:
            try:
                _callbacks.remove(self._fn)
            except ValueError:
                pass
            self._fn = None

    @property
    def active(self) -> bool:
        return self._fn is not None


def register(fn: Callable[[str, str], None], *, first: bool = False) -> SyncPointHandle:
    """Call ``fn(point, module_name)`` at every sync point (``first``: before those already registered).

    Raises TypeError if ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"register takes a callable fn(point, module_name), got {type(fn).__name__}")
    if first:
        _callbacks.insert(0, fn)
    else:
        _callbacks.append(fn)
    return SyncPointHandle(fn)


def fire(point: str, module_name: str = "") -> None:
    """Run the registered callbacks for ``point`` (one of ``POINTS``); a no-op when none are registered."""
    if not _callbacks:
        return
    for fn in list(_callbacks):
        fn(point, module_name)
