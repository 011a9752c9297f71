"""Run a function on N ranks from a notebook or a script: ``launch(fn, *args, world_size=N)``.

How it works, in order:

1. ``fn`` and its arguments are pickled here (``fsdp_lab.pickling``): the user's own code by
   value (a function written in a notebook cell or a script works), modules and everything
   importable by name; the pickled call and the caller's ``sys.path`` and ``sys.argv`` go
   into a temporary file. The parent opens a ``TCPStore`` on port 0 (the OS picks a free port, so two launches
   never race for one) for the ranks' rendezvous, under a prefix unique to this launch.
2. It starts ``world_size`` ranks, each running ``fsdp_lab.launch_rank`` as a fresh
   interpreter would: forked from a fork server that has already imported torch
   (``fsdp_lab.forkserver``, for CPU ranks on Linux; it saves each rank seconds of imports), or as
   ``python -m fsdp_lab.launch_rank`` (elsewhere, or with ``FSDP_LAB_LAUNCH_START=spawn``).
   They never import the caller's main module, so the caller may be a notebook, ``python -`` or
   a script without ``if __name__ == "__main__":``, and CUDA initialised here does not matter there.
   Each rank gets four file descriptors: the call file, a pipe for its messages (prints line
   by line, its result, its traceback), a shared progress file holding in its slot the last
   collective it entered, and the read end of a lifeline pipe that tells it when the parent
   is gone.
3. Each rank reads the call, initialises the default process group, runs ``fn`` and sends
   back its return value serialised with ``torch.save`` (tensors come back on CPU).
4. The parent relays the prints of ``print_ranks``, collects results, and stops every rank as
   soon as one fails, dies or the timeout passes; then it raises :class:`LaunchError` with the
   failing rank's traceback, or :class:`LaunchTimeout` naming the last collective each rank
   entered. No rank outlives ``launch``.
5. A deadlock does not wait for the timeout: when every running rank has waited for over
   ``_DEADLOCK_S`` inside its N-th collective and those N-th collectives are not the same
   operation (rank 0 in an all-reduce, rank 1 in an all-gather), none of them can ever
   complete, and :class:`LaunchTimeout` is raised then, with the same report. This assumes
   what FSDP does: every rank calls the same collectives in the same order. (A program whose
   ranks call different collectives on purpose, on disjoint groups, should not rely on it.)
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import math
import mmap
import multiprocessing.connection
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fsdp_lab import dist as fdist
from fsdp_lab import forkserver, pickling

RANK_MODULE = "fsdp_lab.launch_rank"  # what each rank runs (python -m); launch never imports it
_SLOT_BYTES = 512  # bytes per rank in the progress file: its last collective's description
_STOP_GRACE_S = 2.0  # seconds between SIGTERM and SIGKILL
_EXIT_GRACE_S = 10.0  # seconds a rank may take to exit after sending its result
_TAIL_LINES = 20  # recent output lines kept per rank for crash reports
_SETTLE_S = 0.3  # seconds to gather the other ranks' failures after the first
_DEADLOCK_S = 2.0  # seconds every rank must sit unchanged in mismatched collectives to call it a deadlock
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the directory holding fsdp_lab/


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

    ``fn`` and its arguments are sent by value (cloudpickle), modules by reference: ``fn`` may
    be defined in a notebook cell, in a script (guarded by ``if __name__ == "__main__":`` or
    not) or in ``python -``; the ranks never import the caller's main module. Every rank has
    the default process group initialised (``backend``: "auto", "gloo" or "nccl", see
    :func:`fsdp_lab.dist.choose_backend`), its device chosen
    (:func:`fsdp_lab.dist.current_device`), RANK/WORLD_SIZE/LOCAL_RANK set, ``sys.path`` and
    ``sys.argv`` as the caller's, and ``torch.set_num_threads(cpu_count // world_size)``.
    Return values come back as CPU objects. Prints of the ranks in ``print_ranks`` ("all",
    None for none) appear in the caller's stdout/stderr, prefixed with "[rank r] " when more
    than one rank prints.

    ``timeout`` (seconds) bounds the whole launch and every collective inside it.

    Raises:
        TypeError: ``fn`` is not callable, or it or its arguments cannot be pickled (the
            message names the global, closure variable or argument, and what to do).
        ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``print_ranks``; NCCL
            asked for with fewer GPUs than ranks; ``FSDP_LAB_LAUNCH_START`` in the environment
            is neither "fork" nor "spawn". Raised before any process starts.
        RuntimeError: the fork server could not start (its error is printed; the message says
            how to start ranks without it).
        LaunchError: a rank raised (message names the rank and carries its traceback) or
            died without reporting (message gives its exit code).
        LaunchTimeout: ``timeout`` passed, or earlier, a deadlock was seen (every rank waiting
            in its N-th collective, and those not the same operation); the message lists each
            rank's last collective.
        OSError: this is not a POSIX system (on Windows, run the labs inside WSL2).
        KeyboardInterrupt: re-raised after all ranks are stopped.
    """
    require_posix()
    backend = fdist.choose_backend(world_size, backend)
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {fn!r}")
    if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    printing = _printing_ranks(print_ranks, world_size)
    devices = [fdist.device_for_rank(r, backend) for r in range(world_size)]
    by_fork = _forks(devices)
    call = pickling.dumps_call(fn, args, kwargs)

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    prefix = f"fsdp_lab/launch/{uuid.uuid4().hex}"
    ranks: list[_Rank] = []
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile() as call_file, tempfile.TemporaryFile() as progress:
        caller = (sys.path, sys.argv, call)
        call_bytes = call_file.write(pickle.dumps(caller, protocol=pickle.HIGHEST_PROTOCOL))
        call_file.flush()
        progress.truncate(_SLOT_BYTES * world_size)
        slots = mmap.mmap(progress.fileno(), _SLOT_BYTES * world_size)
        lifeline_read, lifeline_write = os.pipe()  # only this process ever holds the write end
        try:
            for r in range(world_size):
                ranks.append(_start_rank(
                    dict(rank=r, world_size=world_size, backend=backend,
                         device=str(devices[r]), port=store.port,
                         prefix=prefix, timeout=float(timeout), call_fd=call_file.fileno(),
                         call_bytes=call_bytes, slot_fd=progress.fileno(), slot_bytes=_SLOT_BYTES,
                         lifeline_fd=lifeline_read), slots, by_fork))
            os.close(lifeline_read)
            lifeline_read = None
            return _collect(ranks, printing, deadline, timeout)
        finally:
            _stop(ranks)
            for fd in (lifeline_read, lifeline_write):
                if fd is not None:
                    os.close(fd)
            slots.close()


