"""fsdp_lab.dist: backend and device rules, torchrun's environment, the simulated world."""

import datetime
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import fsdp_lab
from fsdp_lab import dist as fdist
from fsdp_lab.dist import (choose_backend, comm_needs_host_staging, current_device,
                           device_for_rank, get_rank, get_world_size, init_distributed,
                           is_simulated, loopback_interface, simulated_world)

from _launch_helpers import REPO, env_with_repo, torchrun_env


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has n GPUs (and NCCL) without touching CUDA."""

    def pretend(n, nccl=True):
        monkeypatch.delenv(fdist.DEVICE_ENV, raising=False)  # conftest sets it where GPUs exist
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)

    return pretend


@pytest.mark.parametrize("n_gpus, world_size, backend, expected", [
    (0, 1, "auto", "gloo"),
    (0, 4, "auto", "gloo"),
    (1, 2, "auto", "gloo"),  # ranks share the GPU
    (2, 2, "auto", "nccl"),
    (8, 2, "auto", "nccl"),
    (3, 4, "auto", "gloo"),
    (8, 4, "gloo", "gloo"),
    (4, 4, "nccl", "nccl"),
])
def test_choose_backend(gpus, n_gpus, world_size, backend, expected):
    gpus(n_gpus)
    assert choose_backend(world_size, backend) == expected


def test_auto_without_nccl_build_is_gloo(gpus):
    gpus(4, nccl=False)
    assert choose_backend(2) == "gloo"
    with pytest.raises(ValueError, match="no NCCL"):
        choose_backend(2, "nccl")


@pytest.mark.parametrize("n_gpus, world_size, match", [
    (1, 2, r"world_size=2 but 1 GPU\(s\) are visible.*backend='gloo'"),
    (0, 1, r"needs CUDA GPUs.*Use backend='gloo'"),
])
def test_nccl_without_a_gpu_per_rank_says_what_to_use(gpus, n_gpus, world_size, match):
    gpus(n_gpus)
    with pytest.raises(ValueError, match=match):
        choose_backend(world_size, "nccl")


@pytest.mark.parametrize("world_size, backend, match", [
    (0, "auto", "world_size must be a positive int"),
    (-1, "gloo", "world_size must be a positive int"),
    (True, "gloo", "world_size must be a positive int"),
    (2, "mpi", "unknown backend 'mpi'; use one of auto, gloo, nccl"),
])
def test_choose_backend_rejects_bad_input(world_size, backend, match):
    with pytest.raises(ValueError, match=match):
        choose_backend(world_size, backend)


@pytest.mark.parametrize("n_gpus, rank, backend, expected", [
    (0, 3, "gloo", "cpu"),
    (4, 3, "nccl", "cuda:3"),
    (2, 3, "gloo", "cuda:1"),  # shared GPUs: rank r on cuda:(r % n_gpus)
    (1, 2, "gloo", "cuda:0"),
])
def test_device_for_rank(gpus, n_gpus, rank, backend, expected):
    gpus(n_gpus)
    assert device_for_rank(rank, backend) == torch.device(expected)


def test_cpu_forced_keeps_ranks_on_cpu_beside_gpus(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv(fdist.DEVICE_ENV, "cpu")
    assert choose_backend(2) == "gloo" and choose_backend(4, "gloo") == "gloo"
    assert device_for_rank(1, "gloo") == torch.device("cpu")
    assert current_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="FSDP_LAB_DEVICE=cpu is set.*unset it, or use backend='gloo'"):
        choose_backend(2, "nccl")


def _device_and_backend():
    return str(current_device()), dist.get_backend()


def test_launch_under_cpu_forced_starts_cpu_ranks_where_gpus_are_visible(gpus, monkeypatch):
    """The parent sees (pretended) GPUs; FSDP_LAB_DEVICE=cpu still gives CPU ranks over gloo
    (without it these ranks would be sent to cuda devices this machine may not have)."""
    gpus(2)
    monkeypatch.setenv(fdist.DEVICE_ENV, "cpu")
    assert fsdp_lab.launch(_device_and_backend, world_size=2, timeout=120) == [("cpu", "gloo")] * 2


def test_no_process_group_means_rank_0_of_1():
    assert not dist.is_initialized()
    assert (get_rank(), get_world_size()) == (0, 1)
    assert not is_simulated() and not comm_needs_host_staging()


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_host_staging_is_gloo_with_cuda_tensors(gloo_world_of_one, monkeypatch):
    monkeypatch.delenv(fdist.DEVICE_ENV, raising=False)
    assert comm_needs_host_staging() is torch.cuda.is_available()
    monkeypatch.setenv(fdist.DEVICE_ENV, "cuda:0")  # what launch sets on shared GPUs
    assert current_device() == torch.device("cuda", 0)
    assert comm_needs_host_staging() is True
    monkeypatch.setenv(fdist.DEVICE_ENV, "cpu")
    assert comm_needs_host_staging() is False


def test_backend_for_answers_per_device(monkeypatch):
    assert fdist.nccl_with_gloo_for_cpu("nccl") == "cpu:gloo,cuda:nccl"   # PyTorch's own default pair
    assert fdist.nccl_with_gloo_for_cpu("gloo") == "gloo"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert (fdist.backend_for("cpu"), fdist.backend_for("cuda")) == ("gloo", "nccl")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert (fdist.backend_for("cpu"), fdist.backend_for("cuda")) == ("gloo", "gloo")


def test_collectives_run_on_a_per_device_process_group():
    """A group initialised with a per-device string (what launch makes for NCCL, here its CPU half)
    runs fsdp_lab's collectives on CPU tensors."""
    from fsdp_lab import collectives, process_group
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert str(dist.get_backend()) == "cpu:gloo" and fdist.backend_for("cpu") == "gloo"
        t = torch.arange(4.0)
        collectives.all_reduce(t, op="avg")
        out = torch.empty(4)
        collectives.reduce_scatter_tensor(out, torch.arange(4.0))
        gathered = torch.empty(4)
        collectives.all_gather_into_tensor(gathered, torch.arange(4.0))
        process_group.ensure_reducible(torch.float32)
        assert torch.equal(t, torch.arange(4.0)) and torch.equal(out, t) and torch.equal(gathered, t)
    finally:
        dist.destroy_process_group()


