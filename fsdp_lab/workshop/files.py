"""Where a lab notebook reads and writes its files, from either copy of the lab.

A notebook's kernel starts in the notebook's folder: ``labs/`` for the learner's copy,
``labs/solutions/`` for the solution. Both must use the same ``labs/figures/NN_name/``, and
the solution must never overwrite a committed figure (its run differs: other timings, other
widget state). The files in ``labs/figures/`` are committed (README and docs show them), so
only the lab build writes there (``labs/src/nbbuild.py`` sets ``FSDP_LAB_BUILD=1``); any
other run of a notebook (a learner in JupyterLab, ``pytest --nbval labs/``) writes its own
files to ``labs/my_figures/NN_name/``, which git ignores, and leaves the checkout clean.
``lab_files("03_zero_by_hand")`` finds the labs folder from the working directory and hands
out those paths:

    files = lab_files("03_zero_by_hand")
    files.savefig(fig, "memory_per_stage.png", dpi=100)   # skipped in the solution if it exists
    files.save("trace.json", timeline.to_chrome_trace)     # any writer taking a path
    files.figures / "memory_per_stage.png"                 # where it is, to read it back
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable

SOLUTIONS_DIR = "solutions"
FIGURES_DIR = "figures"          # committed: written by the lab build only
OWN_FIGURES_DIR = "my_figures"   # git-ignored: every other run of a notebook
BUILD_ENV = "FSDP_LAB_BUILD"     # set to 1 by labs/src/nbbuild.py


@dataclasses.dataclass(frozen=True)
class LabFiles:
    """Paths of one lab. ``labs``: the labs folder; ``figures``: where this run writes,
    ``labs/figures/<lab>`` in the lab build, else ``labs/my_figures/<lab>`` (created);
    ``solution``: True when running from ``labs/solutions/``."""

    lab: str
    labs: pathlib.Path
    figures: pathlib.Path
    solution: bool

    def save(self, name: str, writer: Callable[..., Any], **kwargs) -> None:
        """Write ``figures/<name>`` with ``writer(path, **kwargs)``; the solution notebook leaves
        an existing file alone (it belongs to the learner's copy). The file appears whole or not
        at all (written under a temporary name, then renamed). Returns None, so a cell ending
        with it shows nothing; the file is at ``self.figures / name``. Raises what ``writer``
        raises (the partial file is removed; an earlier file stays as it was)."""
        path = self.figures / name
        if self.solution and path.exists():
            return
        # Written beside, then renamed into place: two runs of the lab at once (nbval and the
        # browser, a learner's two tabs) never leave or read a half-written file.
        partial = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
        try:
            writer(str(partial), **kwargs)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    def savefig(self, fig, name: str, **kwargs) -> None:
        """``fig.savefig`` into ``figures/<name>``, with the rule of :meth:`save`."""
        self.save(name, fig.savefig, **kwargs)


def lab_files(lab: str, cwd: str | os.PathLike | None = None) -> LabFiles:
    """The paths of lab ``lab`` (e.g. "03_zero_by_hand") seen from ``cwd`` (default: the
    working directory, which Jupyter and nbval set to the notebook's folder).

    The labs folder is ``cwd`` itself, or its parent when ``cwd`` is ``labs/solutions``.
    Raises ValueError for a lab name that is not ``NN_name``.
    """
    if len(lab) < 4 or not lab[:2].isdigit() or lab[2] != "_":
        raise ValueError(f"lab name {lab!r} must look like 'NN_name', e.g. '03_zero_by_hand'")
    here = pathlib.Path(cwd if cwd is not None else os.getcwd()).resolve()
    solution = here.name == SOLUTIONS_DIR and any(
        (here.parent / folder).is_dir() for folder in (FIGURES_DIR, OWN_FIGURES_DIR))
    labs = here.parent if solution else here
    building = os.environ.get(BUILD_ENV) == "1"
    figures = labs / (FIGURES_DIR if building else OWN_FIGURES_DIR) / lab
    figures.mkdir(parents=True, exist_ok=True)
    return LabFiles(lab=lab, labs=labs, figures=figures, solution=solution)
