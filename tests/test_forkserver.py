"""fsdp_lab.forkserver: ranks forked from one server that has imported torch behave as fresh
interpreters would. Checked against what a fresh interpreter sees: the caller's environment at
the launch, its own random state, a new server (fresh imports) when the environment read at
import time or fsdp_lab's sources change, and every rank a fresh process that is gone after."""

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from fsdp_lab import forkserver
from fsdp_lab.launch import launch, start_fork_server
from _launch_helpers import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")


def _who(variable=None):
    import torch.distributed as dist
    return {"rank": dist.get_rank(), "pid": os.getpid(), "parent": os.getppid(),
            "value": os.environ.get(variable) if variable else None, "random": random.random(),
            "torch_random": torch.rand(1).item(),
            "parent_cmdline": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()}


def test_ranks_fork_from_one_server_with_the_environment_of_each_launch(monkeypatch):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    first = launch(_who, world_size=2)
    monkeypatch.setenv("LAB_SETTING_SET_AFTER_THE_FIRST_LAUNCH", "42")  # read at run time only
    second = launch(_who, "LAB_SETTING_SET_AFTER_THE_FIRST_LAUNCH", world_size=2)
    servers = {r["parent"] for r in first + second}
    assert len(servers) == 1 and os.getpid() not in servers
    assert forkserver.SERVER_MODULE in first[0]["parent_cmdline"]
    assert [r["value"] for r in second] == ["42", "42"]
    pids = [r["pid"] for r in first + second]
    assert len(set(pids)) == 4 and not any(alive(pid) for pid in pids)
    # a fresh interpreter seeds Python's and torch's random numbers from the OS: no two ranks
    # share a stream (unseeded data or dropout masks would otherwise repeat on every rank)
    assert len({r["random"] for r in first + second}) == 4
    assert len({r["torch_random"] for r in first + second}) == 4


def test_a_variable_read_at_import_time_starts_a_new_server(monkeypatch):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    (before,) = launch(_who, world_size=1)
    monkeypatch.setenv("FSDP_LAB_IMPORT_TIME_PROBE", "1")
    (after,) = launch(_who, "FSDP_LAB_IMPORT_TIME_PROBE", world_size=1)
    assert after["parent"] != before["parent"] and after["value"] == "1"
    assert not alive(before["parent"])  # the replaced server has left


def test_changed_sources_change_the_server_key(tmp_path, monkeypatch):
    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    monkeypatch.setattr(forkserver, "_PACKAGE", tmp_path)
    key = forkserver._state_key({"PATH": "/bin"})
    assert forkserver._state_key({"PATH": "/usr/bin"}) == key  # read after import: sent per rank
    assert forkserver._state_key({"PATH": "/bin", "OMP_NUM_THREADS": "3"}) != key
    os.utime(module, ns=(0, module.stat().st_mtime_ns + 10**9))
    assert forkserver._state_key({"PATH": "/bin"}) != key


def test_a_server_started_early_forks_the_next_launch(monkeypatch):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    monkeypatch.setenv("FSDP_LAB_EARLY_SERVER_PROBE", "1")  # read at import: no earlier server fits
    assert start_fork_server() is True
    early = forkserver._SERVER
    assert start_fork_server() is True and forkserver._SERVER is early  # a running one is kept
    ranks = launch(_who, world_size=2)
    assert {r["parent"] for r in ranks} == {early.process.pid}


def test_an_early_server_replaced_while_loading_is_stopped_quietly(monkeypatch, capfd):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    monkeypatch.setenv("FSDP_LAB_EARLY_SERVER_PROBE", "2")
    start_fork_server()
    loading = forkserver._SERVER
    monkeypatch.setenv("FSDP_LAB_EARLY_SERVER_PROBE", "3")
    (rank,) = launch(_who, world_size=1)
    assert rank["parent"] != loading.process.pid and not alive(loading.process.pid)
    assert "Traceback" not in capfd.readouterr().err


def _imported(module):
    import sys
    return module in sys.modules