def start_fork_server(world_size: int = 2, backend: str = "auto", preload: Iterable[str] = ()) -> bool:
    """Start now, in the background, what the first CPU launch would otherwise wait for: the
    fork server that imports torch once (a few seconds of one core) and forks every rank.
    ``preload``: names of more modules the ranks will import (e.g. ``"transformers"``); the
    server imports them once, so no rank imports them again, as ``multiprocessing``'s
    ``set_forkserver_preload`` does (a module that starts threads at import should not be
    named: ranks are forked after it). Returns at once: True if a server is starting or
    running, False where launches of ``world_size`` ranks on ``backend`` would not fork (GPU
    ranks, not Linux, ``FSDP_LAB_LAUNCH_START=spawn``). A later launch uses the server only
    while the environment, working directory and fsdp_lab's sources are as they were here;
    otherwise it starts a new one, as without this call. Raises ValueError for a bad
    ``backend`` or ``FSDP_LAB_LAUNCH_START``, TypeError if ``preload`` is not names of
    modules, OSError if the server's process cannot be started; a module in ``preload`` that
    fails to import makes the next launch raise RuntimeError (its error printed above)."""
    preload = (preload,) if isinstance(preload, str) else preload
    preload = tuple(preload) if isinstance(preload, Iterable) else (preload,)
    if not all(isinstance(name, str) and name for name in preload):
        raise TypeError(f"preload must be module names such as 'transformers', got {preload!r}")
    backend = fdist.choose_backend(world_size, backend)
    if not _forks([fdist.device_for_rank(r, backend) for r in range(world_size)]):
        return False
    forkserver.start_server(_rank_environment(), preload)
    return True


