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
   is gone; and its standard output and error are two more pipes the parent reads.
3. Each rank reads the call, initialises the default process group, runs ``fn`` and sends
   back its return value serialised with ``torch.save`` (tensors come back on CPU).
4. The parent relays the output of ``print_ranks`` (Python's prints through the message pipe;
   what is written below Python, by C++ libraries or programs a rank starts, through the pipes
   that are the rank's file descriptors 1 and 2), collects results, and stops every rank as
   soon as one fails, dies or the timeout passes; then it raises :class:`LaunchError` with the
   failing rank's traceback, or :class:`LaunchTimeout` naming the collective each rank waits
   in (else the last one it entered). No rank outlives ``launch``.
5. A deadlock does not wait for the timeout: when every running rank has waited for over
   ``_DEADLOCK_S`` inside its N-th collective and those N-th collectives are not the same
   operation (rank 0 in an all-reduce, rank 1 in an all-gather), none of them can ever
   complete, and :class:`LaunchTimeout` is raised then, with the same report. This assumes
   what FSDP does: every rank calls the same collectives in the same order. (A program whose
   ranks call different collectives on purpose, on disjoint groups, should not rely on it.)
"""

from __future__ import annotations

import datetime
import io
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
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fsdp_lab import dist as fdist
from fsdp_lab import forkserver, pickling
from fsdp_lab.launch_handle import (SLOT_BYTES, RankHandle, rank_environment, relay, relay_native,
                                   start_rank)

_STOP_GRACE_S = 2.0  # seconds between SIGTERM and SIGKILL
_EXIT_GRACE_S = 10.0  # seconds a rank may take to exit after sending its result
_SETTLE_S = 0.3  # seconds to gather the other ranks' failures after the first
_DEADLOCK_S = 2.0  # seconds every rank must sit unchanged in mismatched collectives to call it a deadlock


class LaunchError(RuntimeError):
    """A rank started by :func:`launch` failed; ``rank``, ``traceback`` and ``exitcode`` say how."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "",
                 exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.traceback, self.exitcode = rank, traceback, exitcode


class LaunchTimeout(LaunchError):
    """:func:`launch` ran past its timeout; ``last_collectives[r]`` is the collective rank r waits
    in (an asynchronous one it issued earlier, when it waits on that one's handle), else the last
    one it entered."""

    def __init__(self, message: str, last_collectives: list[str]):
        super().__init__(message)
        self.last_collectives = last_collectives


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str = "auto",
           timeout: float = 300.0, print_ranks: Iterable[int] | str | None = (0,),
           **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results by rank.

    ``fn`` and its arguments are sent by value (cloudpickle), modules by reference: ``fn`` may
    be defined in a notebook cell, in a script (guarded by ``if __name__ == "__main__":`` or
    not) or in ``python -``; the ranks never import the caller's main module. A function (or
    class) from an importable module goes by name, so every rank imports that module at every
    launch (CPU ranks on Linux fork from a server that preloaded only torch and this package's
    engine; other ranks start a fresh interpreter): a module that is slow to import (one that
    reads notebooks or builds a model at import) costs that time once per rank per launch.
    Every rank has the default process group initialised (``backend``: "auto", "gloo" or
    "nccl", see :func:`fsdp_lab.dist.choose_backend`), its device chosen
    (:func:`fsdp_lab.dist.current_device`), RANK/WORLD_SIZE/LOCAL_RANK set, ``sys.path`` and
    ``sys.argv`` as the caller's, and ``torch.set_num_threads(cpu_count // world_size)`` (at most
    ``OMP_NUM_THREADS`` where the caller's environment sets it; see ``launch_rank.rank_threads``).
    Return values come back as CPU objects. Output of the ranks in ``print_ranks`` ("all",
    None for none) appears in the caller's stdout/stderr (``sys.stdout``, so a notebook shows
    it in the launching cell), prefixed with "[rank r] " when more than one rank prints: Python's
    prints and, as whole lines, what C++ libraries or programs started by the rank write to its
    file descriptors 1 and 2, in the order the rank wrote them (on Linux; elsewhere the two may
    interleave a little differently). Gloo's "Rank r is connected to n peer ranks" line, printed
    at every start by some torch releases, is left out when n is what was expected. The last
    lines of a rank that fails, printed or not, are in the :class:`LaunchError`.

    ``timeout`` (seconds) bounds the whole launch and every collective inside it.

    Raises:
        TypeError: ``fn`` is not callable, or it or its arguments cannot be pickled (the
            message names the global, closure variable or argument, and what to do).
        ValueError: bad ``world_size``, ``backend``, ``timeout`` or ``print_ranks``; NCCL
            asked for with fewer GPUs than ranks; ``FSDP_LAB_LAUNCH_START`` in the environment
            is neither "fork" nor "spawn"; ``GLOO_SOCKET_IFNAME`` names an interface this
            machine lacks. Raised before any process starts.
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
    fdist.check_gloo_interface()
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
    ranks: list[RankHandle] = []
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile() as call_file, tempfile.TemporaryFile() as progress:
        caller = (sys.path, sys.argv, call)
        call_bytes = call_file.write(pickle.dumps(caller, protocol=pickle.HIGHEST_PROTOCOL))
        call_file.flush()
        progress.truncate(SLOT_BYTES * world_size)
        slots = mmap.mmap(progress.fileno(), SLOT_BYTES * world_size)
        lifeline_read, lifeline_write = os.pipe()  # only this process ever holds the write end
        try:
            for r in range(world_size):
                ranks.append(start_rank(
                    dict(rank=r, world_size=world_size, backend=backend,
                         device=str(devices[r]), port=store.port,
                         prefix=prefix, timeout=float(timeout), call_fd=call_file.fileno(),
                         call_bytes=call_bytes, slot_fd=progress.fileno(), slot_bytes=SLOT_BYTES,
                         lifeline_fd=lifeline_read), slots, by_fork))
            os.close(lifeline_read)
            lifeline_read = None
            return _collect(ranks, printing, deadline, timeout)
        finally:
            _stop(ranks, printing)
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
    forkserver.start_server(rank_environment(), preload)
    return True