def test_preloaded_modules_are_imported_before_a_rank_starts(monkeypatch):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    monkeypatch.setenv("FSDP_LAB_EARLY_SERVER_PROBE", "4")
    probe = "xml.dom.minidom"  # nothing a rank imports by itself
    assert launch(_imported, probe, world_size=1) == [False]
    plain = forkserver._SERVER
    assert start_fork_server(preload=[probe]) is True
    assert forkserver._SERVER is not plain and not alive(plain.process.pid)  # replaced: it lacked it
    assert launch(_imported, probe, world_size=2) == [True, True]
    start_fork_server(preload=["xml.sax"])  # more modules: the new server keeps the earlier ones
    assert forkserver._SERVER.preload == (probe, "xml.sax")
    assert launch(_imported, probe, world_size=1) == [True]


def test_a_preload_that_cannot_be_imported_fails_the_next_launch(monkeypatch, capfd):
    monkeypatch.delenv(forkserver.START_ENV, raising=False)
    monkeypatch.setenv("FSDP_LAB_EARLY_SERVER_PROBE", "5")
    start_fork_server(preload=["no_module_named_like_this"])
    with pytest.raises(RuntimeError, match="fork server did not start"):
        launch(_who, world_size=1)
    assert "No module named 'no_module_named_like_this'" in capfd.readouterr().err
    (rank,) = launch(_who, world_size=1)  # the next launch starts a server without it
    assert rank["rank"] == 0


@pytest.mark.parametrize("preload", [[""], [3], None])
def test_preload_must_be_module_names(preload):
    with pytest.raises(TypeError, match="preload must be module names"):
        start_fork_server(preload=preload)


def test_no_early_server_where_ranks_are_not_forked(monkeypatch):
    monkeypatch.setenv(forkserver.START_ENV, "spawn")
    before = forkserver._SERVER
    assert start_fork_server() is False and forkserver._SERVER is before


def test_importing_dynamo_after_the_server_started_keeps_it(monkeypatch):
    import torch._dynamo  # noqa: F401  (it writes the inductor cache directory into os.environ)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = {"PATH": "/bin"}
    at_default = dict(env, TORCHINDUCTOR_CACHE_DIR=os.path.abspath(default_cache_dir()))
    assert forkserver._state_key(at_default) == forkserver._state_key(env)
    elsewhere = dict(env, TORCHINDUCTOR_CACHE_DIR="/somewhere/else")  # the user's own choice
    assert forkserver._state_key(elsewhere) != forkserver._state_key(env)


def test_spawn_setting_starts_each_rank_as_a_child_of_the_caller(monkeypatch):
    monkeypatch.setenv(forkserver.START_ENV, "spawn")
    ranks = launch(_who, world_size=2)
    assert {r["parent"] for r in ranks} == {os.getpid()}


def test_unknown_start_setting_is_refused(monkeypatch):
    monkeypatch.setenv(forkserver.START_ENV, "forkserver")
    with pytest.raises(ValueError, match="FSDP_LAB_LAUNCH_START must be 'fork' or 'spawn'"):
        launch(_who, world_size=1)


def test_a_caller_started_without_stdout_and_stderr_launches(tmp_path):
    # A daemon's fds 1 and 2 are closed: the fork server it starts inherits them closed, and the
    # descriptors sent with a fork request must not take those numbers, or a rank's dup2 onto
    # its stdout would overwrite its message pipe.
    import subprocess
    import textwrap

    from _launch_helpers import REPO, env_with_repo

    out = tmp_path / "result.txt"
    code = textwrap.dedent(f"""
        import fsdp_lab
        def rank():
            import torch.distributed as dist
            print("printed with no stdout to print to")
            return dist.get_rank()
        open({str(out)!r}, "w").write(repr(fsdp_lab.launch(rank, world_size=2, timeout=120)))
    """)
    done = subprocess.run([sys.executable, "-c", code], env=env_with_repo(), cwd=REPO, timeout=300,
                          preexec_fn=lambda: (os.close(1), os.close(2)))
    assert done.returncode == 0 and out.read_text() == "[0, 1]"
