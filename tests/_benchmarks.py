"""Load a script of benchmarks/ as a module, so tests can call its functions."""

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a fresh module. benchmarks/ goes on ``sys.path`` first, as it
    is when the script runs, since some scripts import their neighbours (``allocation_hook``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