def _forks(devices: list[torch.device]) -> bool:
    """Whether ranks on ``devices`` are forked from the fork server: CPU ranks only (a CUDA
    driver loaded before a fork does not work in the child), where forking is on."""
    return forkserver.enabled() and all(device.type == "cpu" for device in devices)


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


def _deadlocked(ranks: list[RankHandle], waiting: set[int]) -> tuple | None:
    """What every running rank waits in, if they wait in different N-th collectives (which can
    never complete), else None. The caller requires it to hold unchanged for ``_DEADLOCK_S``."""
    if len(waiting) < 2 or len(waiting) < len(ranks):
        return None
    state = tuple(ranks[r].blocked_in() for r in sorted(waiting))
    if None in state or len({count for count, _ in state}) != 1 or len({name for _, name in state}) == 1:
        return None
    return state


def _collect(ranks: list[RankHandle], printing: set[int], deadline: float, timeout: float) -> list:
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
            raise _failure(failures, returned=[r.rank for r in ranks if r.result is not None])
    _await_exits(ranks, printing, min(deadline, time.monotonic() + _EXIT_GRACE_S))
    return [torch.load(io.BytesIO(rank.result), map_location="cpu", weights_only=False)
            for rank in ranks]


def _poll(ranks: list[RankHandle], waiting: set[int], printing: set[int], timeout: float) -> list:
    """Wait up to ``timeout`` s for messages, output or exits of the ``waiting`` ranks and handle
    them. Ranks that sent a result, raised or died leave ``waiting``. Returns (time, LaunchError)s."""
    handles = {ranks[r].conn: r for r in waiting if ranks[r].conn is not None}
    handles.update({fd: r for r in waiting for fd in ranks[r].native})
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
            errors = [(0.0, _death_error(rank, printing))]
        if errors or rank.result is not None:
            waiting.discard(r)
        failures += errors
    return failures


def _await_exits(ranks: list[RankHandle], printing: set[int], until: float) -> None:
    """Let ranks that sent their results finish (their exit handlers may still print) until the
    monotonic time ``until``, relaying their output; the caller's finally stops stragglers."""
    for rank in ranks:
        while rank.process.poll() is None and time.monotonic() < until:
            fds = [fd for each in ranks for fd in each.native]
            if not fds:  # every pipe has ended: nothing more to relay, just wait
                _wait(rank.process, max(0.0, until - time.monotonic()))
                break
            multiprocessing.connection.wait(fds, timeout=min(0.05, max(0.0, until - time.monotonic())))
            for each in ranks:
                relay_native(each, printing)
    for rank in ranks:
        relay_native(rank, printing)