def _forks(devices: list[torch.device]) -> bool:
    """Whether ranks on ``devices`` are forked from the fork server: CPU ranks only (a CUDA
    driver loaded before a fork does not work in the child), where forking is on."""
    return forkserver.enabled() and all(device.type == "cpu" for device in devices)


def _rank_environment() -> dict:
    """The environment a rank starts with: the caller's, with this fsdp_lab first on the path
    (the rank must import this same fsdp_lab before it can read the caller's sys.path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def require_posix(platform: str | None = None) -> None:
    """Raise OSError unless ``platform`` (default ``sys.platform``) is a POSIX system.

    Each rank inherits file descriptors from ``launch`` (``subprocess.Popen(pass_fds=...)``) and
    is stopped with POSIX signals; Windows has neither, and its ``Popen`` would fail with a
    message that does not say what to do.
    """
    platform = sys.platform if platform is None else platform
    if platform.startswith(("win", "cygwin", "msys")):
        raise OSError(f"fsdp_lab.launch needs Linux or macOS: it passes file descriptors to each rank "
                      f"and stops ranks with POSIX signals, which {platform!r} does not offer; on "
                      "Windows, run the labs inside WSL2 (Ubuntu) with the README's set-up there")


def _start_rank(spec: dict, slots: mmap.mmap, by_fork: bool) -> "_Rank":
    """Start one rank, passing it its file descriptors: forked from the fork server
    (``fsdp_lab.forkserver``), or as ``python -m fsdp_lab.launch_rank`` where that is off."""
    read_fd, write_fd = os.pipe()
    spec["msg_fd"] = write_fd
    env = _rank_environment()
    try:
        if by_fork:
            process = forkserver.start_rank(spec, env)
        else:
            process = subprocess.Popen(
                [sys.executable, "-m", RANK_MODULE, json.dumps(spec)], env=env,
                stdin=subprocess.DEVNULL,  # a rank waiting for input would hang: it reads EOF
                pass_fds=(write_fd, spec["call_fd"], spec["slot_fd"], spec["lifeline_fd"]),
            )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # the child holds the only write end: its exit shows up as EOF
    conn = multiprocessing.connection.Connection(read_fd, writable=False)
    return _Rank(spec["rank"], process, conn, slots)


class _Rank:
    """The parent's view of one child: its process, message pipe, progress slot and what it sent."""

    def __init__(self, rank: int, process: subprocess.Popen, conn, slots: mmap.mmap):
        self.rank, self.process, self.conn, self._slots = rank, process, conn, slots
        self.result: bytes | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)

    def tail_text(self) -> str:
        """The rank's last output lines as a report section ("" if it printed nothing)."""
        lines = "\n".join(self.tail)
        return f"\n--- last output of rank {self.rank} ---\n{lines}" if lines else ""

    def _slot(self) -> str:
        slot = self._slots[self.rank * _SLOT_BYTES:(self.rank + 1) * _SLOT_BYTES]
        return slot.split(b"\0", 1)[0].decode("utf-8", "replace")

    def last_collective(self) -> str:
        """What the rank wrote into its progress slot: the last collective it entered."""
        return self._slot()[1:] or "none"

    def blocked_in(self) -> tuple[int, str] | None:
        """(N, operation) when the rank waits inside its N-th collective, else None."""
        slot = self._slot()
        if not slot.startswith("W"):
            return None
        name, _, rest = slot[1:].partition(" #")
        count = rest.split(" ", 1)[0]
        return (int(count), name) if count.isdigit() else None


