"""Helpers shared by the launch tests: which rank processes ran, and whether they are gone."""

import os
from pathlib import Path

import torch.distributed as dist

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
