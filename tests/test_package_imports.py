"""Every import in ``fsdp_lab`` points down: no module reaches itself again through the modules
it imports, at the top or inside a function (an import moved into a function to dodge a circle
is still a circle). Read from the source (ast), so nothing is imported to check it."""

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The fsdp_lab module ``name`` names, or its closest module parent (``a.b.func`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, bool]]:
    """(fsdp_lab module imported, whether the import sits inside a function) for ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((_resolve(a.name), nested) for a in child.names if a.name.startswith("fsdp_lab"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from .x import y
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1] + ([base] if base else []))
                if base.startswith("fsdp_lab"):
                    for alias in child.names:
                        target = _resolve(f"{base}.{alias.name}")
                        found.append((target, nested))
            visit(child, nested)

    visit(ast.parse(path.read_text()), False)
    return [(name, nested) for name, nested in found if name is not None and name != module]


GRAPH = {m: _imports(m) for m in MODULES}

def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in GRAPH:
        if v not in index:
            connect(v)
    return groups


def test_the_walk_sees_the_package():
    # a walker that found nothing would pass everything: check it sees known edges
    assert len(MODULES) > 40
    assert ("fsdp_lab.collectives", False) in GRAPH["fsdp_lab.timeline"]
    assert any(name.startswith("fsdp_lab.fsdp1.") for name, _ in GRAPH["fsdp_lab.qlora.nf4_handle"])


def test_no_import_circle_in_the_package():
    circles = _circles()
    assert not circles, "import circles (each group reaches itself): " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_function_level_import_that_closes_a_circle():
    # a function-level import of X from M dodges a circle exactly when X reaches M again
    def reaches(start, target):
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            if v == target:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(w for w, _ in GRAPH[v])
        return False

    dodges = sorted({f"{m} -> {x}" for m, edges in GRAPH.items() for x, nested in edges
                     if nested and reaches(x, m)})
    assert not dodges, f"imports inside functions that hide a circle: {dodges}"


def _architecture_layers() -> dict[str, int]:
    """docs/ARCHITECTURE.md's layer list: module (or ``pkg/`` for a subpackage) -> its line number.
    Only names outside parentheses count (the parentheses explain, they do not place)."""
    import re

    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers, current, depth = {}, None, 0
    for line in section.splitlines():
        numbered = re.match(r"(\d+)\. ", line)
        if numbered:
            current = int(numbered.group(1))
        elif not line.startswith("   "):
            current = None
        if current is None:
            continue
        outside = []
        for char in line:  # drop parenthesised text, which may span lines
            depth += char == "("
            if depth == 0:
                outside.append(char)
            depth -= char == ")" and depth > 0
        for name in re.findall(r"`([\w./]+)`", "".join(outside)):
            assert name not in layers, f"{name} is on two lines of docs/ARCHITECTURE.md's layer list"
            layers[name] = current
    return layers


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    short = module.removeprefix("fsdp_lab.") if module != "fsdp_lab" else "fsdp_lab"
    if short in layers:
        return layers[short]
    first = short.split(".")[0]
    return layers.get(f"{first}/")  # a module inside a subpackage listed whole


def test_the_architecture_page_s_layers_are_the_imports():
    layers = _architecture_layers()
    assert len(layers) > 30, "the layer list was not found in docs/ARCHITECTURE.md"
    unplaced = sorted(m for m in MODULES if _layer_of(m, layers) is None)
    assert not unplaced, f"modules on no line of docs/ARCHITECTURE.md's layer list: {unplaced}"
    upward = sorted(f"{m} (line {_layer_of(m, layers)}) imports {x} (line {_layer_of(x, layers)})"
                    for m, edges in GRAPH.items() for x, _ in edges
                    if _layer_of(x, layers) >= _layer_of(m, layers)
                    and not (_layer_of(x, layers) == _layer_of(m, layers) and m.split(".")[:2] == x.split(".")[:2]
                             and f"{m.split('.')[1]}/" in layers))
    assert not upward, "imports that do not point up the list: " + "; ".join(upward)
