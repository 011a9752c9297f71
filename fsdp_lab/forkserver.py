"""Start ranks by forking them from a server that has already imported torch.

A fresh interpreter spends seconds importing torch before a rank runs a line of the user's
code; on a small machine that is most of a short launch, and a lab launches many times. So
:func:`fsdp_lab.launch` asks one fork server per calling process (``fsdp_lab.forkserver_main``,
started at the first launch, or earlier by :func:`start_server`) to fork each rank. A forked
rank is the fresh interpreter it replaces, with torch already imported: it gets the caller's
environment as it is at the launch; the server was started in the caller's working directory,
with this fsdp_lab's sources and the environment variables read while torch loads as they are
now, and a new one replaces it when any of those has changed; it never touches a device or
starts a thread before forking.

:class:`ForkedProcess` stands in for ``subprocess.Popen`` in launch (``pid``, ``poll``,
``wait``, ``terminate``, ``kill``, ``returncode``): the server reaps each rank and reports its
exit code, and signals it on request only while it has not been reaped.

Linux only (``os.fork`` after importing torch is not safe on macOS), and CPU ranks only (a
process forked after CUDA's driver was loaded cannot use CUDA, so GPU ranks start fresh). For
GPU ranks, on other systems, or with ``FSDP_LAB_LAUNCH_START=spawn`` in the environment, launch
starts each rank as its own ``python -m fsdp_lab.launch_rank``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

START_ENV = "FSDP_LAB_LAUNCH_START"  # "spawn": start every rank as a fresh interpreter
SERVER_MODULE = "fsdp_lab.forkserver_main"
# attached to a fork request, in order, and then the rank's stdout and stderr
RANK_FDS = ("msg_fd", "call_fd", "slot_fd", "lifeline_fd")
_READY_TIMEOUT_S = 300.0  # importing torch on a loaded 2-core machine can take a minute
_MESSAGE_BYTES = 1 << 16
_PACKAGE = Path(__file__).resolve().parent
# Prefixes of the variables Python, torch, CUDA and the thread and math libraries may read while
# they load or pick their kernels (a change starts a new server); fsdp_lab's own to be safe.
_IMPORT_TIME_ENV = ("PYTHON", "LD_", "TORCH", "PYTORCH", "ATEN_", "CUDA", "NCCL", "GLOO", "OMP_",
                    "KMP_", "GOMP_", "MKL", "ONEDNN_", "DNNL_", "OPENBLAS", "FSDP_LAB", "TRITON",
                    "HF_", "TRANSFORMERS")


def enabled() -> bool:
    """Whether launch forks ranks from the server: on Linux, unless ``FSDP_LAB_LAUNCH_START``
    is "spawn". Raises ValueError for any other value of that variable."""
    choice = os.environ.get(START_ENV, "fork")
    if choice not in ("fork", "spawn"):
        raise ValueError(f"{START_ENV} must be 'fork' or 'spawn', got {choice!r}")
    return choice == "fork" and sys.platform.startswith("linux") and hasattr(socket, "send_fds")


def start_rank(spec: dict, env: dict, stdout: int, stderr: int) -> "ForkedProcess":
    """Fork one rank running ``fsdp_lab.launch_rank.main(spec)`` from the server for ``env``
    (the server is started or replaced first if needed), with the descriptors ``stdout`` and
    ``stderr`` as its fds 1 and 2. They and the descriptors named in ``spec`` (msg_fd, call_fd,
    slot_fd, lifeline_fd) are sent along; the caller closes its own copies as it would after
    ``Popen(stdout=..., stderr=..., pass_fds=...)``. Raises RuntimeError when the server cannot
    start or answer."""
    with _LOCK:
        return _server_for(env).fork(spec, env, (stdout, stderr))


def start_server(env: dict, preload: tuple[str, ...] = ()) -> None:
    """Start the server ``start_rank`` would use for ``env`` now and return at once: it imports
    torch (and the modules in ``preload``) in the background, and the first fork waits only for
    what is left of that. Nothing happens when a server for ``env`` that has imported
    ``preload`` is already running. Raises OSError when the server's process cannot be started;
    a server that starts and then fails is reported by the first ``start_rank``."""
    with _LOCK:
        _server_for(env, preload)


def _server_for(env: dict, preload: tuple[str, ...] = ()) -> "_Server":
    """The running server for ``env`` that has imported ``preload``, started (replacing one for
    another state, or one without those modules) if needed."""
    global _SERVER
    key = _state_key(env)
    if (_SERVER is None or _SERVER.key != key or not _SERVER.alive()
            or not set(preload) <= set(_SERVER.preload)):
        if _SERVER is not None:
            if _SERVER.key == key and _SERVER.alive():  # only more modules asked for: keep its own
                preload = tuple(dict.fromkeys((*_SERVER.preload, *preload)))
            _SERVER.close()
        _SERVER = _Server(env, key, preload)
    return _SERVER


class ForkedProcess:
    """One forked rank, seen as launch sees a ``subprocess.Popen``."""

    def __init__(self, server: "_Server", pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        """The exit code once the rank has ended (negative: killed by that signal), else None.
        If the server itself died, its ranks' codes are lost: one that has ended reads as
        killed (-SIGKILL)."""
        if self.returncode is None:
            self._server.pump(0.0)
            self.returncode = self._server.exit_codes.get(self.pid)
            if self.returncode is None and self._server.sock is None and not _exists(self.pid):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` s for the rank to end; its exit code. Raises
        ``subprocess.TimeoutExpired`` if it is still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._server.pump(min(left, 0.05))
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM, if the rank has not ended."""
        self._server.signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, if the rank has not ended."""
        self._server.signal(self.pid, signal.SIGKILL)


class _Server:
    """The parent's end of one fork server: its process, socket and the exits it reported.
    The process is started here; its "ready" is awaited by the first fork, so the imports it
    does first can overlap with the caller's own work."""

    def __init__(self, env: dict, key: tuple, preload: tuple[str, ...] = ()):
        self.key, self.preload, self.exit_codes, self.ready = key, tuple(preload), {}, False
        self._lock = threading.Lock()
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(child_end.fileno()), *self.preload],
                env=env, stdin=subprocess.DEVNULL, pass_fds=(child_end.fileno(),))
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.sock = parent_end

    def alive(self) -> bool:
        return self.sock is not None and self.process.poll() is None

    def _await_ready(self) -> None:
        """Wait (up to ``_READY_TIMEOUT_S``) for the server's "ready"; RuntimeError if it fails."""
        if self.ready:
            return
        message = self._receive(_READY_TIMEOUT_S)
        if message != {"op": "ready"}:
            code = self.process.poll()
            self.close()
            raise RuntimeError(f"fsdp_lab's fork server did not start (exit code {code}); its error "
                               f"is above. Set {START_ENV}=spawn to start each rank as a fresh "
                               "interpreter instead")
        self.ready = True

    def fork(self, spec: dict, env: dict, std_fds: tuple[int, int]) -> ForkedProcess:
        fds = [spec[name] for name in RANK_FDS] + list(std_fds)
        with self._lock:
            self._await_ready()
            try:
                request = {"op": "fork", "spec": spec, "env": env}
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            except OSError as exc:
                raise RuntimeError(f"fsdp_lab's fork server is gone ({exc}); launch again to "
                                   "start a new one") from exc
            while True:  # exits of earlier ranks may arrive before the answer
                message = self._receive(_READY_TIMEOUT_S)
                if message is None:
                    raise RuntimeError("fsdp_lab's fork server stopped answering; launch again "
                                       "to start a new one")
                if message["op"] == "forked":
                    return ForkedProcess(self, message["pid"])
                self._record(message)

    def pump(self, timeout: float) -> None:
        """Record the exits the server reported, waiting up to ``timeout`` s for the first."""
        with self._lock:
            while True:
                message = self._receive(timeout)
                if message is None:
                    return
                self._record(message)
                timeout = 0.0

    def signal(self, pid: int, sig: int) -> None:
        with self._lock:
            if pid in self.exit_codes:
                return
            if self.sock is None:  # the server died; its ranks live on until signalled
                if _exists(pid):
                    os.kill(pid, sig)
                return
            try:
                self.sock.send(json.dumps({"op": "signal", "pid": pid, "sig": int(sig)}).encode())
            except OSError:
                pass

    def close(self) -> None:
        """Close the socket (the server leaves) and reap the server's process; one still
        loading torch holds no ranks and is killed instead of waited for."""
        if not self.ready and self.process.poll() is None:
            self.process.kill()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _record(self, message: dict) -> None:
        if message["op"] == "exit":
            self.exit_codes[message["pid"]] = message["code"]

    def _receive(self, timeout: float) -> dict | None:
        """The next message, or None when none came within ``timeout`` s or the server is gone."""
        if self.sock is None:
            return None
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not readable:
            return None
        try:
            data = self.sock.recv(_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self.sock.close()
            self.sock = None
            return None
        return json.loads(data)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _state_key(env: dict) -> tuple:
    """What a forked rank would otherwise see differently from a fresh interpreter: the
    interpreter, the environment variables read while Python, torch and its libraries load
    (``_IMPORT_TIME_ENV``), the working directory and fsdp_lab's sources (their mtimes). The
    rest of the environment is read later and is sent with each rank."""
    sources = tuple(sorted((str(p), p.stat().st_mtime_ns) for p in _PACKAGE.rglob("*.py")))
    read_at_import = tuple(sorted((k, v) for k, v in env.items()
                                  if k.startswith(_IMPORT_TIME_ENV) and not _set_by_torch(k, v)))
    return sys.executable, read_at_import, os.getcwd(), sources


def _set_by_torch(name: str, value: str) -> bool:
    """Whether ``name=value`` is what importing torch's dynamo writes into the environment
    itself: the inductor cache directory at its default. The server imports dynamo and writes
    the same, so a caller that imported dynamo after starting a server still matches it."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")  # loaded by whoever set it
    return (name == "TORCHINDUCTOR_CACHE_DIR" and utils is not None
            and value == os.path.abspath(utils.default_cache_dir()))


_LOCK = threading.Lock()
_SERVER: _Server | None = None
