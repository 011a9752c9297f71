"""Build a lab notebook from a plain Python description and execute it so outputs are committed.

Each lab has a source file ``labs/src/NN_name.py`` that defines ``CELLS`` (a list of
``md("...")`` / ``code("...", tags=[...])`` / ``exercise("...")``) and calls
``build(__file__, CELLS)``. Running it writes ``labs/NN_name.ipynb`` with fresh outputs:

    python labs/src/01_collectives.py          # rebuild and execute one lab
    python labs/src/01_collectives.py --only solution --no-execute

Tags understood by nbval: ``nbval-ignore-output`` (timings, device names), ``nbval-skip``.

Exercises: two notebooks from one source
----------------------------------------
A lab with ``exercise(...)`` cells is built twice: ``labs/NN_name.ipynb``, what a learner
opens, holds each exercise as a stub; ``labs/solutions/NN_name.ipynb`` holds it solved. Both
are executed (the solution with its kernel in ``labs/solutions/``) and checked by nbval.
Markers inside an exercise's text say which lines belong to which copy:

    exercise('''
    def count_ranks():
        ### BEGIN SOLUTION
        t = torch.ones(1)
        collectives.all_reduce(t)
        return int(t.item())
        ### END SOLUTION
        ### STUB raise NotImplementedError("all-reduce a tensor holding 1; return its value")
    ''')

* lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` appear in the solution only;
* a ``### STUB <code>`` line appears, as ``<code>`` at the marker's indentation, in the
  learner's copy only (a ``raise NotImplementedError("...what to write...")`` or a line with a
  ``...`` placeholder); several STUB lines in a row make a multi-line stub;
* every other line appears in both.

``exercise_from(obj)`` takes the text from the source of a function or class of the package
(e.g. ``fsdp_lab.workshop.zero.ZeRO1``), so the package's tested reference and the lab's
exercise are one text. The learner's checking cell after each exercise calls a checker from
``fsdp_lab.workshop.labNN`` (see ``fsdp_lab/workshop/__init__.py``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import os
import pathlib
import sys
import textwrap
import time
from queue import Empty

import nbformat
from nbclient import NotebookClient

LABS = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = LABS / "solutions"
VERSIONS = ("student", "solution")

# Longest single wait on the kernel's shell channel (seconds); see ``LabClient``.
SHELL_WAIT_SLICE_S = 1.0

BEGIN, END, STUB = "### BEGIN SOLUTION", "### END SOLUTION", "### STUB"


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(text).strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


class Exercise:
    """A code cell written twice: ``student`` (the stub) and ``solution``, from one marked text.

    Raises ValueError when the markers are unbalanced or nested, when the text has no
    solution block, or when either version is not valid Python.
    """

    def __init__(self, text: str, tags: list[str] | None = None):
        self.text = textwrap.dedent(text).strip("\n")
        self.tags = ["exercise"] + list(tags or [])
        self.student, self.solution = split_markers(self.text)

    def cell(self, version: str) -> nbformat.NotebookNode:
        """The notebook cell of ``version`` ("student" or "solution")."""
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
        source = self.student if version == "student" else self.solution
        return code(source, tags=self.tags)

    def __repr__(self) -> str:
        first = self.solution.splitlines()[0] if self.solution else ""
        return f"Exercise({first!r})"


def exercise(text: str, tags: list[str] | None = None) -> Exercise:
    """An exercise cell from marked text (see the module docstring)."""
    return Exercise(text, tags)


def exercise_from(obj, *, before: str = "", after: str = "", tags: list[str] | None = None) -> Exercise:
    """An exercise cell whose text is the source of ``obj`` (a function or class), with
    ``before`` and ``after`` added around it (e.g. an import, or a line using it)."""
    parts = [textwrap.dedent(before).strip("\n"), inspect.getsource(obj).strip("\n"),
             textwrap.dedent(after).strip("\n")]
    return Exercise("\n\n".join(p for p in parts if p), tags)


def split_markers(text: str) -> tuple[str, str]:
    """(student, solution) versions of a marked exercise text. Raises ValueError naming the
    line of a marker problem, or the version that is not valid Python."""
    student, solution, inside, blocks = [], [], False, 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        indent = line[:len(line) - len(line.lstrip())]
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"line {number}: {BEGIN} inside another solution block")
            inside, blocks = True, blocks + 1
        elif stripped == END:
            if not inside:
                raise ValueError(f"line {number}: {END} without {BEGIN}")
            inside = False
        elif stripped.startswith(STUB):
            if inside:
                raise ValueError(f"line {number}: {STUB} inside a solution block; put it after {END}")
            rest = stripped[len(STUB):]
            student.append(indent + rest[1:] if rest.startswith(" ") else indent + rest)
        elif inside:
            solution.append(line)
        else:
            student.append(line)
            solution.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    if not blocks:
        raise ValueError(f"an exercise needs at least one {BEGIN} ... {END} block")
    versions = "\n".join(student).strip("\n"), "\n".join(solution).strip("\n")
    for name, source in zip(VERSIONS, versions):
        try:
            ast.parse(source)
        except SyntaxError as error:
            raise ValueError(f"the {name} version is not valid Python (line {error.lineno}: "
                             f"{error.msg}):\n{source}") from error
    return versions


def notebook(cells: list, version: str = "student") -> nbformat.NotebookNode:
    """The unexecuted notebook of ``version``: exercises as stubs or solved; stable cell ids
    are set by :func:`write`."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [c.cell(version) if isinstance(c, Exercise) else nbformat.from_dict(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def has_exercises(cells: list) -> bool:
    return any(isinstance(c, Exercise) for c in cells)


