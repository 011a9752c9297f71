"""Helpers shared by the tests that start processes: which rank processes ran, whether they are gone,
and the environment a child Python or torchrun gets."""

import os
from pathlib import Path

import torch.distributed as dist

from fsdp_lab import dist as fdist

REPO = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def record_pid(pid_dir) -> None:
    """Called on a rank: write this process's pid to ``pid_dir/rank<N>.pid``."""
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


def pids(pid_dir) -> list[int]:
    """The pids the ranks recorded in ``pid_dir``, in rank order."""
    return [int(p.read_text()) for p in sorted(Path(pid_dir).glob("rank*.pid"))]


def env_with_repo() -> dict:
    """This process's environment with the repository first on PYTHONPATH, for a child Python."""
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def torchrun_env(tmp_path) -> dict:
    """The environment for torchrun with 2 CPU ranks in a test: the repository on PYTHONPATH, one
    thread a rank, no GPU, no device override, and ``tmp_path`` as the temporary directory
    (torchrun's agent makes a ``torchelastic_*`` log folder there and leaves it)."""
    env = dict(env_with_repo(), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp_path))
    env.pop(fdist.DEVICE_ENV, None)
    return env
