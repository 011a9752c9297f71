"""fsdp_lab.launch when a rank fails: a raise, a silent exit, a hang, a deadlock, Ctrl-C, a killed
caller, an unsendable result. Each failure gets exactly one launch, and every test checks that no
rank process is left behind.
"""

import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import collectives
from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from _launch_helpers import REPO, alive, env_with_repo, pids, record_pid



def _raise_on_rank_1(pid_dir):
    record_pid(pid_dir)
    dist.barrier()  # both pids are on disk before anything fails
    if dist.get_rank() == 1:
        print("rank 1 about to fail")
        raise ValueError("boom on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a rank that never comes


def test_raising_rank_names_itself_and_stops_the_others(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank_1, str(tmp_path), world_size=2, timeout=120)
    err = info.value
    assert type(err) is LaunchError  # a failure report, not the timeout
    assert err.rank == 1
    message = str(err)
    assert message.startswith("rank 1 raised ValueError: boom on purpose")
    assert 'in _raise_on_rank_1\n    raise ValueError("boom on purpose")' in message
    assert "rank 1 about to fail" in message  # output of a non-printing rank
    rank_pids = pids(tmp_path)
    assert len(rank_pids) == 2 and not any(alive(pid) for pid in rank_pids)


def _exit_silently(pid_dir):
    record_pid(pid_dir)
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_rank_dying_without_report_gives_its_exit_code(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(_exit_silently, str(tmp_path), world_size=2, timeout=120)
    assert type(info.value) is LaunchError
    assert info.value.exitcode == 3 and info.value.rank == 1
    assert str(info.value).startswith("rank 1 exited with code 3 without reporting a result")
    rank_pids = pids(tmp_path)
    assert len(rank_pids) == 2 and not any(alive(pid) for pid in rank_pids)


def _killed_on_rank_1(pid_dir):
    record_pid(pid_dir)
    dist.barrier()
    if dist.get_rank() == 1:
        os.write(2, b"last words below Python\n")  # as C++ writes before it aborts
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_rank_killed_by_a_signal_names_the_signal(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(_killed_on_rank_1, str(tmp_path), world_size=2, timeout=120)
    assert info.value.exitcode == -signal.SIGKILL and info.value.rank == 1
    assert str(info.value).startswith("rank 1 was killed by signal SIGKILL (exit code -9) without "
                                      "reporting a result\n--- last output of rank 1 ---\n"
                                      "last words below Python")
    rank_pids = pids(tmp_path)
    assert len(rank_pids) == 2 and not any(alive(pid) for pid in rank_pids)


def _skip_second_all_reduce(pid_dir):
    record_pid(pid_dir)
    t = torch.ones(4)
    collectives.all_reduce(t)
    if dist.get_rank() == 1:
        threading.Event().wait()  # rank 1 never enters the second all-reduce
    collectives.all_reduce(t)


def test_hang_ends_at_timeout_naming_each_ranks_last_collective(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        # 15 s: room for two torch imports on a loaded 2-core machine before the hang starts
        launch(_skip_second_all_reduce, str(tmp_path), world_size=2, timeout=15)
    last = info.value.last_collectives
    assert last[0].startswith("all_reduce #2 (16 B float32, group of 2)"), last
    assert last[1].startswith("all_reduce #1 (16 B float32, group of 2)"), last
    message = str(info.value)
    assert "timed out after 15 s" in message
    assert f"rank 0: {last[0]}" in message and f"rank 1: {last[1]}" in message
    rank_pids = pids(tmp_path)
    assert len(rank_pids) == 2 and not any(alive(pid) for pid in rank_pids)


def _wait_forever(pid_dir):
    record_pid(pid_dir)
    dist.barrier()
    print("ready")
    threading.Event().wait()


class _InterruptOnReady(io.StringIO):
    """Stands in for the notebook's stdout: Ctrl-C arrives once rank 0 says it is ready."""

    def write(self, text):
        super().write(text)
        if "ready" in text:
            os.kill(os.getpid(), signal.SIGINT)
        return len(text)


def test_keyboard_interrupt_stops_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _InterruptOnReady())
    # a shell starts background jobs with SIGINT ignored, and Python then keeps it ignored: make
    # Ctrl-C raise KeyboardInterrupt here however pytest was started, as it does in a notebook
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_wait_forever, str(tmp_path), world_size=2, timeout=120)
    finally:
        signal.signal(signal.SIGINT, previous)
    rank_pids = pids(tmp_path)
    assert len(rank_pids) == 2 and not any(alive(pid) for pid in rank_pids)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux)")
def test_ranks_end_when_the_calling_process_is_killed(tmp_path):
    # A notebook kernel that is killed outright runs no finally: the ranks notice by themselves.
    code = textwrap.dedent(f"""
        import os
        import threading
        from pathlib import Path
        import torch.distributed as dist
        import fsdp_lab

        def wait_forever():
            Path({str(tmp_path)!r}, f"rank{{dist.get_rank()}}.pid").write_text(str(os.getpid()))
            Path({str(tmp_path)!r}, "parent").write_text(str(os.getppid()))  # the fork server
            dist.barrier()
            print("ready", flush=True)
            threading.Event().wait()

        fsdp_lab.launch(wait_forever, world_size=2, timeout=600)
    """)
    env = env_with_repo()
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=REPO)
    try:
        assert caller.stdout.readline() == "ready\n"
        pidfds = [os.pidfd_open(pid) for pid in pids(tmp_path)]
        server = int((tmp_path / "parent").read_text())
        assert server != caller.pid  # forked from the fork server, which must end too
        pidfds.append(os.pidfd_open(server))
    finally:
        caller.kill()
        caller.wait(timeout=60)
    assert len(pidfds) == 3
    for fd in pidfds:  # readable once the process has ended
        ended, _, _ = select.select([fd], [], [], 60)
        os.close(fd)
        assert ended == [fd]


