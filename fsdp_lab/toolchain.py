"""What building C++ needs on this machine, for the two things in fsdp_lab that build it.

* ``torch.compile`` on CPU (lab 08): inductor writes C++ and builds it with the compiler
  ``torch._inductor.config.cpp.cxx`` names (``$CXX``, else ``g++``; ``clang++`` on macOS).
* ``MemoryTracker(source="allocator")``: ``torch.utils.cpp_extension`` builds its ledger with
  ``$CXX``, else ``c++``, driven by ninja.

Both include ``Python.h``, which a Python installed from a Linux distribution's packages ships
only in its development package. Each function returns None when nothing is missing, else one
sentence that names what is missing and how to get it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import sysconfig


def python_headers_missing() -> str | None:
    """None when ``Python.h`` is in this interpreter's include folder (``sysconfig``), where
    C++ built for it looks; else what is missing and the package that has it."""
    include = sysconfig.get_paths()["include"]
    if (pathlib.Path(include) / "Python.h").is_file():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"Python's C headers (no Python.h in {include}: install python{version}-dev on Debian and "
            "Ubuntu or python3-devel on Fedora, or use a Python that ships them, as conda's, pyenv's and uv's do)")


def compiler_missing(names: list[str]) -> str | None:
    """None when one of the compilers ``names`` (commands or paths) is found, else what is missing."""
    if any(shutil.which(name) for name in names):
        return None
    looked_for = " or ".join(repr(name) for name in names)
    return f"a C++ compiler ({looked_for} is not on PATH: install g++ or clang, or set CXX to one)"


def missing_for_torch_compile() -> str | None:
    """What ``torch.compile``'s CPU backend would lack here: the compiler inductor calls, Python's
    headers; None when both are found."""
    from torch._inductor import config
    missing = [compiler_missing([name for name in config.cpp.cxx if name]), python_headers_missing()]
    return " and ".join(m for m in missing if m) or None


def missing_for_extension() -> str | None:
    """What building a torch C++ extension (the allocator tracker's ledger) would lack here: the
    compiler torch calls (``$CXX``, else ``c++``), ninja (the ``ninja`` pip package has one),
    Python's headers; None when all are found."""
    missing = [compiler_missing([os.environ.get("CXX", "c++")]), python_headers_missing()]
    try:
        from torch.utils.cpp_extension import is_ninja_available
        has_ninja = is_ninja_available()
    except ImportError:
        has_ninja = shutil.which("ninja") is not None
    if not has_ninja:
        missing.insert(1, "ninja (`pip install ninja`)")
    return " and ".join(m for m in missing if m) or None
