"""``fsdp-lab lab``: the labs of a workshop, from the command line.

    fsdp-lab lab list                 # every lab, its exercises, where its solution is
    fsdp-lab lab reset 03             # put labs/03_*.ipynb back to the learner's copy
    fsdp-lab lab reset 03 --execute   # ... and run it, as shipped (about the lab's run time)
    fsdp-lab lab solution 03          # where the solved copy is and how to open it

``reset`` rebuilds the notebook from its source (``labs/src/NN_name.py``), so it needs no git:
the stubs come back, outputs are cleared (or recomputed with ``--execute``), and the
notebook it replaces is kept in ``labs/.backup/``. The labs folder is ``--labs``, else
``./labs`` or the current folder when it holds ``src/nbbuild.py``, else the one beside this
package.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import shutil
import sys

BACKUP_DIR = ".backup"


class LabNotFound(ValueError):
    """No labs folder, or no lab by that name; the message says what exists."""


def find_labs(explicit: str | None = None) -> pathlib.Path:
    """The labs folder: ``explicit``, else ./labs, else the current folder, else the one
    beside the package. Raises LabNotFound when none holds ``src/nbbuild.py``."""
    candidates = [pathlib.Path(explicit)] if explicit else [
        pathlib.Path.cwd() / "labs", pathlib.Path.cwd(),
        pathlib.Path(__file__).resolve().parents[2] / "labs"]
    for folder in candidates:
        if (folder / "src" / "nbbuild.py").is_file():
            return folder.resolve()
    raise LabNotFound(f"no labs folder (with src/nbbuild.py) at {', '.join(map(str, candidates))}; "
                      "run from the repository root or pass --labs PATH")


def lab_sources(labs: pathlib.Path) -> dict[str, pathlib.Path]:
    """{stem: source file} of every lab, e.g. {"03_zero_by_hand": labs/src/03_zero_by_hand.py}."""
    return {p.stem: p for p in sorted((labs / "src").glob("[0-9][0-9]_*.py"))}


def resolve(labs: pathlib.Path, name: str) -> str:
    """The stem of lab ``name``: "3", "03", "03_zero_by_hand" or "zero_by_hand". Raises
    LabNotFound listing the labs when none or several match."""
    stems = list(lab_sources(labs))
    key = name.strip()
    if key.isdigit():
        key = f"{int(key):02d}"
    matches = [s for s in stems if s == key or s.startswith(f"{key}_") or s[3:] == key]
    if len(matches) != 1:
        raise LabNotFound(f"{'no lab' if not matches else 'several labs'} named {name!r}; "
                          f"the labs are: {', '.join(stems)}")
    return matches[0]


def load_nbbuild(labs: pathlib.Path):
    """``labs/src/nbbuild.py`` as the module ``nbbuild`` (lab sources import it by that name)."""
    path = labs / "src" / "nbbuild.py"
    spec = importlib.util.spec_from_file_location("nbbuild", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nbbuild"] = module
    spec.loader.exec_module(module)
    return module


def backup_path(labs: pathlib.Path, stem: str) -> pathlib.Path:
    """A new, empty file ``labs/.backup/<stem>-<date>-<time>.ipynb`` to copy a replaced notebook
    into (``..._2.ipynb``, ``..._3.ipynb``, ... when resets fall in the same second); creates the
    folder. Raises OSError when the folder or the file cannot be created."""
    folder = labs / BACKUP_DIR
    folder.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    count = 1
    while True:
        path = folder / (f"{stem}-{stamp}.ipynb" if count == 1 else f"{stem}-{stamp}_{count}.ipynb")
        try:
            # created exclusively: a backup the learner's work may be in is never overwritten,
            # even by a reset running at the same time in another process
            path.open("xb").close()
            return path
        except FileExistsError:
            count += 1


def reset(labs: pathlib.Path, name: str, *, execute: bool = False) -> tuple[pathlib.Path, pathlib.Path | None]:
    """Rebuild ``labs/<stem>.ipynb`` as the learner's copy from its source; returns
    (notebook, backup of the replaced notebook or None). The backup never replaces an earlier
    one (:func:`backup_path`). Raises LabNotFound for an unknown ``name``."""
    stem = resolve(labs, name)
    nbbuild = load_nbbuild(labs)
    cells = nbbuild.load_cells(lab_sources(labs)[stem])
    target = labs / f"{stem}.ipynb"
    backup = None
    if target.exists():
        backup = backup_path(labs, stem)
        try:
            shutil.copy2(target, backup)
        except BaseException:
            backup.unlink(missing_ok=True)  # no empty file posing as a backup
            raise
    # a learner's run: figures go to labs/my_figures/, the shipped ones stay as they are
    nbbuild.write(stem, cells, "student", execute=execute, path=target, committed_figures=False)
    return target, backup


def _list(args) -> int:
    labs = find_labs(args.labs)
    nbbuild = load_nbbuild(labs)
    print(f"labs in {labs}")
    print(f"{'lab':28s} {'exercises':>9s}  solution")
    for stem, source in lab_sources(labs).items():
        count = len(nbbuild.exercises(nbbuild.load_cells(source)))
        solution = labs / "solutions" / f"{stem}.ipynb"
        where = str(solution.relative_to(labs.parent)) if solution.exists() else "-"
        print(f"{stem:28s} {count:9d}  {where}")
    return 0


def _reset(args) -> int:
    """Reset each distinct lab in ``args.labs_to_reset`` once. Raises LabNotFound, before any lab
    is reset, when a name matches no lab (or several)."""
    labs = find_labs(args.labs)
    # every name is checked before any lab is reset, and a lab named twice ("03 3") is reset
    # once: a second reset would back up the fresh copy, not the learner's work
    stems = list(dict.fromkeys(resolve(labs, name) for name in args.labs_to_reset))
    for stem in stems:
        target, backup = reset(labs, stem, execute=args.execute)
        state = "with fresh outputs" if args.execute else "outputs cleared: run it in JupyterLab"
        print(f"{target.name}: back to the learner's copy ({state})")
        if backup is not None:
            print(f"  your previous notebook is kept as {backup}")
    return 0


def _solution(args) -> int:
    labs = find_labs(args.labs)
    stem = resolve(labs, args.lab)
    solution = labs / "solutions" / f"{stem}.ipynb"
    if not solution.exists():
        print(f"{stem} has no exercises, so no solution notebook")
        return 1
    print(f"solution of {stem}: {solution}")
    print(f"open it with:  jupyter lab {solution}")
    return 0


def add_lab_parser(subparsers) -> argparse.ArgumentParser:
    """``fsdp-lab lab list | reset NN [NN ...] [--execute] | solution NN``."""
    parser = subparsers.add_parser("lab", help="workshop: list the labs, reset one to the learner's "
                                               "copy, find its solution")
    labs_help = "the labs folder (default: ./labs or the repository's)"
    parser.add_argument("--labs", help=labs_help)
    # `fsdp-lab lab reset 03 --labs PATH` too: each action takes it, and keeps one given before it
    labs_after = argparse.ArgumentParser(add_help=False)
    labs_after.add_argument("--labs", default=argparse.SUPPRESS, help=labs_help)
    actions = parser.add_subparsers(dest="action", title="actions", required=True)
    actions.add_parser("list", parents=[labs_after],
                       help="every lab, its number of exercises and its solution").set_defaults(func=_guard(_list))
    reset_parser = actions.add_parser("reset", parents=[labs_after],
                                      help="rebuild labs/NN_*.ipynb as shipped to learners "
                                           "(the replaced one goes to labs/.backup/)")
    reset_parser.add_argument("labs_to_reset", nargs="+", metavar="NN", help="lab number or name, e.g. 03")
    reset_parser.add_argument("--execute", action="store_true",
                              help="also run the notebook, as the shipped copy is (takes the lab's run time)")
    reset_parser.set_defaults(func=_guard(_reset))
    solution_parser = actions.add_parser("solution", parents=[labs_after], help="where the solved copy of a lab is")
    solution_parser.add_argument("lab", metavar="NN", help="lab number or name, e.g. 03")
    solution_parser.set_defaults(func=_guard(_solution))
    return parser


def _guard(action):
    def run(args) -> int:
        try:
            return action(args)
        except LabNotFound as error:
            print(f"fsdp-lab lab: {error}", file=sys.stderr)
            return 2
    return run
