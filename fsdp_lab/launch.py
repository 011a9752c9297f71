"""Run a function on N ranks from a notebook or a script: ``launch(fn, *args, world_size=N)``.

How it works, in order:

1. The parent opens a ``TCPStore`` on port 0 (the OS picks a free port, so two launches never
   race for one) and starts ``world_size`` processes with the spawn start method. ``fn`` and
   its arguments travel by value (cloudpickle), so a function written in a notebook cell works.
2. Each rank connects to the store under a prefix unique to this launch, initialises the
   default process group, runs ``fn`` and sends back its return value serialised with
   ``torch.save`` (tensors come back on CPU). Its prints travel to the parent line by line.
3. The parent relays the prints of ``print_ranks``, collects results, and stops every rank as
   soon as one fails, dies or the timeout passes; then it raises :class:`LaunchError` with the
   failing rank's traceback, or :class:`LaunchTimeout` naming the last collective each rank
   entered. No rank outlives ``launch``.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import io
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Iterable

import cloudpickle
import torch
import torch.distributed as dist

from fsdp_lab import dist as fdist

_SLOT_BYTES = 512  # shared-memory bytes per rank holding its last collective's description
_STOP_GRACE_S = 2.0  # seconds between SIGTERM and SIGKILL
_EXIT_GRACE_S = 10.0  # seconds a rank may take to exit after sending its result
_TAIL_LINES = 20  # recent output lines kept per rank for crash reports
_SETTLE_S = 0.3  # seconds to gather the other ranks' failures after the first


class LaunchError(RuntimeError):
    """A rank started by :func:`launch` failed; ``rank``, ``traceback`` and ``exitcode`` say how."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "",
                 exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.traceback, self.exitcode = rank, traceback, exitcode


