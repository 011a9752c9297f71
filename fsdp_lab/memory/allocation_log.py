"""The compiled ledger behind ``MemoryTracker(source="allocator")``: it hears the allocators'
reports and books them as they come (``allocation_log.cpp`` says how).

``allocation_log.cpp`` is built once per machine by ``torch.utils.cpp_extension.load`` (40 s on
a 2-core CPU; cached on disk by torch, under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``),
then loaded in a second or two by each process that uses it. It needs a C++ compiler and ninja.
"""

from __future__ import annotations

import os
import pathlib
import shutil

SOURCE = pathlib.Path(__file__).with_name("allocation_log.cpp")
_NAME = "fsdp_lab_allocation_log"
_loaded = None


def toolchain_missing() -> str | None:
    """None when the tools the build needs are found, else what is missing: the C++ compiler torch
    calls (``$CXX``, else ``c++``) and ninja (the ``ninja`` pip package provides one)."""
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; install g++ or clang, or set CXX)")
    try:
        from torch.utils.cpp_extension import is_ninja_available
        has_ninja = is_ninja_available()
    except ImportError:
        has_ninja = shutil.which("ninja") is not None
    if not has_ninja:
        missing.append("ninja (`pip install ninja`)")
    return " and ".join(missing) or None


def load():
    """The extension module (its ``Ledger`` class: ``start()``, the events, ``pack``/``unpack``
    for autograd's saved-tensor hooks, ``results()``, ``stop()``), built at the first call on
    this machine.

    Raises RuntimeError naming what failed (no compiler, no ninja, no headers) and the fix.
    """
    global _loaded
    if _loaded is None:
        from torch.utils.cpp_extension import load as build
        try:
            _loaded = build(_NAME, [str(SOURCE)], extra_cflags=["-O2"])
        except Exception as error:  # a missing compiler or ninja surfaces as several error types
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise RuntimeError(
                "MemoryTracker(source='allocator') compiles a small C++ extension at first use, and "
                f"building it failed ({type(error).__name__}: {first_line}). Install a C++ compiler "
                "(g++ or clang) and ninja (`pip install ninja`), or track with the default "
                "source='dispatch', which needs no compiler") from error
    return _loaded


def new_ledger(device_type: str):
    """A ``Ledger`` for storages on ``device_type`` ("cpu" or "cuda"), with the dispatch tracker's
    categories and rules (``memory.tags.CATEGORIES``, ``memory.ledger.SAVED_BECOME_ACTIVATIONS``);
    not listening until its ``start()``. Raises RuntimeError as ``load()`` does."""
    from fsdp_lab.memory.ledger import SAVED_BECOME_ACTIVATIONS
    from fsdp_lab.memory.tags import CATEGORIES

    return load().Ledger(device_type, list(CATEGORIES), list(SAVED_BECOME_ACTIVATIONS))
