"""fsdp_lab.launch when it works: results, prints, any caller and any function, bad arguments.

Every launch costs a few seconds of torch imports on 2 cores, so the passing runs are shared
by a module-scoped fixture. Failures (raises, hangs, deadlocks, interrupts) are in
tests/test_launch_failures.py.
"""

import atexit
import contextlib
import io
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import collectives
from fsdp_lab.dist import (comm_needs_host_staging, current_device, init_distributed, is_simulated,
                           loopback_interface)
from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from _launch_helpers import REPO, alive, env_with_repo

N_LINES = 25


# ------------------------------------------------------------------ passing runs (shared)


GLOO_CONNECTED = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : 1"


def _report(tag):
    rank = dist.get_rank()
    # Below Python, as C++ libraries and programs a rank starts write: before the prints, and
    # as the last thing the rank does (an exit handler, after its result is sent)
    os.write(1, f"{tag} native line from rank {rank}\n".encode())
    os.write(2, f"{tag} native warning from rank {rank}\n".encode())
    subprocess.run(["echo", f"{tag} child process of rank {rank}"], check=True)
    os.write(1, f"{GLOO_CONNECTED.format(rank, 1)}\n{GLOO_CONNECTED.format(rank, 0)}\n".encode())
    if tag == "all":
        atexit.register(os.write, 1, f"{tag} exit handler of rank {rank}\n".encode())
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # torch's own collective: checks the group, not our wrappers
    for i in range(N_LINES):
        print(f"{tag} line {i} from rank {rank}")
    print(f"{tag} warning from rank {rank}", file=sys.stderr)
    print(f"{tag} unterminated from rank {rank}", end="")
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "init_distributed": init_distributed(),  # keeps the existing group
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "argv": sys.argv,
        "sum": t,
        "nested": [(t * 2, {"deep": t + 1})],
        "backend": dist.get_backend(),
        "device": str(current_device()),
        "staging": comm_needs_host_staging(),
        "simulated": is_simulated(),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


@pytest.fixture(scope="module")
def runs():
    """Three launches back to back: 2 ranks printing from rank 0, 2 ranks all printing, 1 rank."""
    out = {}
    for name, kwargs in (("single", dict(world_size=2)),
                         ("all", dict(world_size=2, print_ranks="all")),
                         ("one", dict(world_size=1))):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            results = launch(_report, name, timeout=120, **kwargs)
        out[name] = (results, stdout.getvalue(), stderr.getvalue())
    return out


def test_results_are_indexed_by_rank(runs):
    results = runs["single"][0]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert [r["init_distributed"] for r in results] == [(0, 2), (1, 2)]
    assert all(r["argv"] == sys.argv for r in results)  # the caller's, as under spawn
    assert [r["env"] for r in results] == [
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
    ]


def test_process_group_really_communicates(runs):
    for r in runs["single"][0]:
        assert torch.equal(r["sum"], torch.full((3,), 3.0))  # 1 + 2 on every rank
    (one,) = runs["one"][0]
    assert torch.equal(one["sum"], torch.ones(3))


def test_tensors_come_back_on_cpu_through_containers(runs):
    r = runs["single"][0][1]
    doubled, inner = r["nested"][0]
    assert isinstance(r["nested"], list) and isinstance(r["nested"][0], tuple)
    assert doubled.device.type == "cpu" and torch.equal(doubled, torch.full((3,), 6.0))
    assert torch.equal(inner["deep"], torch.full((3,), 4.0))


