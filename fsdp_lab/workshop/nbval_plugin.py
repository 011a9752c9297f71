"""pytest plugin for running the labs under nbval, from anywhere in the repository.

pyproject's ``addopts`` names it (``-p fsdp_lab.workshop.nbval_plugin``), so it is active in
every pytest run under the repository, ``pytest --nbval labs/`` included, and nowhere else.
It does two things nbval does not:

* **The sanitize file is found from any directory.** ``addopts`` names it relative to the
  repository root (``labs/nbval_sanitize.cfg``), and nbval opens it relative to the current
  directory; from ``labs/`` (where a terminal opened in JupyterLab starts) every cell errored
  with FileNotFoundError. A relative path that is not there is looked up from pytest's root.
* **A kernel that dies before it answers is started again.** nbval starts each notebook's
  kernel once (its ``start_new_kernel``); if that kernel exits before it replies, every cell of
  the notebook is reported as an error. One way a kernel dies at start is a port taken under it:
  jupyter_client picks free ports, closes them and hands them to the kernel, and on a machine
  where other processes open connections (the labs' own gloo ranks) one of them can be taken
  before the kernel binds it. JupyterLab survives this: its kernel restarter starts such a kernel
  again on new ports (``KernelRestarter.random_ports_until_alive``). Here: up to ``ATTEMPTS``
  starts, each with new ports, for a kernel that died before replying. A kernel that is alive but
  slow to reply (nbval's startup timeout) is not started again: that is a slow machine, and
  waiting twice would not help.
"""

from __future__ import annotations

import functools
import pathlib

ATTEMPTS = 3
DIED = "Kernel died before replying to kernel_info"  # jupyter_client's message for that case


def retrying(start_new_kernel):
    """``start_new_kernel`` (jupyter_client's signature) that starts a kernel up to ``ATTEMPTS``
    times while it dies before replying; each failed start has been shut down and cleaned up by
    ``start_new_kernel`` itself. Raises the last RuntimeError when every attempt died, and any
    other error at once."""

    @functools.wraps(start_new_kernel)
    def start(*args, **kwargs):
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return start_new_kernel(*args, **kwargs)
            except RuntimeError as error:
                if DIED not in str(error) or attempt == ATTEMPTS:
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
    """Resolve the sanitize file and wrap the ``start_new_kernel`` nbval calls (once per
    process); nothing without nbval."""
    try:
        import nbval.kernel
    except ImportError:
        return
    config.option.nbval_sanitize_with = from_root(config.option.nbval_sanitize_with, config.rootpath)
    if not getattr(nbval.kernel.start_new_kernel, "retries_kernel_deaths", False):
        nbval.kernel.start_new_kernel = retrying(nbval.kernel.start_new_kernel)