_LOST_PEER = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a peer gone


def _failure(failures: list, returned: list[int] = ()) -> LaunchError:
    """One LaunchError leading with the earliest failure; the others follow as its echoes. Where
    the failure is a lost connection and ranks in ``returned`` had already ended their function,
    it says so: that peer did not crash, it left a collective the others were still in."""
    failures.sort(key=lambda f: f[0])
    first = failures[0][1]
    crashed = any(error.exitcode not in (None, 0) for _, error in failures)  # then that is the cause
    if returned and not crashed and any(words in str(first).split("\n")[0] for words in _LOST_PEER):
        which = ", ".join(str(r) for r in returned)
        first = LaunchError(f"{first}\n(rank{'s' if len(returned) > 1 else ''} {which} had returned from the "
                            "function while this rank was still in a collective: every rank must make the "
                            "same collective calls, in the same order)",
                            rank=first.rank, traceback=first.traceback, exitcode=first.exitcode)
    if len(failures) == 1:
        return first
    echoes = "\n".join(f"  {str(e).splitlines()[0]}" for _, e in failures[1:])
    return LaunchError(f"{first}\nThen, probably as a consequence:\n{echoes}", rank=first.rank,
                       traceback=first.traceback, exitcode=first.exitcode)


def _drain(rank: RankHandle, printing: set[int], prefixed: bool) -> list:
    """Read every message this rank has sent so far, then relay its output below Python; return
    its errors as (time, LaunchError). A rank sends no message while its fds 1 and 2 hold output
    not read here yet (``launch_rank``), so messages come after what was written before them,
    and output read after a message was written after it."""
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
                relay(text, stream, f"[rank {rank.rank}] " if prefixed else "")
        elif kind == "result":
            rank.result = body[0]
        elif kind == "error":
            when, summary, tb = body
            message = f"rank {rank.rank} raised {summary}\n--- traceback of rank {rank.rank} ---\n"
            message += tb
            if rank.rank not in printing:
                message += rank.tail_text()
            errors.append((when, LaunchError(message, rank=rank.rank, traceback=tb)))
    relay_native(rank, printing)
    return errors


def _death_error(rank: RankHandle, printing: set[int]) -> LaunchError:
    code = _wait(rank.process, _STOP_GRACE_S)
    relay_native(rank, printing)  # its last words below Python, e.g. C++'s before an abort
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with code {code}"
    message = f"rank {rank.rank} {how} without reporting a result" + rank.tail_text()
    return LaunchError(message, rank=rank.rank, exitcode=code)


def _timeout_error(ranks: list[RankHandle], waiting: set[int], timeout: float,
                   deadlock_after: float | None = None) -> LaunchTimeout:
    last = [rank.last_collective() for rank in ranks]
    if deadlock_after is None:
        head = f"launch timed out after {timeout:g} s"
    else:
        head = (f"deadlock: the ranks wait in different collectives, which can never complete; "
                f"stopped after {deadlock_after:.0f} s instead of waiting for the {timeout:g} s timeout")
    lines = [f"{head}; ranks still running: "
             f"{', '.join(map(str, sorted(waiting)))}. The collective each rank waits in, else the last it entered "
             f"(of fsdp_lab.collectives' calls: torch.distributed's own are not seen):"]
    for rank in ranks:
        state = "" if rank.rank in waiting else " (finished)"
        lines.append(f"  rank {rank.rank}{state}: {last[rank.rank]}")
    lines.append("Ranks waiting in different collectives (or one rank never entering a "
                 "collective the others wait in) is the usual cause of a hang.")
    return LaunchTimeout("\n".join(lines), last)


def _stop(ranks: list[RankHandle], printing: set[int]) -> None:
    """Stop every child still running (SIGTERM, then SIGKILL after a grace) and reap them all;
    relay what they wrote below Python before they ended. Safe to call more than once."""
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
        relay_native(rank, printing)
        rank.close_native()


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