def _deadlocked(ranks: list[_Rank], waiting: set[int]) -> tuple | None:
    """What every running rank waits in, if they wait in different N-th collectives (which can
    never complete), else None. The caller requires it to hold unchanged for ``_DEADLOCK_S``."""
    if len(waiting) < 2 or len(waiting) < len(ranks):
        return None
    state = tuple(ranks[r].blocked_in() for r in sorted(waiting))
    if None in state or len({count for count, _ in state}) != 1 or len({name for _, name in state}) == 1:
        return None
    return state


def _collect(ranks: list[_Rank], printing: set[int], deadline: float, timeout: float) -> list:
    waiting = set(range(len(ranks)))
    start, stuck, stuck_since = time.monotonic(), None, 0.0
    while waiting:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise _timeout_error(ranks, waiting, timeout)
        state = _deadlocked(ranks, waiting)
        if state != stuck:
            stuck, stuck_since = state, now
        elif stuck is not None and now - stuck_since >= _DEADLOCK_S:
            raise _timeout_error(ranks, waiting, timeout, deadlock_after=now - start)
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
        _wait(rank.process, max(0.0, min(_EXIT_GRACE_S, deadline - time.monotonic())))
    return [torch.load(io.BytesIO(rank.result), map_location="cpu", weights_only=False)
            for rank in ranks]


def _poll(ranks: list[_Rank], waiting: set[int], printing: set[int], timeout: float) -> list:
    """Wait up to ``timeout`` s for messages or exits of the ``waiting`` ranks and handle them.
    Ranks that sent a result, raised or died leave ``waiting``. Returns (time, LaunchError)s."""
    handles = {ranks[r].conn: r for r in waiting if ranks[r].conn is not None}
    ready = multiprocessing.connection.wait(list(handles), timeout=max(0.0, timeout))
    # A rank's death closes its pipe (EOF makes it ready); poll() also catches a rank whose
    # pipe stays open because a process it started inherited it.
    exited_now = {r for r in waiting if ranks[r].process.poll() is not None}
    failures = []
    for r in sorted({handles[h] for h in ready} | exited_now):
        rank = ranks[r]
        errors = _drain(rank, printing, prefixed=len(printing) > 1)
        exited = rank.conn is None or rank.process.poll() is not None
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
    code = _wait(rank.process, _STOP_GRACE_S)
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with code {code}"
    message = f"rank {rank.rank} {how} without reporting a result" + rank.tail_text()
    return LaunchError(message, rank=rank.rank, exitcode=code)


def _timeout_error(ranks: list[_Rank], waiting: set[int], timeout: float,
                   deadlock_after: float | None = None) -> LaunchTimeout:
    last = [rank.last_collective() for rank in ranks]
    if deadlock_after is None:
        head = f"launch timed out after {timeout:g} s"
    else:
        head = (f"deadlock: the ranks wait in different collectives, which can never complete; "
                f"stopped after {deadlock_after:.0f} s instead of waiting for the {timeout:g} s timeout")
    lines = [f"{head}; ranks still running: "
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
        if rank.process.poll() is None:
            rank.process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for rank in ranks:
        _wait(rank.process, max(0.0, deadline - time.monotonic()))
    for rank in ranks:
        if rank.process.poll() is None:
            rank.process.kill()
            rank.process.wait()
        if rank.conn is not None:
            rank.conn.close()
            rank.conn = None


def _wait(process: subprocess.Popen, timeout: float) -> int | None:
    """The exit code of ``process`` once it ends within ``timeout`` seconds, else None."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _printing_ranks(print_ranks, world_size: int) -> set[int]:
    if print_ranks is None or print_ranks == "all":
        return set() if print_ranks is None else set(range(world_size))
    ranks = {print_ranks} if isinstance(print_ranks, int) else set(print_ranks)
    bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world_size]
    if bad:
        raise ValueError(f"print_ranks must be ranks in [0, {world_size}), 'all' or None; "
                         f"got {bad}")
    return ranks
