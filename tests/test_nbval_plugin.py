"""fsdp_lab.workshop.nbval_plugin: the labs under nbval from any directory, a lab's kernel that
dies before replying started again, one OpenMP thread for the kernels nbval starts, and the cells
that run torch.compile skipped where no C++ compiler is found.

End to end: a one-cell notebook from inside ``labs/`` with the test command's options; and nbval
on a one-cell notebook whose kernel's first start exits at once (a kernelspec made here), with the
plugin and without it. Without, every cell errors in both, which is what a run from a JupyterLab
terminal, and a kernel that lost its ports at start, did to a whole lab.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib
import types

import nbformat
import pytest

from _launch_helpers import REPO, env_with_repo
from fsdp_lab.workshop import nbval_plugin

pytest.importorskip("nbval")

PLUGIN = nbval_plugin.__name__
ADDOPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]

DIES_ONCE = textwrap.dedent("""
    import pathlib, sys
    marker = pathlib.Path(__file__).with_name("died_once")
    if not marker.exists():  # the first start dies before it replies
        marker.write_text("")
        sys.exit(1)
    from ipykernel.kernelapp import launch_new_instance
    launch_new_instance()
""")


def one_cell_notebook(path: pathlib.Path, source: str, printed: str, *more) -> pathlib.Path:
    """Write at ``path`` a notebook of one code cell, ``source``, saved as having printed ``printed``;
    ``more``: further cells as (source, printed, tags)."""
    notebook = nbformat.v4.new_notebook()
    for count, (text, out, tags) in enumerate([(source, printed, []), *more], start=1):
        cell = nbformat.v4.new_code_cell(text, execution_count=count)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out)]
        if tags:
            cell.metadata["tags"] = tags
        notebook.cells.append(cell)
    nbformat.write(notebook, path)
    return path


@pytest.fixture
def dies_once(tmp_path):
    """A kernelspec "dies-once" under ``tmp_path`` and a notebook to run on it."""
    spec = tmp_path / "kernels" / "dies-once"
    spec.mkdir(parents=True)
    (spec / "start.py").write_text(DIES_ONCE)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(spec / "start.py"), "-f", "{connection_file}"],
        "display_name": "dies once", "language": "python"}))
    path = one_cell_notebook(tmp_path / "one_cell.ipynb", "print(1 + 1)", "2\n")

    def run(*plugin):
        (spec / "died_once").unlink(missing_ok=True)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *plugin,
                   "--nbval", "--nbval-kernel-name=dies-once", str(path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=dict(env_with_repo(), JUPYTER_PATH=str(tmp_path)))

    return run


def test_a_kernel_that_dies_at_start_is_started_again(dies_once):
    without = dies_once()
    assert without.returncode != 0 and nbval_plugin.DIED in without.stdout  # what nbval does alone
    with_plugin = dies_once("-p", PLUGIN)
    assert with_plugin.returncode == 0, with_plugin.stdout[-3000:]
    assert "1 passed" in with_plugin.stdout


def test_a_notebook_runs_under_nbval_from_inside_labs(tmp_path):
    # its output differs in every run until the labs' sanitize file turns it into 0xADDRESS
    one_cell_notebook(tmp_path / "address.ipynb", "print(hex(id(object())))", "0x12345678\n")

    def nbval_in_labs(*options):
        # ``-c`` makes the repository pytest's root, as ``pytest --nbval 00_start_here.ipynb``
        # run in labs/ finds it; the notebook sits outside so that no test writes into labs/
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "../pyproject.toml",
                   *options, "--nbval", str(tmp_path / "address.ipynb")]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO / "labs",
                              env=env_with_repo())

    run = nbval_in_labs()  # pyproject's addopts, as the README's command has them
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]
    without = ADDOPTS.replace(f"-p {PLUGIN}", "").split()
    run = nbval_in_labs("-o", "addopts=", *without)
    assert run.returncode != 0 and "FileNotFoundError" in run.stdout  # what nbval does alone


def test_kernels_under_nbval_get_one_thread_where_nothing_set_it(tmp_path):
    # what torch's and OpenMP's thread count follow when the kernel imports torch
    one_cell_notebook(tmp_path / "threads.ipynb", "import os\nprint(os.environ.get('OMP_NUM_THREADS'))", "1\n")
    env = {k: v for k, v in env_with_repo().items() if k != "OMP_NUM_THREADS"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", PLUGIN,
               "--nbval", "--nbval-current-env", "threads.ipynb"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("nbval, set_before, after", [
    (True, None, "1"),     # notebooks collected, nothing set: one thread
    (True, "3", "3"),      # a value the user set is kept
    (False, None, None),   # no notebooks: the environment is left alone
])
def test_the_thread_count_is_set_only_for_nbval_and_only_where_unset(nbval, set_before, after, monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # recorded, so the value from before comes back
    if set_before is None:
        monkeypatch.delenv("OMP_NUM_THREADS")
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", set_before)
    option = types.SimpleNamespace(nbval=nbval, nbval_lax=False, nbval_sanitize_with=None)
    nbval_plugin.pytest_configure(types.SimpleNamespace(option=option, rootpath=tmp_path))
    assert os.environ.get("OMP_NUM_THREADS") == after


def test_a_relative_path_is_found_from_the_root_only_when_missing_here(tmp_path, monkeypatch):
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / "x.cfg").write_text("")
    monkeypatch.chdir(tmp_path / "labs")
    assert nbval_plugin.from_root("labs/x.cfg", tmp_path) == str(tmp_path / "labs" / "x.cfg")
    assert nbval_plugin.from_root("x.cfg", tmp_path) == "x.cfg"          # there as given
    assert nbval_plugin.from_root("nowhere.cfg", tmp_path) == "nowhere.cfg"  # nbval names it
    assert nbval_plugin.from_root(None, tmp_path) is None


def test_only_deaths_and_silences_at_start_are_retried_and_not_for_ever():
    calls = []

    def start(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError(message)

    message = nbval_plugin.DIED
    with pytest.raises(RuntimeError, match="died"):
        nbval_plugin.retrying(start)(kernel_name="python3")
    assert len(calls) == nbval_plugin.ATTEMPTS and calls[0] == {"kernel_name": "python3"}
    calls.clear()
    message = "Kernel didn't respond in 60 seconds"  # alive but silent (jupyter_client's words)
    with pytest.raises(RuntimeError, match="respond"):
        nbval_plugin.retrying(start)()
    assert len(calls) == nbval_plugin.ATTEMPTS
    calls.clear()
    message = "No such kernel named python9"  # anything else: at once
    with pytest.raises(RuntimeError, match="python9"):
        nbval_plugin.retrying(start)()
    assert len(calls) == 1


def test_a_compiling_cell_is_skipped_without_a_compiler_and_the_rest_runs(tmp_path):
    compiling = ("import torch\nprint(torch.compile(lambda x: x + 1)(torch.ones(1)).item())", "2.0\n",
                 [nbval_plugin.NEEDS_COMPILER])
    one_cell_notebook(tmp_path / "compiles.ipynb", "print(1 + 1)", "2\n", compiling)
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "-p", PLUGIN,
               "--nbval", "--nbval-current-env", "compiles.ipynb"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(env_with_repo(), CXX="no-such-c++"))  # what inductor calls
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, run.stdout[-3000:]
    assert "which on CPU needs a C++ compiler ('no-such-c++' is not on PATH: install g++ or clang" in run.stdout


def test_compiling_cells_are_skipped_only_where_something_is_missing(monkeypatch):
    from fsdp_lab import toolchain

    class Cell:  # what the hook reads of an nbval item, and the marks it adds
        def __init__(self, tags):
            self.cell, self.marks = {"metadata": {"tags": tags}}, []

        def add_marker(self, mark):
            self.marks.append(mark)

    items = [Cell([nbval_plugin.NEEDS_COMPILER, "nbval-ignore-output"]), Cell(["nbval-ignore-output"]), Cell([])]
    monkeypatch.setattr(toolchain, "missing_for_torch_compile", lambda: None)
    nbval_plugin.pytest_collection_modifyitems(None, items)
    assert [len(item.marks) for item in items] == [0, 0, 0]
    monkeypatch.setattr(toolchain, "missing_for_torch_compile", lambda: "Python's C headers (no Python.h)")
    nbval_plugin.pytest_collection_modifyitems(None, items)
    assert [len(item.marks) for item in items] == [1, 0, 0]
    assert items[0].marks[0].name == "skip" and "needs Python's C headers" in items[0].marks[0].kwargs["reason"]


def test_the_test_command_loads_the_plugin():
    assert f"-p {PLUGIN}" in ADDOPTS
