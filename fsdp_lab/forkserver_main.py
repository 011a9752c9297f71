"""The fork server's process: ``python -m fsdp_lab.forkserver_main FD [MODULE ...]`` (started
by launch; MODULEs are the caller's extra preloads, ``fsdp_lab.start_fork_server(preload=...)``).

Importing torch takes seconds; a rank forked from a process that has already imported it
starts in milliseconds. This process imports what a rank needs (torch,
``fsdp_lab.launch_rank`` and ``PRELOAD``) once, runs nothing on any device, starts no thread of its own, and
then serves the parent over the Unix socket FD (message boundaries kept, SOCK_SEQPACKET):

- ``{"op": "fork", "spec": ..., "env": ...}`` with the rank's four file descriptors and its
  stdout and stderr attached: fork a child that takes ``env`` as its environment and those two
  as its fds 1 and 2, and runs ``launch_rank.main(spec)`` with the four descriptors, answer
  ``{"op": "forked", "pid": ...}``;
- ``{"op": "signal", "pid": ..., "sig": ...}``: signal that child if it has not been reaped
  (so a pid the system has given to another process is never signalled);
- every child that ends is reaped here and reported as ``{"op": "exit", "pid": ..., "code": ...}``
  (the code as ``subprocess`` gives it: negative for a signal).

It leaves when the parent closes the socket or dies. Which parent state it was started with
(environment, working directory, fsdp_lab's sources) is the parent's business: see
``fsdp_lab.forkserver``.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import select
import signal
import socket
import sys

import torch  # imported once here so that forked ranks start without importing it

from fsdp_lab import launch_rank
from fsdp_lab.forkserver import RANK_FDS

# What nearly every rank of a lab or test imports, slowest first: DTensor (which FSDP and the
# memory tracker touch) takes over a second. Imported, never run. (torch's compiler came with
# ``fsdp_lab`` itself, above.)
PRELOAD = ("torch.distributed.tensor", "fsdp_lab.fsdp1", "fsdp_lab.fsdp2",
           "fsdp_lab.memory", "fsdp_lab.models", "fsdp_lab.qlora", "fsdp_lab.timeline")
for _module in PRELOAD:
    importlib.import_module(_module)

_MESSAGE_BYTES = 1 << 20  # largest request: a rank's spec and environment (JSON, a few KiB)
_REAP_PERIOD_S = 0.05  # without pidfds: how often ended children are looked for


def serve(sock: socket.socket) -> None:
    """Answer requests on ``sock`` until the parent closes it; reap and report children."""
    children: set[int] = set()
    exits: dict[int, int] = {}  # a pidfd per child (readable once it ends) -> its pid
    try:
        sock.sendall(json.dumps({"op": "ready"}).encode())
    except OSError:  # the parent left (or replaced this server) while torch was loading
        return
    while True:
        # With pidfds an ending child wakes this loop at once; without, look every period.
        timeout = None if hasattr(os, "pidfd_open") else _REAP_PERIOD_S
        readable, _, _ = select.select([sock, *exits], [], [], timeout)
        for fd in readable:
            if fd in exits:
                del exits[fd]
                os.close(fd)
        _reap(sock, children)
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, len(RANK_FDS) + 2)
        except (ConnectionError, OSError):
            return
        if not data:
            return
        request = json.loads(data)
        if request["op"] == "fork":
            pid = _fork_rank(sock, request["spec"], request["env"], fds, list(exits))
            children.add(pid)
            if hasattr(os, "pidfd_open"):
                exits[os.pidfd_open(pid)] = pid
            sock.sendall(json.dumps({"op": "forked", "pid": pid}).encode())
        elif request["op"] == "signal" and request["pid"] in children:
            os.kill(request["pid"], request["sig"])


def _fork_rank(sock: socket.socket, spec: dict, env: dict, fds: list[int], pidfds: list[int]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            sock.close()
            for fd in pidfds:  # the other ranks' ends are the server's to watch
                os.close(fd)
            stdout, stderr = fds[len(RANK_FDS):]
            os.dup2(stdout, 1)  # as Popen(stdout=..., stderr=...) would
            os.dup2(stderr, 2)
            os.close(stdout)
            os.close(stderr)
            os.environ.clear()
            os.environ.update(env)
            # A fresh interpreter seeds these from the OS; a fork would share the server's state.
            random.seed()
            if "numpy.random" in sys.modules:
                sys.modules["numpy.random"].seed()
            torch.seed()  # unseeded torch.rand / dropout must differ by rank, as in spawned ranks
            launch_rank.main(dict(spec, **dict(zip(RANK_FDS, fds[:len(RANK_FDS)]))))
        finally:
            os._exit(1)  # main never returns; anything raised before it must not run on here
    for fd in fds:  # the child holds them now; the message pipe must close when it ends
        os.close(fd)
    return pid


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        try:
            sock.sendall(json.dumps({"op": "exit", "pid": pid, "code": code}).encode())
        except OSError:
            return


if __name__ == "__main__":
    # Ctrl-C is the parent's to handle; forked ranks inherit this, as launch_rank would set it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A caller started without fds 0-2 (a daemon) leaves them free: descriptors received later
    # would take those numbers, and a rank's dup2 onto 1 and 2 would overwrite them.
    for _fd in (0, 1, 2):
        try:
            os.fstat(_fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: _fd
    server_socket = socket.socket(fileno=int(sys.argv[1]))
    for _module in sys.argv[2:]:
        importlib.import_module(_module)
    serve(server_socket)