class LabClient(NotebookClient):
    """nbclient's NotebookClient whose waits for a cell's reply are cut into slices of
    ``SHELL_WAIT_SLICE_S`` seconds, the cell's own timeout unchanged.

    Measured here (nbclient 0.11, jupyter_client 8.10, pyzmq 27.3, ipykernel 7.4): about one run
    in five of lab 00 beside two busy loops, the reply to the cell after the first widget reached
    the client but the wait for it was not woken; it was read only when that wait timed out, the
    cell's full 600 s later, and the run went on as if nothing had happened. A wait that ends
    every second looks at the channel again, so such a reply costs at most a second."""

    async def async_start_new_kernel_client(self):
        client = await super().async_start_new_kernel_client()
        client.shell_channel.get_msg = _sliced(client.shell_channel.get_msg)
        return client


def _sliced(get_msg):
    """``get_msg(timeout)`` (jupyter_client's async channel method) as waits of at most
    ``SHELL_WAIT_SLICE_S``; raises queue.Empty only when ``timeout`` (seconds; None: none) has
    passed without a message."""

    async def get_msg_in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=SHELL_WAIT_SLICE_S if left is None else min(SHELL_WAIT_SLICE_S, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return get_msg_in_slices


def output_path(stem: str, version: str) -> pathlib.Path:
    """``labs/<stem>.ipynb`` for the learner, ``labs/solutions/<stem>.ipynb`` for the solution."""
    return (LABS if version == "student" else SOLUTIONS) / f"{stem}.ipynb"


def write(stem: str, cells: list, version: str, *, execute: bool = True, timeout: int = 600,
          path: pathlib.Path | None = None, committed_figures: bool = True) -> pathlib.Path:
    """Write (and execute, with the kernel in the notebook's folder) one version of a lab.
    ``committed_figures``: the run writes its figures to the committed ``labs/figures/`` (the
    build), else to the learner's ``labs/my_figures/`` (``fsdp-lab lab reset --execute``)."""
    path = path or output_path(stem, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = notebook(cells, version)
    if execute:
        os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
        if committed_figures:  # the build alone writes the committed labs/figures/
            os.environ["FSDP_LAB_BUILD"] = "1"
        else:
            os.environ.pop("FSDP_LAB_BUILD", None)
        LabClient(nb, timeout=timeout, kernel_name="python3",
                  resources={"metadata": {"path": str(path.parent)}}).execute()
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"{stem[:2]}-{index:02d}"  # stable ids keep diffs of re-built labs small
    nbformat.write(nb, path)
    print(f"wrote {path}", file=sys.stderr)
    return path


def build(source_file: str, cells: list, timeout: int = 600, execute: bool | None = None,
          versions: tuple[str, ...] | None = None) -> pathlib.Path:
    """Write ``labs/<stem>.ipynb`` from ``cells`` and execute it (kernel cwd = labs/); a lab
    with exercises also gets ``labs/solutions/<stem>.ipynb``. Returns the learner's path.

    ``execute`` / ``versions`` left as None are read from the command line of the lab
    source (``--no-execute``, ``--only student|solution``).
    """
    stem = pathlib.Path(source_file).stem
    if execute is None or versions is None:
        args = _arguments()
        execute = (not args.no_execute) if execute is None else execute
        if versions is None:
            versions = (args.only,) if args.only else VERSIONS
    if not has_exercises(cells):
        versions = tuple(v for v in versions if v == "student")
    for version in versions:
        write(stem, cells, version, execute=execute, timeout=timeout)
    return output_path(stem, "student")


def load_cells(source_file: str | os.PathLike) -> list:
    """``CELLS`` of a lab source file, imported without building it."""
    source_file = pathlib.Path(source_file)
    spec = importlib.util.spec_from_file_location(f"lab_source_{source_file.stem}", source_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CELLS


def exercises(cells: list) -> list[Exercise]:
    """The exercise cells of a lab, in order."""
    return [c for c in cells if isinstance(c, Exercise)]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Build (and execute) a lab notebook.")
    parser.add_argument("--only", choices=VERSIONS, help="build only this version")
    parser.add_argument("--no-execute", action="store_true", help="write without running cells")
    args, _ = parser.parse_known_args()
    return args