def test_cpu_ranks_get_gloo_and_a_share_of_the_cores(runs):
    for r in runs["single"][0]:
        assert (r["backend"], r["device"]) == ("gloo", "cpu")
        assert not r["staging"] and not r["simulated"]
        assert r["threads"] == max(1, os.cpu_count() // 2)


def test_gloo_binds_to_loopback_whatever_the_host_name_resolves_to(runs):
    # where the host name does not resolve, gloo otherwise prints a warning at every launch
    names = [name for _, name in socket.if_nameindex()]
    want = "lo" if "lo" in names else "lo0"
    assert want in names and loopback_interface() == want
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        assert {r["gloo_interface"] for r in runs["single"][0]} == {want}


def test_a_gloo_interface_the_caller_set_is_kept(monkeypatch):
    import fsdp_lab.dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface")  # gloo must use it, and fails
    monkeypatch.setattr(fsdp_lab.dist, "check_gloo_interface", lambda: None)  # past launch's own check
    with pytest.raises(LaunchError, match="Unable to find address for: no-such-interface"):
        launch(os.getpid, world_size=1, timeout=120)


def test_a_gloo_interface_the_machine_lacks_is_named_before_any_rank_starts(monkeypatch):
    names = [name for _, name in socket.if_nameindex()]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", f"{names[0]},no-such-interface")
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME=.*no-such-interface; it has .*: unset it"):
        launch(os.getpid, world_size=1, timeout=120)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback_interface())  # a real one: accepted
    assert len(launch(os.getpid, world_size=1, timeout=120)) == 1


def test_a_set_omp_num_threads_caps_a_rank_s_threads(runs):
    assert os.environ["OMP_NUM_THREADS"] == "1"  # tests/conftest.py sets it for the whole run
    (one,) = runs["one"][0]
    assert one["threads"] == 1  # one rank alone would otherwise take every core


def test_rank_threads_share_the_cores_and_keep_under_omp_num_threads(monkeypatch):
    from fsdp_lab.launch_rank import rank_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [rank_threads(w, {}) for w in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert rank_threads(2, {"OMP_NUM_THREADS": "2"}) == 2
    assert rank_threads(2, {"OMP_NUM_THREADS": "16"}) == 4   # a cap, never more than the share
    assert rank_threads(1, {"OMP_NUM_THREADS": "1"}) == 1
    for ignored in ("0", "", "two", "4,2"):                    # not a positive integer: no cap
        assert rank_threads(2, {"OMP_NUM_THREADS": ignored}) == 4, ignored


def _native_lines(tag, rank):
    """What ``_report`` writes below Python to stdout, less gloo's usual connection line."""
    return [f"{tag} native line from rank {rank}", f"{tag} child process of rank {rank}",
            GLOO_CONNECTED.format(rank, 0)]


def test_only_rank_0_prints_by_default_without_prefix(runs):
    _, stdout, stderr = runs["single"]
    expected = [f"single line {i} from rank 0" for i in range(N_LINES)]
    assert stdout.splitlines() == (_native_lines("single", 0) + expected
                                   + ["single unterminated from rank 0"])
    assert stderr == "single native warning from rank 0\nsingle warning from rank 0\n"


def test_several_printing_ranks_get_prefixes_and_keep_their_order(runs):
    _, stdout, stderr = runs["all"]
    lines = stdout.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] {line}" for line in (
            _native_lines("all", rank) + [f"all line {i} from rank {rank}" for i in range(N_LINES)]
            + [f"all unterminated from rank {rank}", f"all exit handler of rank {rank}"])]
    assert len(lines) == 2 * (N_LINES + 5)
    for rank in (0, 1):
        mine = [line for line in stderr.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] all native warning from rank {rank}",
                        f"[rank {rank}] all warning from rank {rank}"]
    assert len(stderr.splitlines()) == 4


def test_back_to_back_launches_use_new_processes_and_leave_none(runs):
    rank_pids = [r["pid"] for name in ("single", "all", "one") for r in runs[name][0]]
    assert len(set(rank_pids)) == 5 and os.getpid() not in rank_pids
    assert not any(alive(pid) for pid in rank_pids)


def test_function_defined_in_main_is_sent_by_value():
    # `python -c`: the children cannot import __main__, as in a notebook kernel.
    code = textwrap.dedent("""
        import dataclasses
        import torch
        import torch.distributed as dist
        import fsdp_lab

        @dataclasses.dataclass
        class Point:
            rank: int
            value: torch.Tensor

        offset = 10.0

        def where_am_i(scale):
            return Point(dist.get_rank(), torch.ones(2) * scale + offset)

        for attempt in range(2):  # re-running the same "cell"
            points = fsdp_lab.launch(where_am_i, 3.0, world_size=2, timeout=120)
            assert all(type(p) is Point for p in points), [type(p) for p in points]
            print(attempt, [(p.rank, p.value.tolist()) for p in points])
    """)
    env = env_with_repo()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "0 [(0, [13.0, 13.0]), (1, [13.0, 13.0])]",
        "1 [(0, [13.0, 13.0]), (1, [13.0, 13.0])]",
    ]


