"""Build a lab notebook from a plain Python description and execute it so outputs are committed.

Each lab has a source file ``labs/src/NN_name.py`` that defines ``CELLS`` (a list of
``md("...")`` / ``code("...", tags=[...])``) and calls ``build(__file__, CELLS)``.
Running it writes ``labs/NN_name.ipynb`` with fresh outputs:

    python labs/src/01_collectives.py          # rebuild and execute one lab

Tags understood by nbval: ``nbval-ignore-output`` (timings, device names), ``nbval-skip``.
"""

from __future__ import annotations

import os
import pathlib
import sys
import textwrap

import nbformat
from nbclient import NotebookClient

LABS = pathlib.Path(__file__).resolve().parent.parent


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(textwrap.dedent(text).strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def build(source_file: str, cells: list, timeout: int = 600, execute: bool = True) -> pathlib.Path:
    """Write ``labs/<stem>.ipynb`` from ``cells`` and execute it in place (kernel cwd = labs/)."""
    stem = pathlib.Path(source_file).stem
    path = LABS / f"{stem}.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    if execute:
        os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(LABS)}}).execute()
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"{stem[:2]}-{index:02d}"  # stable ids keep diffs of re-built labs small
    nbformat.write(nb, path)
    print(f"wrote {path}", file=sys.stderr)
    return path
