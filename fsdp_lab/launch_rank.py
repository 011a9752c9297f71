"""One rank of ``fsdp_lab.launch``: ``main(spec)`` in a process forked from the fork server
(``fsdp_lab.forkserver_main``), or ``python -m fsdp_lab.launch_rank SPEC`` (started by launch).

A fresh interpreter that imports only what the rank function needs: never the caller's main
module, so the caller may be a notebook, ``python -`` or a script without a
``__main__`` guard. In order:

1. start a watcher thread: it ends this rank if the parent dies (even by SIGKILL), and every
   0.1 s copies ``fsdp_lab.collectives.blocked()`` and ``waiting_in()`` (while blocked) or
   ``last_entered()`` into this rank's slot of the shared progress file, which the parent reads
   to explain a hang and to stop a deadlock early (the collectives' own path only counts waits in and out); send prints to the parent line
   by line through the message pipe (fds 1 and 2 are pipes the parent reads too: C++ libraries
   and child processes write there, and each message waits until the parent has read what was
   written there before it, so the parent sees both in the order they were written);
2. set the rank's environment (RANK, WORLD_SIZE, LOCAL_RANK, its device, its threads, and gloo's
   network interface: loopback, unless the caller set ``GLOO_SOCKET_IFNAME``);
3. read the caller's ``sys.path``, ``sys.argv`` and the pickled call from the call file,
   unpickle (modules are imported by name here), initialise the default process group on
   the launch's TCPStore;
4. run ``fn`` and send back its result (or its traceback), then leave at once.

SPEC is JSON: rank, world_size, backend, device, port, prefix, timeout (s), call_bytes and
slot_bytes (sizes), and the file descriptors the parent passed: call_fd (the call file),
msg_fd (write end of the message pipe), slot_fd (the progress file), lifeline_fd (read end of
a pipe whose write end only the parent holds). Stdout and stderr are pipes the parent reads.
"""

from __future__ import annotations

import atexit
import datetime
import fcntl
import io
import json
import mmap
import multiprocessing.connection
import os
import pickle
import select
import signal
import struct
import sys
import termios
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_lab import collectives, pickling
from fsdp_lab import dist as fdist

_PROGRESS_PERIOD_S = 0.1  # how often the watcher copies the last collective into the slot
_ORDER_WAIT_S = 0.5  # longest a message waits for the parent to read the output written before it


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


