"""The one module through which fsdp_lab's FSDPs, QLoRA and instruments run collectives.

Every collective they run goes through the four functions below (barriers and a few one-off
checks call torch.distributed directly), so that

* the innermost registered recorder (an active ``fsdp_lab.timeline.Timeline`` registers
  itself with :func:`add_recorder`) gets one comm event per call (name, bytes, dtype, group
  size, start, end, lane);
* :func:`last_entered` names the last collective this process entered and :func:`blocked`
  says whether it is waiting for one to complete (each rank of ``fsdp_lab.launch`` copies
  both where the parent can read them, to explain a hang and to spot a deadlock early);
* backend quirks are handled in one place:
  - gloo cannot take CUDA tensors for these ops: they are staged through host memory
    (event arg ``staged=True``) — this is the "ranks share a GPU" case;
  - gloo has no real reduce-scatter (it all-reduces the whole input, twice the traffic).
    Ours is a real one: an ``all_to_all_single`` that sends each rank its chunk from
    everybody, then a local sum in rank order (event arg ``impl``);
  - gloo has no ``ReduceOp.AVG``: averages are a SUM then a division.

``meta`` (a dict) is added to the timeline event's args, e.g. ``{"module": "layers.0"}``.
Byte counts follow nccl-tests: ``bytes`` is the collective's size S (for all-gather and
reduce-scatter the full, gathered/unreduced size; for all-reduce and broadcast the tensor).

Each function is synchronous by default; with ``async_op=True`` it returns a
``CollectiveHandle`` whose ``wait()`` finishes the work (copy-back, local sum, division).
Each raises ValueError when no process group is initialised, or when this rank is not in
``group`` (torch.distributed would warn and skip the call, leaving its peers waiting).

The instrumentation is kept small: before a collective is issued only a counter, a tuple and
(when a recorder is registered) its start mark are taken; a synchronous collective is recorded
with one call once it completes. The collective itself is issued through the process group's
own method, as torch.distributed's function does once it has checked its arguments: the group's
size, rank and backend are looked up once per group (``fsdp_lab.process_group``), not on every
call, and the options object is made once per setting. Where that function would do more than
check and call (a complex tensor, a ``__torch_function__`` subclass or mode, a coalescing
group), the function itself is called. benchmarks/launch_and_collectives.py measures the cost against bare
``torch.distributed``: about 1% of a 4 MiB gloo all-gather on CPU, and, on the host alone
(torch's "fake" backend, a 16-float all-gather at a world of 1), about 0.6 us a call without a
recorder and 1.5 us with a CPU Timeline, against a bare call of 3 us. On one GPU (an H200, NCCL,
a world of 1, torch 2.11, measured before the group lookup was kept) a bare call took 0.04 to
0.055 ms, most of it host time, and the instrumented one 1.9x that: a Timeline's two CUDA events
1.3x (2.6 us of host time each, and their place in the stream).

Imports point down: this module uses ``fsdp_lab.dist`` and ``fsdp_lab.process_group`` only;
recorders such as the timeline, and ``fsdp_lab.bandwidth`` (which times these collectives),
import this module, never the reverse.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fsdp_lab.process_group import ALL_GATHER, REDUCE_SCATTER, backend, direct, lookup, options

# torch >= 2.13 names them all_gather_single and reduce_scatter_single; older versions only
# have all_gather_into_tensor and reduce_scatter_tensor (the same collectives).
_TORCH_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_TORCH_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

_recorders: list["CommRecorder"] = []
_count = 0  # collectives entered by this process
_last: tuple | None = None  # (name, count, nbytes, dtype, group size) of the last one entered
_blocked = 0  # >0 while this process waits for a collective to complete
_awaited: tuple | None = None  # what a handle's wait() waits for (an earlier collective than _last)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


class CommEvent(Protocol):
    """One collective as a recorder sees it (``fsdp_lab.timeline.CommEvent`` is one)."""

    def close_on_completion(self, works: list) -> None:
        """Take the end time from the backend's completion of ``works`` where it can."""

    def close(self) -> None:
        """End the event now unless its completion already did (called once, at wait())."""


