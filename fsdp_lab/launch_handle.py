"""The parent's side of one rank of :func:`fsdp_lab.launch`: starting it, what it sent, and its output.

A rank writes to the parent through three pipes: the message pipe (its Python prints line by
line, its result, its traceback) and the two pipes that are its file descriptors 1 and 2, where
C++ libraries and the programs it starts write. :class:`RankHandle` reads all three, keeps the
rank's last lines for a crash report, and relays the output of printing ranks to the caller's
``sys.stdout``/``sys.stderr``. ``fsdp_lab.launch_rank`` sends no message while its fds 1 and 2
hold output not yet read, so reading messages first and then that output keeps the order the
rank wrote in.
"""

from __future__ import annotations

import codecs
import collections
import json
import mmap
import multiprocessing.connection
import os
import re
import subprocess
import sys
from pathlib import Path

from fsdp_lab import forkserver

RANK_MODULE = "fsdp_lab.launch_rank"  # what each rank runs (python -m); launch never imports it
SLOT_BYTES = 512  # bytes per rank in the progress file: its last collective's description
TAIL_LINES = 20  # recent output lines kept per rank for crash reports
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the directory holding fsdp_lab/


def rank_environment() -> dict:
    """The environment a rank starts with: the caller's, with this fsdp_lab first on the path
    (the rank must import this same fsdp_lab before it can read the caller's sys.path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def start_rank(spec: dict, slots: mmap.mmap, by_fork: bool) -> "RankHandle":
    """Start one rank as ``spec`` says (``fsdp_lab.launch_rank``'s SPEC, less msg_fd, set here),
    passing it its file descriptors and, as its stdout and stderr, two pipes the handle reads:
    forked from the fork server (``fsdp_lab.forkserver``) when ``by_fork``, else as
    ``python -m fsdp_lab.launch_rank``. ``slots`` is the progress file the rank writes its
    collectives into. Raises what starting the process raises (OSError; RuntimeError from the
    fork server), with every descriptor made here closed."""
    read_fd, write_fd = os.pipe()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    spec["msg_fd"] = write_fd
    env = rank_environment()
    try:
        if by_fork:
            process = forkserver.start_rank(spec, env, stdout=out_write, stderr=err_write)
        else:
            process = subprocess.Popen(
                [sys.executable, "-m", RANK_MODULE, json.dumps(spec)], env=env,
                stdin=subprocess.DEVNULL,  # a rank waiting for input would hang: it reads EOF
                stdout=out_write, stderr=err_write,
                pass_fds=(write_fd, spec["call_fd"], spec["slot_fd"], spec["lifeline_fd"]),
            )
    except BaseException:
        for fd in (read_fd, out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (write_fd, out_write, err_write):  # the child holds the only write ends
            os.close(fd)
    conn = multiprocessing.connection.Connection(read_fd, writable=False)
    return RankHandle(spec["rank"], process, conn, slots, {out_read: "stdout", err_read: "stderr"})


class RankHandle:
    """The parent's view of one rank: its process, message pipe, output pipes (``native``: read
    end -> "stdout"/"stderr"), progress slot, result and last output lines (``tail``)."""

    def __init__(self, rank: int, process: subprocess.Popen, conn, slots: mmap.mmap,
                 native: dict[int, str]):
        self.rank, self.process, self.conn, self._slots = rank, process, conn, slots
        self.result: bytes | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.native = native
        self._partial = {fd: "" for fd in native}
        self._decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in native}
        for fd in native:
            os.set_blocking(fd, False)

    def read_native(self) -> list[tuple[str, str]]:
        """The whole lines the rank has written to its fds 1 and 2 since the last call, as
        (stream, line) without the newline; the last line of a closed pipe counts as whole.
        Never waits. A pipe at its end is closed (another process the rank started may still
        hold it, then it stays open until ``close_native``)."""
        lines = []
        for fd, stream in list(self.native.items()):
            while True:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                text = self._partial[fd] + self._decoders[fd].decode(data, final=not data)
                complete = text.split("\n")
                self._partial[fd] = "" if not data else complete.pop()
                lines += [(stream, line) for line in complete if line or data]
                if not data:
                    self.close_native(fd)
                    break
        return lines

    def close_native(self, fd: int | None = None) -> None:
        """Close the rank's output pipe ``fd`` (all of them for None); their unread output is lost."""
        for each in list(self.native) if fd is None else [fd]:
            os.close(each)
            del self.native[each]

    def tail_text(self) -> str:
        """The rank's last output lines as a report section ("" if it printed nothing)."""
        lines = "\n".join(self.tail)
        return f"\n--- last output of rank {self.rank} ---\n{lines}" if lines else ""

    def _slot(self) -> str:
        slot = self._slots[self.rank * SLOT_BYTES:(self.rank + 1) * SLOT_BYTES]
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


def relay_native(rank: RankHandle, printing: set[int]) -> None:
    """Relay the whole lines the rank wrote to its fds 1 and 2 (when it prints; prefixed when
    more than one rank does) and keep them for its crash report."""
    by_stream: dict[str, list[str]] = {}
    for stream, line in rank.read_native():
        if expected_gloo_connection(line):
            continue
        rank.tail.append(line)
        by_stream.setdefault(stream, []).append(line + "\n")
    if rank.rank in printing:
        for stream, lines in by_stream.items():
            relay("".join(lines), stream, f"[rank {rank.rank}] " if len(printing) > 1 else "")


_GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                             r"Expected number of connected peer ranks is : (\d+)\s*")


def expected_gloo_connection(line: str) -> bool:
    """Whether ``line`` is gloo's note that a rank connected to as many peers as expected, which
    gloo's TCP transport writes to stdout at every start in some torch releases (2.8, 2.10);
    later gloo logs it at a debug level only. A count short of the expected one is kept."""
    match = _GLOO_CONNECTED.fullmatch(line)
    return match is not None and match.group(1) == match.group(2)


def relay(text: str, stream: str, prefix: str) -> None:
    """Write ``text`` to the caller's stream ("stdout"/"stderr"), each line after ``prefix``."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    if out is None:  # a caller started without that stream (Python sets it to None)
        return
    if prefix:  # whole lines only, or another rank's line would continue this one
        text = "".join(prefix + line + "\n" for line in text.splitlines())
    out.write(text)
    out.flush()