def _return_unpicklable():
    return threading.Lock()


def test_unsendable_return_value_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"rank 0 raised TypeError: the return value \(lock\) "
                                          r"could not be sent back"):
        launch(_return_unpicklable, world_size=1, timeout=120)



def _mismatched_collectives():
    t = torch.ones(4)
    collectives.all_reduce(t)
    if dist.get_rank() == 0:
        collectives.all_reduce(t)  # collective #2 on rank 0 ...
    else:
        collectives.all_gather_into_tensor(torch.empty(8), t)  # ... is an all-gather on rank 1


def test_a_deadlock_is_reported_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_mismatched_collectives, world_size=2, timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"the deadlock took {elapsed:.0f} s to report"
    assert info.value.last_collectives == ["all_reduce #2 (16 B float32, group of 2)",
                                           "all_gather #2 (32 B float32, group of 2)"]
    assert "deadlock: the ranks wait in different collectives" in str(info.value)


def _one_rank_late(seconds):
    t = torch.ones(4) * (dist.get_rank() + 1)
    if dist.get_rank() == 0:
        time.sleep(seconds)  # rank 1 waits in all-reduce #1 alone meanwhile: slow, not stuck
    collectives.all_reduce(t)
    handle = collectives.all_gather_into_tensor(torch.empty(8), t, async_op=True)
    if dist.get_rank() == 1:
        time.sleep(seconds)  # rank 0 waits in all-gather #2's wait alone meanwhile
    handle.wait()
    return t.tolist()


def test_a_rank_waiting_for_a_slow_peer_is_not_a_deadlock():
    from fsdp_lab.launch import _DEADLOCK_S
    results = launch(_one_rank_late, 2 * _DEADLOCK_S + 1, world_size=2, timeout=120)
    assert results == [[3.0] * 4, [3.0] * 4]


def _rank_1_returns_early():
    if dist.get_rank() == 1:
        return "done"
    dist.all_reduce(torch.ones(3))  # rank 1 never joins: gloo reports the connection it closed
    return "never"


def test_a_rank_that_returned_while_its_peer_was_in_a_collective_is_named():
    # gloo's words alone ("Connection closed by peer ... a remote worker crashing") blame a crash
    with pytest.raises(LaunchError) as caught:
        launch(_rank_1_returns_early, world_size=2, timeout=60)
    message = str(caught.value)
    assert caught.value.rank == 0
    assert "rank 1 had returned from the function while this rank was still in a collective" in message