def test_simulated_world_refuses_a_real_process_group(gloo_world_of_one):
    with pytest.raises(RuntimeError, match=r"a real one \(gloo, world size 1\) is initialised"):
        with simulated_world(4):
            pass
    assert dist.get_backend() == "gloo"  # the real group is untouched


def test_simulated_world_is_rank_r_of_n_with_no_communication():
    with simulated_world(8, rank=3) as world:
        assert (world.rank, world.world_size) == (3, 8)
        assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
        assert (get_world_size(), get_rank()) == (8, 3)
        assert is_simulated() and not comm_needs_host_staging()
        assert world.note == ("communication is simulated: collectives return without "
                              "exchanging data; memory is real")
        t = torch.ones(5)
        dist.all_reduce(t)
        assert torch.equal(t, torch.ones(5))  # a real all-reduce over 8 ranks would give 8s
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with simulated_world(2):
                pass
        assert dist.get_world_size() == 8  # the refused inner world changed nothing
    assert not dist.is_initialized() and not is_simulated()


def test_simulated_world_cleans_up_after_an_error(capsys):
    with pytest.raises(KeyError):
        with simulated_world(4, rank=1):
            raise KeyError("inside")
    assert not dist.is_initialized()
    assert capsys.readouterr() == ("", "")  # prints nothing itself


@pytest.mark.parametrize("world_size, rank, match", [
    (0, 0, "world_size must be a positive int"),
    (4, 4, r"rank must be in \[0, 4\)"),
    (4, -1, r"rank must be in \[0, 4\)"),
])
def test_simulated_world_rejects_bad_input(world_size, rank, match):
    with pytest.raises(ValueError, match=match):
        with simulated_world(world_size, rank):
            pass
    assert not dist.is_initialized()


def test_init_distributed_without_torchrun_says_what_to_do(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"run under torchrun .* or use\s+fsdp_lab.launch"):
        init_distributed()


@pytest.mark.parametrize("env,words", [
    (dict(RANK="3", WORLD_SIZE="2"), "RANK='3' is not below WORLD_SIZE=2"),  # waited for rank 3 until the timeout
    (dict(RANK="abc", WORLD_SIZE="2"), "RANK='abc' is not an integer"),
    (dict(RANK="0", WORLD_SIZE="0"), "WORLD_SIZE='0' is below 1"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="x"), "LOCAL_WORLD_SIZE='x' is not an integer"),
    (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2"), "LOCAL_RANK='2' is not below"),
])
def test_init_distributed_names_a_torchrun_variable_out_of_range(monkeypatch, env, words):
    monkeypatch.setattr(os, "environ", dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("initialised"))
    with pytest.raises(RuntimeError, match=re.escape(words)):
        init_distributed(timeout=5)