# ------------------------------------------------------------------ any caller, any function
# A notebook cell's functions live in a __main__ that no other process can import, so they
# travel by value; exec'ing a cell's code in a namespace named "__main__" reproduces that.

NOTEBOOK_CELL = """
import threading
import time
import types
import torch

offset = 10.0                            # notebook globals the function closes over
triple = lambda x: x * 3.0
settings = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=32))

def closure_over_notebook_globals():
    return triple(torch.ones(2) * (torch.distributed.get_rank() + 1)) + offset

def reads_a_config_attribute():
    # `torch` + `.distributed` + `.config` spells torch.distributed.config, a torch config
    # module (ConfigModuleInstance) that cloudpickle then tries to send by value.
    return settings.config.hidden_size * torch.distributed.get_world_size()

def both():
    return closure_over_notebook_globals(), reads_a_config_attribute()

lock = threading.Lock()

def uses_a_lock():
    with lock:
        return torch.distributed.get_rank()

def calls_a_helper_using_a_lock():
    return uses_a_lock()
"""


def _notebook_cell(code: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(code, "<notebook cell>", "exec"), namespace)
    return namespace


def test_torch_config_modules_break_plain_cloudpickle():
    # The mechanism the next test depends on: fails with cloudpickle alone, whatever is installed.
    import cloudpickle

    cell = _notebook_cell(NOTEBOOK_CELL)
    if "torch.distributed.config" not in sys.modules:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.config: the cell reads a plain attribute")
    assert type(sys.modules["torch.distributed.config"]).__name__ == "ConfigModuleInstance"
    with pytest.raises(TypeError, match="cannot pickle 'ConfigModuleInstance' object"):
        cloudpickle.dumps(cell["reads_a_config_attribute"])


def test_notebook_function_reading_a_config_and_closing_over_globals_runs():
    cell = _notebook_cell(NOTEBOOK_CELL)
    results = launch(cell["both"], world_size=2, timeout=120)
    for rank, (closed, config) in enumerate(results):
        assert torch.equal(closed, torch.full((2,), 3.0 * (rank + 1) + 10.0))
        assert config == 32 * 2


HF_CELL = """
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

def hf_loss():
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.arange(16).view(2, 8) % model.config.vocab_size
    loss = model(ids, labels=ids).loss.detach()
    if dist.is_initialized():                    # the same cell runs in one process too
        dist.all_reduce(loss)
        loss /= torch.distributed.get_world_size()
    return loss, model.config.hidden_size
"""


def test_hugging_face_model_built_from_a_notebook_config_runs():
    pytest.importorskip("transformers")
    cell = _notebook_cell(HF_CELL)
    reference_loss, hidden = cell["hf_loss"]()  # the same cell, one process
    results = launch(cell["hf_loss"], world_size=2, timeout=240)
    for loss, size in results:
        assert size == hidden == 32
        assert torch.allclose(loss, reference_loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn, args, expected", [
    ("uses_a_lock", (), "global 'lock' used by uses_a_lock() (a _thread.lock)"),
    ("calls_a_helper_using_a_lock", (), "global 'lock' used by uses_a_lock() (a _thread.lock)"),
    ("closure_over_notebook_globals", ("LOCK",), "argument 0 (a _thread.lock)"),
])
def test_unpicklable_call_names_the_culprit_and_the_fix(fn, args, expected):
    import multiprocessing

    cell = _notebook_cell(NOTEBOOK_CELL)
    args = tuple(cell["lock"] if a == "LOCK" else a for a in args)
    before = multiprocessing.active_children()
    with pytest.raises(TypeError) as info:
        launch(cell[fn], *args, world_size=2, timeout=60)
    message = str(info.value)
    assert expected in message, message
    assert "cannot pickle '_thread.lock' object" in message
    assert "Create it inside fn" in message and "importable module" in message
    assert multiprocessing.active_children() == before