def main(spec: dict) -> None:
    """Run one rank as ``spec`` says (see the module docstring); never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    rank, world_size, backend, device = spec["rank"], spec["world_size"], spec["backend"], spec["device"]
    _start_watcher(spec["lifeline_fd"], spec["slot_fd"], spec["slot_bytes"], rank, world_size)
    conn = multiprocessing.connection.Connection(spec["msg_fd"], readable=False)
    lock = threading.Lock()

    def send(message):
        with lock:
            _await_output_read()
            conn.send(message)

    sys.stdout, sys.stderr = _LineWriter(send, "stdout"), _LineWriter(send, "stderr")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ[fdist.DEVICE_ENV] = device
    os.environ[fdist.IN_LAUNCH_ENV] = "1"
    # Every rank of a launch runs on this machine. Where the host name does not resolve, gloo
    # would print its warning into every cell that launches.
    fdist.bind_gloo_to_loopback()
    torch.set_num_threads(rank_threads(world_size, os.environ))
    try:
        with mmap.mmap(spec["call_fd"], spec["call_bytes"], access=mmap.ACCESS_READ) as call_file:
            caller_path, caller_argv, call = pickle.loads(call_file)
        sys.path[:], sys.argv[:] = caller_path, caller_argv
        fn, args, kwargs = pickling.loads(call)
        del call
        timeout = datetime.timedelta(seconds=spec["timeout"])
        store = dist.PrefixStore(spec["prefix"], dist.TCPStore(
            "127.0.0.1", spec["port"], None, is_master=False, timeout=timeout))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(
            fdist.nccl_with_gloo_for_cpu(backend), store=store, rank=rank, world_size=world_size,
            timeout=timeout,
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
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    conn.close()
    # No interpreter teardown and no destroy_process_group(): gloo's threads outlive the groups
    # whenever something still holds one, and one touching Python during teardown aborts the
    # process; freeing a group nothing else holds waits, holding the GIL, for a worker thread
    # that may need the GIL (see fsdp_lab.dist.exit_distributed). Teardown would also take
    # ~0.5 s, longer than the rest of a short launch. Run the exit handlers (what users
    # registered with atexit) and leave.
    atexit._run_exitfuncs()
    os._exit(0)


def rank_threads(world_size: int, env) -> int:
    """CPU threads for each of ``world_size`` ranks: the machine's cores shared out
    (``cpu_count // world_size``, at least 1), no more than ``OMP_NUM_THREADS`` when the caller's
    environment ``env`` sets it to a positive integer (as torchrun leaves a set value alone).
    Where other processes keep the cores busy, a second OpenMP thread makes the small
    operations of these models wait at every parallel region for a thread that is not running:
    a step of the "cpu" Llama measured 25x slower with 2 threads than with 1 beside two busy
    loops on 2 cores, and no faster with 2 on idle cores. A value that is not a positive
    integer is ignored (OpenMP would ignore it too)."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    limit = env.get("OMP_NUM_THREADS", "").strip()
    if limit.isdigit() and int(limit) > 0:
        threads = min(threads, int(limit))
    return threads


def _await_output_read() -> None:
    """Wait (up to ``_ORDER_WAIT_S``) until the parent has read what this rank wrote to its fds 1
    and 2, the pipes C++ libraries and child processes write to: a print or result sent now then
    reaches the parent after the output written before it. Where a pipe cannot say how much it
    holds (FIONREAD on its write end: Linux), it does not wait."""
    deadline = None
    while _unread_output_bytes():
        now = time.monotonic()
        deadline = deadline or now + _ORDER_WAIT_S
        if now >= deadline:
            return
        time.sleep(0.0002)


def _unread_output_bytes() -> int:
    """Bytes in this rank's stdout and stderr pipes that the parent has not read yet."""
    total = 0
    for fd in (1, 2):
        try:
            total += struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return total


def _serialise(result: Any) -> bytes:
    """``result`` as bytes. torch.save copies CUDA storages to host memory and the parent loads
    with map_location="cpu", so tensors anywhere in ``result`` (lists, dicts, dataclasses...)
    come back on CPU without the parent touching CUDA. Classes defined in the caller's notebook
    or script come back as themselves (cloudpickle tracks the classes it sent)."""
    buffer = io.BytesIO()
    try:
        torch.save(result, buffer, pickle_module=pickling)
    except Exception as exc:
        raise TypeError(
            f"the return value ({type(result).__name__}) could not be sent back: {exc}. "
            "Return tensors, numbers, strings or containers of them (DTensor: .full_tensor())."
        ) from exc
    return buffer.getvalue()


def _start_watcher(lifeline_fd: int, slot_fd: int, slot_bytes: int, rank: int, world_size: int) -> None:
    """One daemon thread that ends this rank when the parent dies (the parent holds the only
    write end of the lifeline pipe, so a read returns b"" once it is gone) and keeps this
    rank's progress slot showing whether it waits in a collective and the last one entered."""
    slots = mmap.mmap(slot_fd, slot_bytes * world_size)
    start = rank * slot_bytes

    def watch():
        written = None
        while True:
            readable, _, _ = select.select([lifeline_fd], [], [], _PROGRESS_PERIOD_S)
            if readable and not os.read(lifeline_fd, 1):
                os._exit(1)
            # "W" and the collective it waits for while blocked, else "R" and the last one entered
            blocked = collectives.blocked()
            entered = "W" + collectives.waiting_in() if blocked else "R" + collectives.last_entered()
            if entered != written:
                data = entered.encode("utf-8", "replace")[: slot_bytes - 1]
                slots[start:start + slot_bytes] = data.ljust(slot_bytes, b"\0")
                written = entered

    threading.Thread(target=watch, name="fsdp_lab-rank-watch", daemon=True).start()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