# ids without "gpu": pytest's keywords include the ids, and the suite skips what says "gpu" without one
@pytest.mark.parametrize("value", ["gpu", "CPU", "cuda:x"], ids=["a-word", "upper-case", "bad-index"])
def test_a_device_override_that_is_no_device_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(fdist.DEVICE_ENV, value)
    with pytest.raises(ValueError, match=f"FSDP_LAB_DEVICE='{value}' is not a device fsdp_lab runs on: set it to cpu"):
        current_device()
    monkeypatch.setenv(fdist.DEVICE_ENV, "cpu")
    assert current_device() == torch.device("cpu") and fdist.cpu_forced()


def test_init_distributed_under_torchrun(tmp_path):
    script = tmp_path / "per_rank.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        import torch.distributed as dist
        from fsdp_lab.dist import current_device, init_distributed

        rank, world_size = init_distributed(timeout=120)
        t = torch.full((2,), float(rank + 1), device=current_device())
        dist.all_reduce(t)
        line = (f"rank {rank} of {world_size}: {dist.get_backend()} {current_device()} {t.tolist()} "
                f"gloo over {os.environ.get('GLOO_SOCKET_IFNAME')}")
        with open(f"rank{rank}.txt", "w") as out:  # a file per rank: stdout lines of two ranks can interleave
            out.write(line)
        dist.barrier()  # see docs/running.md: no rank tears down while a peer still communicates
        dist.destroy_process_group()
    """))
    env = torchrun_env(tmp_path)
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loopback = loopback_interface()  # both ranks are on this machine (see the next test)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [
        f"rank 0 of 2: gloo cpu [3.0, 3.0] gloo over {loopback}",
        f"rank 1 of 2: gloo cpu [3.0, 3.0] gloo over {loopback}",
    ]
    assert list(tmp_path.glob("torchelastic_*"))  # torchrun's log folder is the test's, not the machine's


@pytest.mark.parametrize("local_world_size,bound", [("4", True), ("2", False), (None, False)])
def test_init_distributed_binds_gloo_to_loopback_only_when_every_rank_is_on_this_machine(
        monkeypatch, local_world_size, bound):
    env = dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    if local_world_size is not None:  # torchrun sets it; a hand-made environment may not
        env["LOCAL_WORLD_SIZE"] = local_world_size
    monkeypatch.setattr(os, "environ", env)
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: seen.append(env.get("GLOO_SOCKET_IFNAME")))
    assert init_distributed(backend="gloo") == (0, 4)
    assert seen == [loopback_interface() if bound else None]
    monkeypatch.setattr(fdist.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth7")])
    env.update(GLOO_SOCKET_IFNAME="eth7", LOCAL_WORLD_SIZE="4")  # a value the user set is kept
    init_distributed(backend="gloo")
    assert seen[-1] == "eth7"
    env.update(GLOO_SOCKET_IFNAME="eth9")  # one the machine lacks: named before gloo fails on it
    with pytest.raises(ValueError, match=r"GLOO_SOCKET_IFNAME='eth9' names no network interface of this "
                                         r"machine \(eth9; it has lo, eth7\): unset it"):
        init_distributed(backend="gloo")
    assert len(seen) == 2


def test_package_exports():
    assert fsdp_lab.simulated_world is simulated_world
    assert fsdp_lab.init_distributed is init_distributed


def test_exit_distributed_flushes_runs_atexit_and_exits_with_the_code():
    code = textwrap.dedent("""
        import atexit
        import fsdp_lab
        atexit.register(print, "atexit ran")
        print("unflushed", end="")
        fsdp_lab.exit_distributed(3)
        print("never printed")
    """)
    env = env_with_repo()
    env.pop(fdist.DEVICE_ENV, None)
    env.pop(fdist.IN_LAUNCH_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushedatexit ran\n"


def test_exit_distributed_inside_launch_says_to_return_instead(monkeypatch):
    monkeypatch.setenv(fdist.IN_LAUNCH_ENV, "1")  # what launch sets in each rank
    with pytest.raises(RuntimeError, match="return from fn instead"):
        fdist.exit_distributed()