class CommRecorder(Protocol):
    """Something that records collectives (``fsdp_lab.timeline.Timeline`` is one).

    ``start`` is what ``mark()`` returned just before the collective was issued; ``args``
    describe it (dtype, group_size, staged or impl, and the caller's ``meta``).
    """

    def mark(self) -> object:
        """A start mark, taken just before a collective is issued."""

    def record_comm(self, start: object, name: str, nbytes: int, *, lane: str, **args) -> None:
        """Record a synchronous collective that has just completed (it ends now)."""

    def open_comm(self, start: object, name: str, nbytes: int, *, lane: str, **args) -> CommEvent:
        """The event of an asynchronous collective just issued; it ends at its completion."""


def add_recorder(recorder: CommRecorder) -> None:
    """Report every collective from now on to ``recorder``; when several are registered,
    the one added last gets them (recorders nest like ``with`` blocks)."""
    _recorders.append(recorder)


def remove_recorder(recorder: CommRecorder) -> None:
    """Stop reporting to ``recorder``. Raises ValueError if it was not added."""
    _recorders.remove(recorder)


def last_entered() -> str:
    """The last collective this process entered, e.g. "all_reduce #2 (16 B float32, group of
    2)" (the number counts this process's collectives), or "none" before the first."""
    return _describe(_last)


def waiting_in() -> str:
    """The collective this process waits for now, in ``last_entered``'s words: the one whose
    handle it waits on (issued asynchronously, maybe before later ones), else the last one it
    entered; "none" while it is not waiting (``blocked()`` is False)."""
    return _describe((_awaited or _last) if _blocked else None)


def _describe(entered: tuple | None) -> str:
    if entered is None:
        return "none"
    name, count, nbytes, dtype, group_size = entered
    return f"{name} #{count} ({_human_bytes(nbytes)} {_dtype_name(dtype)}, group of {group_size})"


def blocked() -> bool:
    """True while this process is inside a collective's wait (a synchronous call or
    ``CollectiveHandle.wait()``): it cannot go on until its peers take part."""
    return _blocked > 0


class _Blocking:
    """``with _BLOCKING:`` marks this process as blocked in a collective for the block's span:
    around a wait, and around issuing one, which some backends do synchronously (gloo's
    all_gather_single copies through a blocking all_gather)."""

    def __enter__(self):
        global _blocked
        _blocked += 1

    def __exit__(self, *exc):
        global _blocked
        _blocked -= 1
        return False


_BLOCKING = _Blocking()


def _wait_for(works: list) -> None:
    with _BLOCKING:
        for work in works:
            work.wait()


class CollectiveHandle:
    """An in-flight collective. ``wait()`` blocks until it is done and returns None."""

    def __init__(self, works: list, finish: Callable[[], None] | None, event: CommEvent | None):
        self._works = works
        self._finish = finish
        self._event = event
        self._done = False
        self._entered = _last  # this collective, as counted when it was issued

    def wait(self) -> None:
        global _awaited
        if self._done:
            return
        _awaited = self._entered
        try:
            _wait_for(self._works)
        finally:
            _awaited = None
        if self._finish is not None:
            self._finish()
        self._done = True
        # drop the backend's work objects and the buffers the finishing step held: a handle
        # kept after wait() must pin neither memory nor process-group resources
        self._works, self._finish = [], None
        if self._event is not None:
            self._event.close()

    def is_completed(self) -> bool:
        """True once ``wait()`` has run (the local post-processing is part of the op)."""
        return self._done


def release(tensor: torch.Tensor) -> None:
    """Give a buffer that served a finished collective its bytes back now, on this thread.

    The backend's work object and a timeline's completion callback keep references to a
    collective's tensors and drop them on gloo's worker thread, at a moment that depends on the
    machine's load; memory accounting that waits for the last reference would see the bytes
    go at a random point. Resizing the storage to 0 frees them here, deterministically. Call it
    only once the collective has been waited for and nothing reads the buffer any more.
    """
    tensor.untyped_storage().resize_(0)


