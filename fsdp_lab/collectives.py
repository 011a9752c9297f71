"""The one module that calls torch.distributed collectives.

Every collective fsdp_lab runs goes through the four functions below, so that

* the active ``fsdp_lab.timeline.Timeline`` (if any) records one comm event per call
  (name, bytes, dtype, group size, start, end, lane);
* ``fsdp_lab.launch`` knows the last collective each rank entered, to explain a hang;
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
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from fsdp_lab import timeline as _timeline

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

_progress_sink: Callable[[str], None] | None = None
_count = 0
_reducible_checked: dict[tuple[str, torch.dtype], bool] = {}


def set_progress_sink(sink: Callable[[str], None] | None) -> None:
    """Call ``sink(description)`` just before each collective is entered (None: stop).

    ``fsdp_lab.launch`` uses it to name, per rank, the last collective entered when a
    run hangs.
    """
    global _progress_sink
    _progress_sink = sink


class CollectiveHandle:
    """An in-flight collective. ``wait()`` blocks until it is done and returns None."""

    def __init__(self, works: list, finish: Callable[[], None], event: "_timeline.CommEvent | None"):
        self._works = works
        self._finish = finish
        self._event = event
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
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


def _reduce_op(op) -> dist.ReduceOp:
    if isinstance(op, str):
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_REDUCE_OPS)}")
        return _REDUCE_OPS[op]
    return op


def _backend(group) -> str:
    return str(dist.get_backend(group)).lower()


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _enter(name: str, nbytes: int, dtype: torch.dtype, group_size: int, lane: str, meta: dict | None = None, **args):
    """Announce the collective to the progress sink and open its timeline event."""
    global _count
    _count += 1
    if _progress_sink is not None:
        dtype_name = str(dtype).replace("torch.", "")
        _progress_sink(f"{name} #{_count} ({_human_bytes(nbytes)} {dtype_name}, group of {group_size})")
    tl = _timeline.active()
    if tl is None:
        return None
    return tl.open_comm(name, nbytes, dtype=str(dtype).replace("torch.", ""), group_size=group_size, lane=lane,
                        **args, **(meta or {}))


def _run(works: list, finish: Callable[[], None], event, async_op: bool):
    handle = CollectiveHandle(works, finish, event)
    if event is not None and async_op:
        event.close_on_completion(works)
    if async_op:
        return handle
    handle.wait()
    return None


def _staging(tensor: torch.Tensor, group) -> bool:
    return tensor.is_cuda and _backend(group) == "gloo"


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, group=None,
                           async_op: bool = False, lane: str = "comm", name: str = "all_gather", meta: dict | None = None):
    """Gather every rank's ``input`` into ``output`` (rank order along dim 0).

    ``output.numel()`` must be ``input.numel() * group_size``; raises ValueError otherwise.
    Returns a ``CollectiveHandle`` when ``async_op`` else None.
    """
    n = dist.get_world_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(
            f"all_gather_into_tensor: output has {output.numel()} elements, expected "
            f"input.numel() * group size = {input.numel()} * {n}"
        )
    staged = _staging(input, group)
    event = _enter(name, output.numel() * output.element_size(), input.dtype, n, lane, meta, staged=staged)
    if staged:
        host_out, host_in = output.cpu(), input.cpu()
        work = _native_all_gather(host_out, host_in, group)
        return _run([work], lambda: output.copy_(host_out), event, async_op)
    work = _native_all_gather(output, input, group)
    return _run([work], lambda: None, event, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, *, op="sum", group=None,
                          async_op: bool = False, lane: str = "comm", name: str = "reduce_scatter",
                          meta: dict | None = None, input_is_scratch: bool = False):
    """Reduce ``input`` (the full size, group_size chunks along dim 0) across ranks and
    leave chunk ``rank`` of the result in ``output``.

    ``op`` is "sum", "avg", "max", "min" or a ``ReduceOp``. On gloo this runs as a real
    reduce-scatter (all-to-all + local sum in rank order), not gloo's all-reduce; the
    all-to-all needs a full-size receive buffer. ``input_is_scratch=True`` (sum or avg only)
    says the caller drops ``input`` afterwards: gloo then reduces each chunk in place onto its
    owner (one reduce per rank) and allocates no receive buffer, as NCCL's in-place
    reduce-scatter would; ``input``'s contents are undefined afterwards.
    Raises ValueError when ``input.numel() != output.numel() * group_size``.
    """
    n = dist.get_world_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
            f"output.numel() * group size = {output.numel()} * {n}"
        )
    reduce_op = _reduce_op(op)
    backend = _backend(group)
    staged = _staging(input, group)
    if backend != "gloo":
        event = _enter(name, input.numel() * input.element_size(), input.dtype, n, lane, meta, impl="native")
        work = _native_reduce_scatter(output, input, reduce_op, group)
        return _run([work], lambda: None, event, async_op)

    in_place = input_is_scratch and reduce_op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
    event = _enter(name, input.numel() * input.element_size(), input.dtype, n, lane, meta,
                   impl="reduce_per_chunk" if in_place else "all_to_all+local_sum", staged=staged)
    send = input.detach().reshape(-1)
    send = send.cpu() if staged else send
    if in_place:
        return _run(*_reduce_chunks_in_place(output, send, reduce_op, group, n), event, async_op)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)

    def finish() -> None:
        chunks = received.view(n, -1)
        result = _local_reduce(chunks, reduce_op, n)
        output.view(-1).copy_(result)

    return _run([work], finish, event, async_op)


def _reduce_chunks_in_place(output, flat, reduce_op, group, n):
    """gloo reduce-scatter without a receive buffer: chunk r of ``flat`` is summed onto rank r."""
    chunks = flat.view(n, -1)
    me = dist.get_rank(group)
    works = [dist.reduce(chunks[r], dst=dist.get_global_rank(group, r) if group is not None else r,
                         op=dist.ReduceOp.SUM, group=group, async_op=True) for r in range(n)]

    def finish() -> None:
        mine = chunks[me]
        output.view(-1).copy_(mine.div_(n) if reduce_op == dist.ReduceOp.AVG else mine)

    return works, finish


def _native_all_gather(output, input, group):
    # torch >= 2.13 names it all_gather_single; older versions only have all_gather_into_tensor.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)


def _native_reduce_scatter(output, input, reduce_op, group):
    # torch >= 2.13 names it reduce_scatter_single; older versions only have reduce_scatter_tensor.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=reduce_op, group=group, async_op=True)


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
               lane: str = "comm", name: str = "all_reduce", meta: dict | None = None):
    """Reduce ``tensor`` in place across ranks. "avg" on gloo is a SUM then a division."""
    n = dist.get_world_size(group)
    reduce_op = _reduce_op(op)
    gloo = _backend(group) == "gloo"
    staged = _staging(tensor, group)
    divide = gloo and reduce_op == dist.ReduceOp.AVG
    event = _enter(name, tensor.numel() * tensor.element_size(), tensor.dtype, n, lane, meta, staged=staged)
    work_tensor = tensor.cpu() if staged else tensor
    work = dist.all_reduce(work_tensor, op=dist.ReduceOp.SUM if divide else reduce_op,
                           group=group, async_op=True)

    def finish() -> None:
        if divide:
            work_tensor.div_(n)
        if staged:
            tensor.copy_(work_tensor)

    return _run([work], finish, event, async_op)


def broadcast(tensor: torch.Tensor, src: int, *, group=None, async_op: bool = False,
              lane: str = "comm", name: str = "broadcast", meta: dict | None = None):
    """Copy ``tensor`` from global rank ``src`` to every rank of the group, in place."""
    n = dist.get_world_size(group)
    staged = _staging(tensor, group)
    event = _enter(name, tensor.numel() * tensor.element_size(), tensor.dtype, n, lane, meta, staged=staged)
    work_tensor = tensor.cpu() if staged else tensor
    work = dist.broadcast(work_tensor, src=src, group=group, async_op=True)
    return _run([work], (lambda: tensor.copy_(work_tensor)) if staged else (lambda: None), event, async_op)


def ensure_reducible(dtype: torch.dtype, group=None) -> None:
    """Raise TypeError if this group's backend cannot sum tensors of ``dtype``.

    Checked once per (backend, dtype) with a one-element all-reduce on every rank (all
    ranks run the same software, so they agree). Integer and bool dtypes are refused
    for gradient reductions by the FSDP policies, not here.
    """
    backend = _backend(group)
    key = (backend, dtype)
    if key not in _reducible_checked:
        device = "cuda" if backend == "nccl" else "cpu"
        probe = torch.zeros(1, dtype=dtype, device=device)
        try:
            dist.all_reduce(probe, group=group)
            _reducible_checked[key] = True
        except (RuntimeError, TypeError, ValueError):
            _reducible_checked[key] = False
    if not _reducible_checked[key]:
        raise TypeError(
            f"the {backend} backend of torch {torch.__version__} cannot reduce {dtype}; "
            f"set reduce_dtype=torch.float32 in the mixed-precision policy"
        )


# --- bandwidth (nccl-tests' definitions) -------------------------------------------------

_BUS_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/second for a collective of size ``nbytes`` that took ``seconds``.

    algbw = S / t; busbw = algbw·(n−1)/n for all-gather and reduce-scatter, ·2(n−1)/n for
    all-reduce, ·1 for broadcast (nccl-tests' PERFORMANCE.md). Raises ValueError for an
    unknown op or non-positive time.
    """
    if op not in _BUS_FACTOR:
        raise ValueError(f"unknown collective {op!r}; use one of {sorted(_BUS_FACTOR)}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    algbw = nbytes / seconds
    return algbw, algbw * _BUS_FACTOR[op](world_size)


def timed_on_all_ranks(call: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Run ``call()`` once, started together on every rank, and time it on this rank.

    A barrier lines the ranks up first; on CUDA the device is synchronised before and after,
    so the time covers the kernels, not just their launch. Returns ``(seconds, call())``.
    """
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, value


def _bench_rank(ops: list[str], sizes: list[int], warmup: int, iters: int) -> list[dict]:
    from fsdp_lab.dist import current_device

    n = dist.get_world_size()
    device = current_device()
    rows = []
    for op in ops:
        for size in sizes:
            per_rank = max(1, size // (4 * n))
            small = torch.ones(per_rank, device=device)
            big = torch.ones(per_rank * n, device=device)
            run = {
                "all_gather": lambda: all_gather_into_tensor(big, small),
                "reduce_scatter": lambda: reduce_scatter_tensor(small, big),
                "all_reduce": lambda: all_reduce(big),
                "broadcast": lambda: broadcast(big, 0),
            }[op]
            times = []
            for i in range(warmup + iters):
                seconds, _ = timed_on_all_ranks(run, device)
                if i >= warmup:
                    times.append(seconds)
            times.sort()
            rows.append({"op": op, "bytes": big.numel() * 4, "time_s": times[len(times) // 2]})
    return rows


def benchmark(op: str | list[str], sizes: list[int], world_size: int = 2, *, backend: str = "auto",
              warmup: int = 2, iters: int = 10, timeout: float = 300.0) -> list[dict]:
    """Measure collective bandwidth on ``world_size`` fresh ranks.

    ``op``: "all_gather", "reduce_scatter", "all_reduce", "broadcast", a list of them or
    "all". ``sizes``: collective sizes S in bytes (float32 payload). Returns one row per
    (op, size): op, bytes, world_size, time_s (median over ``iters``, slowest rank),
    algbw_GBps, busbw_GBps (10^9 bytes/s). Raises ValueError for an unknown op.
    """
    from fsdp_lab.launch import launch

    ops = list(_BUS_FACTOR) if op == "all" else ([op] if isinstance(op, str) else list(op))
    for name in ops:
        if name not in _BUS_FACTOR:
            raise ValueError(f"unknown collective {name!r}; use one of {sorted(_BUS_FACTOR)} or 'all'")
    per_rank = launch(_bench_rank, ops, list(sizes), warmup, iters,
                      world_size=world_size, backend=backend, timeout=timeout)
    rows = []
    for i, row in enumerate(per_rank[0]):
        seconds = max(rank_rows[i]["time_s"] for rank_rows in per_rank)
        algbw, busbw = bus_bandwidth(row["op"], row["bytes"], seconds, world_size)
        rows.append({**row, "world_size": world_size, "time_s": seconds,
                     "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9})
    return rows
