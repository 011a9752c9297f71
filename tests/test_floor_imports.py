"""The floor's imports point down: launch and dist at the bottom, collectives (over their
process-group lookup) above them, the timeline and each rank's entry point on top; no import
hidden inside a function to dodge a circle. Read from the source (ast), so nothing is imported
to check it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lab"

# module -> the fsdp_lab modules it may import (the layers, bottom first)
ALLOWED = {
    "fsdp_lab.dist": set(),
    "fsdp_lab.pickling": set(),
    "fsdp_lab.forkserver": set(),
    "fsdp_lab.launch_handle": {"fsdp_lab.forkserver"},
    "fsdp_lab.launch": {"fsdp_lab.dist", "fsdp_lab.forkserver", "fsdp_lab.launch_handle",
                        "fsdp_lab.pickling"},
    "fsdp_lab.process_group": {"fsdp_lab.dist"},
    "fsdp_lab.collectives": {"fsdp_lab.dist", "fsdp_lab.process_group"},
    "fsdp_lab.bandwidth": {"fsdp_lab.collectives", "fsdp_lab.dist", "fsdp_lab.launch"},
    "fsdp_lab.timeline": {"fsdp_lab.bandwidth", "fsdp_lab.collectives"},
    "fsdp_lab.launch_rank": {"fsdp_lab.collectives", "fsdp_lab.dist", "fsdp_lab.pickling"},
    "fsdp_lab.viz.widgets": set(),
}
CHECKED = list(ALLOWED) + ["fsdp_lab.viz.memory_widgets"]


def _path(module: str) -> Path:
    parts = module.split(".")[1:]
    file = PACKAGE.joinpath(*parts).with_suffix(".py")
    return file if file.exists() else PACKAGE.joinpath(*parts, "__init__.py")


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    return PACKAGE.joinpath(*parts).with_suffix(".py").exists() or PACKAGE.joinpath(*parts).is_dir()


def _imports(module: str) -> list[tuple[str, bool]]:
    """(fsdp_lab module imported, whether the import sits inside a function) for ``module``."""
    tree = ast.parse(_path(module).read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names if a.name.startswith("fsdp_lab."))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("fsdp_lab"):
                names = [f"{child.module}.{a.name}" for a in child.names]
                submodules = [n for n in names if _is_module(n)]
                found.extend((n, nested) for n in submodules or [child.module])
            visit(child, nested)

    visit(tree, False)
    return found


@pytest.mark.parametrize("module", CHECKED)
def test_no_import_inside_a_function(module):
    hidden = sorted({name for name, nested in _imports(module) if nested})
    assert not hidden, f"{module} imports {hidden} inside a function: import at the top, downwards"


@pytest.mark.parametrize("module", list(ALLOWED))
def test_imports_point_down(module):
    imported = {name for name, _ in _imports(module) if name in ALLOWED or name in CHECKED}
    upward = imported - ALLOWED[module]
    assert not upward, f"{module} imports {sorted(upward)}, above it or beside it in the layers"


def test_no_circle_among_the_checked_modules():
    graph = {m: {n for n, _ in _imports(m) if n in CHECKED} for m in CHECKED}

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, seen + (n,))) for n in graph[start])

    circles = [m for m in CHECKED if reaches(m, m)]
    assert not circles, f"import circle through {circles}"