def _issue(method, async_op: bool, *args) -> list:
    """Issue a collective through the process group's own ``method``: returns the work to wait
    for when ``async_op``, else waits for it here, as torch.distributed's functions do, and
    returns []. Each collective spells out its two ways (this, or torch's function where
    ``direct`` says so) rather than pass them in as closures: closures cost 0.4 to 0.5 us a
    call, an eighth of a bare call's host time."""
    with _BLOCKING:
        work = method(*args)
        if work is None:
            return []
        if not async_op:
            work.wait()
            return []
    return [work]


def _reduce_op(op) -> dist.ReduceOp:
    if isinstance(op, str):
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}")
        return _REDUCE_OPS[op]
    return op


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _enter(name: str, nbytes: int, dtype: torch.dtype, group_size: int,
           before_issue: Callable[[], None] | None = None) -> tuple | None:
    """Note the collective as entered, just before it is issued, after running ``before_issue``
    (the caller's sync point: every buffer of the call exists by then). Returns what ``_run``
    needs to open its event (the recorder and its start mark), or None when nothing records."""
    if before_issue is not None:
        before_issue()
    global _count, _last
    _count += 1
    _last = (name, _count, nbytes, dtype, group_size)
    if not _recorders:
        return None
    recorder = _recorders[-1]
    return recorder, recorder.mark(), name, nbytes, dtype, group_size


def _run(works: list, finish: Callable[[], None] | None, entered: tuple | None, async_op: bool,
         lane: str, meta: dict | None, **args):
    """Wait for a collective already issued (``works``) and record it (sync), or return its
    handle with its event open (async). ``entered`` is what ``_enter`` returned."""
    if async_op:
        event = None
        if entered is not None:
            recorder, start, name, nbytes, dtype, group_size = entered
            event = recorder.open_comm(start, name, nbytes, lane=lane, dtype=_dtype_name(dtype),
                                       group_size=group_size, **args, **(meta or {}))
            event.close_on_completion(works)
        return CollectiveHandle(works, finish, event)
    if works:
        _wait_for(works)
    if finish is not None:
        finish()
    if entered is not None:
        recorder, start, name, nbytes, dtype, group_size = entered
        recorder.record_comm(start, name, nbytes, lane=lane, dtype=_dtype_name(dtype),
                             group_size=group_size, **args, **(meta or {}))
    return None


def _through_torch(function, *args, **kwargs) -> list:
    """Issue a collective through torch.distributed's ``function``; returns the backend's work
    still to wait for: none after a synchronous call (it returned done).

    A synchronous call is issued as one (``async_op=False``) rather than as an asynchronous
    one waited on at once: NCCL (torch >= 2.8) then runs it on the current stream, without the
    side stream, the event syncs and the tensor stashing an asynchronous call needs."""
    with _BLOCKING:
        work = function(*args, **kwargs)
    return [] if work is None else [work]