def _sum_and_rank(t):
    return float(t.sum()), dist.get_rank()


def test_arguments_bigger_than_a_store_value_travel():
    big = torch.ones(3 * 2**20)  # 12 MiB: more than a TCPStore value may hold (8 MiB)
    assert launch(_sum_and_rank, big, world_size=1, timeout=120) == [(3.0 * 2**20, 0)]


UNGUARDED_SCRIPT = """
import torch.distributed as dist
import fsdp_lab

print("script body ran")

def where():
    return dist.get_rank() * 10

print("results", fsdp_lab.launch(where, world_size=2, timeout=120))
"""


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_unguarded_script_and_stdin_callers_run_their_body_once(tmp_path, how):
    # Ranks never import the caller's __main__: no `if __name__ == "__main__":` needed.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = env_with_repo()
    command = [sys.executable, str(script)] if how == "script" else [sys.executable, "-"]
    proc = subprocess.run(command, input=None if how == "script" else UNGUARDED_SCRIPT,
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["script body ran", "results [0, 10]"]


# ------------------------------------------------------------------ bad arguments: nothing starts


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size must be a positive int"),
    (dict(world_size=2.0), "world_size must be a positive int"),
    (dict(backend="mpi"), "unknown backend 'mpi'"),
    (dict(backend="nccl", world_size=torch.cuda.device_count() + 1), "backend='gloo'"),
    (dict(timeout=0), "timeout must be a positive number"),
    (dict(timeout=float("inf")), "timeout must be a positive number"),
    (dict(print_ranks=(0, 2)), r"print_ranks must be ranks in \[0, 2\)"),
])
def test_bad_arguments_raise_before_any_process_starts(kwargs, match):
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=match):
        launch(print, **kwargs)
    assert multiprocessing.active_children() == before


def test_windows_is_refused_before_any_process_starts_and_names_wsl(monkeypatch):
    import multiprocessing
    import sys

    before = multiprocessing.active_children()
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(OSError, match=r"needs Linux or macOS.*'win32'.*inside WSL2"):
        launch(print, world_size=2)
    monkeypatch.undo()
    assert multiprocessing.active_children() == before


def test_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="needs a function"):
        launch("not a function")


def test_package_exports_the_function_even_after_its_module_is_imported():
    import fsdp_lab.launch  # noqa: F401 - as every rank and bandwidth.benchmark do

    assert fsdp_lab.launch is launch and fsdp_lab.LaunchError is LaunchError
    assert issubclass(LaunchTimeout, LaunchError)


# ------------------------------------------------------------------ GPU


def _cuda_report():
    device = current_device()
    t = torch.full((2,), float(dist.get_rank() + 1), device=device)
    collectives.all_reduce(t)
    cpu_sum = torch.full((1,), float(dist.get_rank() + 1))   # a CPU tensor: gloo beside NCCL
    collectives.all_reduce(cpu_sum)
    return {"device": str(device), "backend": str(dist.get_backend()), "t": t, "cpu_sum": cpu_sum,
            "staging": comm_needs_host_staging()}


@pytest.mark.gpu
def test_gpu_ranks_return_cpu_tensors():
    n_gpus = torch.cuda.device_count()
    results = launch(_cuda_report, world_size=2, timeout=300)
    for rank, r in enumerate(results):
        assert r["t"].device.type == "cpu" and torch.equal(r["t"], torch.full((2,), 3.0))
        assert torch.equal(r["cpu_sum"], torch.full((1,), 3.0))
        if n_gpus >= 2:
            assert (r["backend"], r["device"], r["staging"]) == ("cpu:gloo,cuda:nccl", f"cuda:{rank}", False)
        else:
            assert (r["backend"], r["device"], r["staging"]) == ("gloo", "cuda:0", True)