class LaunchTimeout(LaunchError):
    """:func:`launch` ran past its timeout; ``last_collectives[r]`` is what rank r last entered."""

    def __init__(self, message: str, last_collectives: list[str]):
        super().__init__(message)
        self.last_collectives = last_collectives


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "auto",
           timeout: float = 300.0, print_ranks: Iterable[int] | str | None = (0,),
           **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results by rank.

    ``fn`` and its arguments are sent by value (cloudpickle): ``fn`` may be defined in a
    notebook cell or in ``__main__``. Every rank has the default process group initialised
    (``backend``: "auto", "gloo" or "nccl", see :func:`fsdp_lab.dist.choose_backend`), its
    device chosen (:func:`fsdp_lab.dist.current_device`), RANK/WORLD_SIZE/LOCAL_RANK set, and
    ``torch.set_num_threads(cpu_count // world_size)``. Return values come back as CPU objects.
    Prints of the ranks in ``print_ranks`` ("all", None for none) appear in the caller's
    stdout/stderr, prefixed with "[rank r] " when more than one rank prints.

    ``timeout`` (seconds) bounds the whole launch and every collective inside it.

    Raises:
        TypeError: ``fn`` is not callable, or it or its arguments cannot be pickled.
        ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``print_ranks``; NCCL
            asked for with fewer GPUs than ranks. Raised before any process starts.
        LaunchError: a rank raised (message names the rank and carries its traceback) or
            died without reporting (message gives its exit code).
        LaunchTimeout: ``timeout`` passed; the message lists each rank's last collective.
        KeyboardInterrupt: re-raised after all ranks are stopped.
    """
    backend = fdist.choose_backend(world_size, backend)
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {fn!r}")
    if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    printing = _printing_ranks(print_ranks, world_size)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"launch() sends fn and its arguments to every rank by value, but they "
                        f"could not be pickled: {exc}") from exc

    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    prefix = f"fsdp_lab/launch/{uuid.uuid4().hex}"
    ranks, deadline = [], time.monotonic() + timeout
    try:
        for r in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            slot = ctx.Array("c", _SLOT_BYTES, lock=False)
            device = str(fdist.device_for_rank(r, backend))
            process = ctx.Process(
                target=_run_rank, name=f"fsdp_lab-rank{r}",
                args=(r, world_size, backend, device, store.port, prefix, float(timeout),
                      payload, writer, slot),
            )
            ranks.append(_Rank(r, process, reader, slot))
            process.start()
            writer.close()  # the child holds the only write end: its exit shows up as EOF
        return _collect(ranks, printing, deadline, timeout)
    finally:
        _stop(ranks)


class _Rank:
    """The parent's view of one child: its process, pipe, progress slot and what it sent."""

    def __init__(self, rank, process, conn, slot):
        self.rank, self.process, self.conn, self.slot = rank, process, conn, slot
        self.result: bytes | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def tail_text(self) -> str:
        """The rank's last output lines as a report section ("" if it printed nothing)."""
        lines = "\n".join(self.tail)
        return f"\n--- last output of rank {self.rank} ---\n{lines}" if lines else ""

    def last_collective(self) -> str:
        return self.slot.value.decode("utf-8", "replace") or "none"


def _collect(ranks: list[_Rank], printing: set[int], deadline: float, timeout: float) -> list:
    waiting = set(range(len(ranks)))
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(ranks, waiting, timeout)
        # Bounded wait so a simulated interrupt (interrupt_main) is noticed promptly too.
        failures = _poll(ranks, waiting, printing, min(remaining, 0.5))
        if failures:
            # One failure makes its peers fail too (closed connections); gather those echoes
            # briefly so the report leads with the first failure, not with an echo.
            settle = time.monotonic() + _SETTLE_S
            while waiting and time.monotonic() < settle:
                failures += _poll(ranks, waiting, printing, settle - time.monotonic())
            raise _failure(failures)
    for rank in ranks:  # let ranks finish tearing down before the finally stops stragglers
        rank.process.join(timeout=max(0.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
    return [torch.load(io.BytesIO(rank.result), map_location="cpu", weights_only=False)
            for rank in ranks]


def _poll(ranks: list[_Rank], waiting: set[int], printing: set[int], timeout: float) -> list:
    """Wait up to ``timeout`` s for messages or exits of the ``waiting`` ranks and handle them.
    Ranks that sent a result, raised or died leave ``waiting``. Returns (time, LaunchError)s."""
    handles = {}
    for r in waiting:
        handles[ranks[r].process.sentinel] = r
        if ranks[r].conn is not None:
            handles[ranks[r].conn] = r
    ready = multiprocessing.connection.wait(list(handles), timeout=max(0.0, timeout))
    failures = []
    for r in sorted({handles[h] for h in ready}):
        rank = ranks[r]
        errors = _drain(rank, printing, prefixed=len(printing) > 1)
        exited = rank.conn is None or rank.process.exitcode is not None
        if not errors and rank.result is None and exited:
            # A silent death is a cause, never an echo of another rank's error: sort it first.
            errors = [(0.0, _death_error(rank))]
        if errors or rank.result is not None:
            waiting.discard(r)
        failures += errors
    return failures


def _failure(failures: list) -> LaunchError:
    failures.sort(key=lambda f: f[0])
    first = failures[0][1]
    if len(failures) == 1:
        return first
    echoes = "\n".join(f"  {str(e).splitlines()[0]}" for _, e in failures[1:])
    return LaunchError(f"{first}\nThen, probably as a consequence:\n{echoes}", rank=first.rank,
                       traceback=first.traceback, exitcode=first.exitcode)


def _drain(rank: _Rank, printing: set[int], prefixed: bool) -> list:
    """Read every message this rank has sent so far; return its errors as (time, LaunchError)."""
    errors = []
    while rank.conn is not None and rank.conn.poll():
        try:
            kind, *body = rank.conn.recv()
        except (EOFError, OSError):
            rank.conn.close()
            rank.conn = None
            break
        if kind == "out":
            stream, text = body
            rank.tail.extend(text.splitlines())
            if rank.rank in printing:
                _relay(text, stream, f"[rank {rank.rank}] " if prefixed else "")
        elif kind == "result":
            rank.result = body[0]
        elif kind == "error":
            when, summary, tb = body
            message = f"rank {rank.rank} raised {summary}\n--- traceback of rank {rank.rank} ---\n"
            message += tb
            if rank.rank not in printing:
                message += rank.tail_text()
            errors.append((when, LaunchError(message, rank=rank.rank, traceback=tb)))
    return errors


def _relay(text: str, stream: str, prefix: str) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    if prefix:  # whole lines only, or another rank's line would continue this one
        text = "".join(prefix + line + "\n" for line in text.splitlines())
    out.write(text)
    out.flush()


def _death_error(rank: _Rank) -> LaunchError:
    rank.process.join(timeout=_STOP_GRACE_S)
    code = rank.process.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with code {code}"
    message = f"rank {rank.rank} {how} without reporting a result" + rank.tail_text()
    return LaunchError(message, rank=rank.rank, exitcode=code)


def _timeout_error(ranks: list[_Rank], waiting: set[int], timeout: float) -> LaunchTimeout:
    last = [rank.last_collective() for rank in ranks]
    lines = [f"launch timed out after {timeout:g} s; ranks still running: "
             f"{', '.join(map(str, sorted(waiting)))}. Last collective each rank entered:"]
    for rank in ranks:
        state = "" if rank.rank in waiting else " (finished)"
        lines.append(f"  rank {rank.rank}{state}: {last[rank.rank]}")
    lines.append("Ranks waiting in different collectives (or one rank never entering a "
                 "collective the others wait in) is the usual cause of a hang.")
    return LaunchTimeout("\n".join(lines), last)


def _stop(ranks: list[_Rank]) -> None:
    """Stop every child still running (SIGTERM, then SIGKILL after a grace) and reap them all.
    Safe to call more than once."""
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for rank in ranks:
        if rank.process.pid is not None:
            rank.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
            rank.process.join()
        if rank.conn is not None:
            rank.conn.close()
            rank.conn = None


def _printing_ranks(print_ranks, world_size: int) -> set[int]:
    if print_ranks is None or print_ranks == "all":
        return set() if print_ranks is None else set(range(world_size))
    ranks = {print_ranks} if isinstance(print_ranks, int) else set(print_ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world_size]
    if bad:
        raise ValueError(f"print_ranks must be ranks in [0, {world_size}), 'all' or None; "
                         f"got {bad}")
    return ranks


# ---------------------------------------------------------------------------- child side


class _LineWriter(io.TextIOBase):
    """Stands in for sys.stdout/sys.stderr in a rank: sends whole lines to the parent."""

    def __init__(self, send: Callable[[tuple], None], stream: str):
        self._send, self._stream, self._partial = send, stream, ""

    encoding = "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        complete, newline, partial = (self._partial + text).rpartition("\n")
        self._partial = partial
        if newline:
            self._send(("out", self._stream, complete + newline))
        return len(text)

    def flush(self) -> None:
        if self._partial:
            text, self._partial = self._partial, ""
            self._send(("out", self._stream, text))


def _run_rank(rank, world_size, backend, device, port, prefix, timeout, payload, conn, slot):
    """Entry point of each child process (the spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    _exit_with_parent()
    lock = threading.Lock()

    def send(message):
        with lock:
            conn.send(message)

    sys.stdout, sys.stderr = _LineWriter(send, "stdout"), _LineWriter(send, "stderr")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ[fdist.DEVICE_ENV] = device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        _install_progress_sink(slot)
        fn, args, kwargs = cloudpickle.loads(payload)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        pg_timeout = datetime.timedelta(seconds=timeout)
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, None, is_master=False,
                                                       timeout=pg_timeout))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout,
            device_id=torch.device(device) if backend == "nccl" else None,
        )
        # Wait until every rank is through init: a rank that finished fn and exited while a
        # peer was still connecting would make that peer's init fail ("closed by peer").
        store.set(f"initialised/{rank}", "1")
        store.wait([f"initialised/{r}" for r in range(world_size)])
        blob = _serialise(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            frames = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop our frame
            tb = "".join(traceback.format_exception(type(exc), exc, frames))
            summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            send(("error", time.time(), summary, tb))
        finally:
            os._exit(1)  # no teardown: peers may still be blocked in collectives with us
    sys.stdout.flush()
    sys.stderr.flush()
    send(("result", blob))
    dist.destroy_process_group()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    conn.close()
    # Interpreter teardown with torch loaded takes ~0.5 s, longer than the rest of a short
    # launch: run the exit handlers (what users registered with atexit) and leave at once.
    atexit._run_exitfuncs()
    os._exit(0)


def _serialise(result: Any) -> bytes:
    """``result`` as bytes. torch.save copies CUDA storages to host memory and the parent loads
    with map_location="cpu", so tensors anywhere in ``result`` (lists, dicts, dataclasses...)
    come back on CPU without the parent touching CUDA. cloudpickle lets classes defined in a
    notebook cell come back as themselves."""
    buffer = io.BytesIO()
    try:
        torch.save(result, buffer, pickle_module=cloudpickle)
    except Exception as exc:
        raise TypeError(
            f"the return value ({type(result).__name__}) could not be sent back: {exc}. "
            "Return tensors, numbers, strings or containers of them (DTensor: .full_tensor())."
        ) from exc
    return buffer.getvalue()


def _install_progress_sink(slot) -> None:
    """Make fsdp_lab.collectives write each collective's description into our shared slot."""
    from fsdp_lab.collectives import set_progress_sink

    def sink(description: str) -> None:
        slot.value = description.encode("utf-8", "replace")[: _SLOT_BYTES - 1]

    set_progress_sink(sink)


def _exit_with_parent() -> None:
    """End this rank if the parent dies (e.g. the notebook kernel is killed)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="fsdp_lab-parent-watch", daemon=True).start()
