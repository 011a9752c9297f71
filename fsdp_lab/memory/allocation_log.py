"""The compiled ledger behind ``MemoryTracker(source="allocator")``: it hears the allocators'
reports and books them as they come (``allocation_log.cpp`` says how).

``allocation_log.cpp`` is built once per machine by ``torch.utils.cpp_extension.load`` (40 s on
a 2-core CPU; cached on disk by torch, under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``),
then loaded in a second or two by each process that uses it. It needs a C++ compiler, ninja and
Python's headers (``fsdp_lab.toolchain.missing_for_extension`` says which are missing).
"""

from __future__ import annotations

import pathlib

SOURCE = pathlib.Path(__file__).with_name("allocation_log.cpp")
_NAME = "fsdp_lab_allocation_log"
_loaded = None


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
                "(g++ or clang), ninja (`pip install ninja`) and Python's headers (`fsdp-lab doctor` "
                "says which are missing), or track with the default source='dispatch', which needs "
                "no compiler") from error
    return _loaded


def new_ledger(device_type: str):
    """A ``Ledger`` for storages on ``device_type`` ("cpu" or "cuda"), with the dispatch tracker's
    categories and rules (``memory.tags.CATEGORIES``, ``memory.ledger.SAVED_BECOME_ACTIVATIONS``);
    not listening until its ``start()``. Raises RuntimeError as ``load()`` does."""
    from fsdp_lab.memory.ledger import SAVED_BECOME_ACTIVATIONS
    from fsdp_lab.memory.tags import CATEGORIES

    return load().Ledger(device_type, list(CATEGORIES), list(SAVED_BECOME_ACTIVATIONS))