def _staging(tensor: torch.Tensor, info) -> bool:
    return tensor.is_cuda and backend(info, tensor) == "gloo"


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group=None,
                           async_op: bool = False, lane: str = "comm", name: str = "all_gather", meta: dict | None = None,
                           before_issue: Callable[[], None] | None = None):
    """Gather every rank's ``input`` into ``output`` (rank order along dim 0).

    ``output.numel()`` must be ``input.numel() * group_size``, in any shape (flat, stacked or
    concatenated along dim 0), as NCCL takes it; raises ValueError otherwise, or when
    ``output`` is not contiguous. ``before_issue`` (see :func:`reduce_scatter_tensor`) runs once
    this call's own buffers exist. Returns a ``CollectiveHandle`` when ``async_op`` else None.
    """
    info = lookup(group)
    n = info.size
    if output.numel() != input.numel() * n:
        raise ValueError(
            f"all_gather_into_tensor: output has {output.numel()} elements, expected "
            f"input.numel() * group size = {input.numel()} * {n}"
        )
    if not output.is_contiguous():
        raise ValueError("all_gather_into_tensor: output is not contiguous; gather into a contiguous tensor "
                         "(torch.empty(...)) and copy from it")
    if backend(info, input) == "gloo":  # gloo wants the inputs concatenated along dim 0; NCCL any shape
        input = input.reshape(1) if input.dim() == 0 else input
        output = output.view(n * input.shape[0], *input.shape[1:])
    staged = _staging(input, info)
    if staged:
        host_out, host_in = output.cpu(), input.cpu()
    entered = _enter(name, output.numel() * output.element_size(), input.dtype, n, before_issue)
    if staged:
        works = _through_torch(_TORCH_ALL_GATHER, host_out, host_in, group=group, async_op=async_op)
        return _run(works, lambda: output.copy_(host_out), entered, async_op, lane, meta, staged=True)
    if direct(info, output, input):
        works = _issue(getattr(info.pg, ALL_GATHER), async_op, output, input,
                       options(c10d.AllgatherOptions, async_op))
    else:
        works = _through_torch(_TORCH_ALL_GATHER, output, input, group=group, async_op=async_op)
    return _run(works, None, entered, async_op, lane, meta, staged=False)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, *, op="sum", group=None,
                          async_op: bool = False, lane: str = "comm", name: str = "reduce_scatter",
                          meta: dict | None = None, input_is_scratch: bool = False,
                          before_issue: Callable[[], None] | None = None):
    """Reduce ``input`` (the full size, group_size chunks along dim 0) across ranks and
    leave chunk ``rank`` of the result in ``output``.

    ``op`` is "sum", "avg", "max", "min" or a ``ReduceOp``. On gloo this runs as a real
    reduce-scatter (all-to-all + local sum in rank order), not gloo's all-reduce; the
    all-to-all needs a full-size receive buffer. ``input_is_scratch=True`` (sum or avg only)
    says the caller drops ``input`` afterwards: gloo then reduces each chunk in place onto its
    owner (one reduce per rank) and allocates no receive buffer, as NCCL's in-place
    reduce-scatter would; ``input``'s contents are undefined afterwards.
    ``before_issue()`` runs after every buffer this call allocates (gloo's receive buffer, host
    copies of CUDA tensors) and right before the collective is issued: FSDP fires its sync point
    there, so that nothing on this rank can fail between the point and the collective.
    Raises ValueError when ``input.numel() != output.numel() * group_size``.
    """
    info = lookup(group)
    n = info.size
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
            f"output.numel() * group size = {output.numel()} * {n}"
        )
    reduce_op = _reduce_op(op)
    if backend(info, input) != "gloo":
        entered = _enter(name, input.numel() * input.element_size(), input.dtype, n, before_issue)
        if direct(info, output, input):
            works = _issue(getattr(info.pg, REDUCE_SCATTER), async_op, output, input,
                           options(c10d.ReduceScatterOptions, async_op, reduce_op))
        else:
            works = _through_torch(_TORCH_REDUCE_SCATTER, output, input, op=reduce_op, group=group,
                                   async_op=async_op)
        return _run(works, None, entered, async_op, lane, meta, impl="native")

    staged = input.is_cuda  # on gloo, so through host memory
    send = input.detach().reshape(-1)
    send = send.cpu() if staged else send
    in_place = input_is_scratch and reduce_op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    received = None if in_place else torch.empty_like(send)
    entered = _enter(name, input.numel() * input.element_size(), input.dtype, n, before_issue)
    if in_place:
        works, finish = _reduce_chunks_in_place(output, send, reduce_op, group, info, async_op)
        return _run(works, finish, entered, async_op, lane, meta, impl="reduce_per_chunk", staged=staged)
    works = _through_torch(dist.all_to_all_single, received, send, group=group, async_op=async_op)

    def finish() -> None:
        chunks = received.view(n, -1)
        result = _local_reduce(chunks, reduce_op, n)
        output.view(-1).copy_(result)
        release(received)

    return _run(works, finish, entered, async_op, lane, meta, impl="all_to_all+local_sum", staged=staged)


