"""pytest plugin for running the labs under nbval, from anywhere in the repository.

pyproject's ``addopts`` names it (``-p fsdp_lab.workshop.nbval_plugin``), so it is active in
every pytest run under the repository, ``pytest --nbval labs/`` included, and nowhere else.
It does four things nbval does not:

* **The sanitize file is found from any directory.** ``addopts`` names it relative to the
  repository root (``labs/nbval_sanitize.cfg``), and nbval opens it relative to the current
  directory; from ``labs/`` (where a terminal opened in JupyterLab starts) every cell errored
  with FileNotFoundError. A relative path that is not there is looked up from pytest's root.
* **A kernel that dies or stays silent before it answers is started again.** nbval starts each
  notebook's kernel once (its ``start_new_kernel``); if that kernel exits before it replies, or
  does not reply within nbval's startup timeout (60 s), every cell of the notebook is reported
  as an error. One way a kernel dies at start is a port taken under it:
  jupyter_client picks free ports, closes them and hands them to the kernel, and on a machine
  where other processes open connections (the labs' own gloo ranks) one of them can be taken
  before the kernel binds it. JupyterLab survives this: its kernel restarter starts such a kernel
  again on new ports (``KernelRestarter.random_ports_until_alive``). Here: up to ``ATTEMPTS``
  starts, each with new ports, for a kernel that died or stayed silent before replying. Silence
  was once taken for a slow machine and not retried, until a kernel alive but silent for the
  whole 60 s (where one starts in about 3 s) errored every cell of lab 00 in a run of the test
  command; nbval's shutdown of it, then new ports, is what a user's restart would do.
* **Lab kernels run one CPU thread** (``OMP_NUM_THREADS=1`` unless the environment sets it;
  their ranks then take one each too, see ``fsdp_lab.launch_rank.rank_threads``). Under nbval
  the labs share the machine with other notebooks, their ranks and pytest's workers; there a
  second OpenMP thread makes the small operations of the labs' models wait at every parallel
  region for a thread that is not running (one lab cell took 131 s instead of 10 s with two
  workers on 2 cores); on idle cores it did not make a training step of the "cpu" Llama faster.
* **A cell tagged ``needs-cpp-compiler`` is skipped where C++ cannot be built.** Such a cell
  runs ``torch.compile``, whose CPU backend (inductor) writes C++ and builds it with the
  compiler ``torch._inductor.config.cpp.cxx`` names (``$CXX``, else ``g++``; ``clang++`` on
  macOS) against Python's headers. Without them the cell cannot run on that machine whatever
  the lab does, so it is reported as skipped, with what is missing and the fix, instead of
  failing (``fsdp_lab.toolchain``).
"""

from __future__ import annotations

import functools
import os
import pathlib

import pytest

ATTEMPTS = 3
DIED = "Kernel died before replying to kernel_info"  # jupyter_client's messages for the two cases
SILENT = "Kernel didn't respond in"
NEEDS_COMPILER = "needs-cpp-compiler"  # the tag of a lab cell that runs torch.compile


def retrying(start_new_kernel):
    """``start_new_kernel`` (jupyter_client's signature) that starts a kernel up to ``ATTEMPTS``
    times while it dies or stays silent before replying; each failed start has been shut down and
    cleaned up by ``start_new_kernel`` itself. Raises the last RuntimeError when every attempt
    failed so, and any other error at once."""

    @functools.wraps(start_new_kernel)
    def start(*args, **kwargs):
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return start_new_kernel(*args, **kwargs)
            except RuntimeError as error:
                if not (DIED in str(error) or SILENT in str(error)) or attempt == ATTEMPTS:
                    raise
    start.retries_kernel_deaths = True
    return start


def from_root(path: str | None, root: pathlib.Path) -> str | None:
    """``path`` as given when it exists (or is None or absolute), else ``root / path`` where that
    exists; unchanged otherwise, so nbval names the missing file itself."""
    if path is None or pathlib.Path(path).is_absolute() or pathlib.Path(path).exists():
        return path
    rooted = root / path
    return str(rooted) if rooted.exists() else path


def pytest_configure(config) -> None:
    """Resolve the sanitize file, wrap the ``start_new_kernel`` nbval calls (once per
    process) and, when notebooks are collected (``--nbval``/``--nbval-lax``), give the kernels
    one thread; nothing without nbval."""
    try:
        import nbval.kernel
    except ImportError:
        return
    if config.option.nbval or config.option.nbval_lax:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every kernel nbval starts
    config.option.nbval_sanitize_with = from_root(config.option.nbval_sanitize_with, config.rootpath)
    if not getattr(nbval.kernel.start_new_kernel, "retries_kernel_deaths", False):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)


def cell_tags(item) -> list[str]:
    """The metadata tags of the notebook cell behind a collected nbval item ([] for other items)."""
    cell = getattr(item, "cell", None)
    return list(cell.get("metadata", {}).get("tags", [])) if isinstance(cell, dict) else []


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the cells tagged ``NEEDS_COMPILER`` skipped when ``torch.compile`` cannot build C++
    here (``fsdp_lab.toolchain.missing_for_torch_compile``), with what is missing as the reason;
    the machine is looked at only when such a cell was collected."""
    tagged = [item for item in items if NEEDS_COMPILER in cell_tags(item)]
    if not tagged:
        return
    from fsdp_lab.toolchain import missing_for_torch_compile
    missing = missing_for_torch_compile()
    if missing is None:
        return
    for item in tagged:
        item.add_marker(pytest.mark.skip(reason=f"this cell runs torch.compile, which on CPU needs {missing}"))