def _reduce_chunks_in_place(output, flat, reduce_op, group, info, async_op):
    """gloo reduce-scatter without a receive buffer: chunk r of ``flat`` is summed onto rank r."""
    n, me = info.size, info.rank
    chunks = flat.view(n, -1)
    with _BLOCKING:
        works = [dist.reduce(chunks[r], dst=dist.get_global_rank(group, r) if group is not None else r,
                             op=dist.ReduceOp.SUM, group=group, async_op=async_op) for r in range(n)]

    def finish() -> None:
        mine = chunks[me]
        output.view(-1).copy_(mine.div_(n) if reduce_op == dist.ReduceOp.AVG else mine)

    return [w for w in works if w is not None], finish


def _local_reduce(chunks: torch.Tensor, reduce_op, n: int) -> torch.Tensor:
    """Reduce the rows of ``chunks`` (one per source rank) in rank order."""
    if reduce_op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        result = chunks[0].clone()
        for row in chunks[1:]:
            result.add_(row)
        return result.div_(n) if reduce_op == dist.ReduceOp.AVG else result
    if reduce_op == dist.ReduceOp.MAX:
        return chunks.amax(dim=0)
    if reduce_op == dist.ReduceOp.MIN:
        return chunks.amin(dim=0)
    if reduce_op == dist.ReduceOp.PRODUCT:
        return chunks.prod(dim=0)
    raise ValueError(f"reduce op {reduce_op} is not supported by fsdp_lab's gloo reduce-scatter")


def all_reduce(tensor: torch.Tensor, *, op="sum", group=None, async_op: bool = False,
               lane: str = "comm", name: str = "all_reduce", meta: dict | None = None,
               before_issue: Callable[[], None] | None = None):
    """Reduce ``tensor`` in place across ranks. "avg" on gloo is a SUM then a division.
    ``before_issue`` (see :func:`reduce_scatter_tensor`) runs once this call's own buffers exist."""
    info = lookup(group)
    n = info.size
    reduce_op = _reduce_op(op)
    gloo = backend(info, tensor) == "gloo"
    staged = gloo and tensor.is_cuda
    divide = gloo and reduce_op == dist.ReduceOp.AVG
    work_tensor = tensor.cpu() if staged else tensor
    entered = _enter(name, tensor.numel() * tensor.element_size(), tensor.dtype, n, before_issue)
    backend_op = dist.ReduceOp.SUM if divide else reduce_op
    if direct(info, work_tensor):
        works = _issue(info.pg.allreduce, async_op, [work_tensor],
                       options(c10d.AllreduceOptions, async_op, backend_op))
    else:
        works = _through_torch(dist.all_reduce, work_tensor, op=backend_op, group=group, async_op=async_op)

    def finish() -> None:
        if divide:
            work_tensor.div_(n)
        if staged:
            tensor.copy_(work_tensor)

    return _run(works, finish if divide or staged else None, entered, async_op, lane, meta, staged=staged)


def broadcast(tensor: torch.Tensor, src: int, *, group=None, async_op: bool = False,
              lane: str = "comm", name: str = "broadcast", meta: dict | None = None):
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    info = lookup(group)
    staged = _staging(tensor, info)
    entered = _enter(name, tensor.numel() * tensor.element_size(), tensor.dtype, info.size)
    work_tensor = tensor.cpu() if staged else tensor
    if direct(info, work_tensor):
        root = src if group is None else dist.get_group_rank(group, src)  # src's rank in the group
        works = _issue(info.pg.broadcast, async_op, [work_tensor],
                       options(c10d.BroadcastOptions, async_op, root=root))
    else:
        works = _through_torch(dist.broadcast, work_tensor, src=src, group=group, async_op=async_op)
    finish = (lambda: tensor.copy_(work_tensor)) if staged else None
    return _run(works, finish, entered, async_op, lane, meta, staged=staged)
