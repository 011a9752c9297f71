"""fsdp_lab: learn, measure and debug Fully Sharded Data Parallel training.

Importing the package touches no GPU and starts nothing: the public names below are
loaded on first use.

    import fsdp_lab
    results = fsdp_lab.launch(fn, world_size=2)       # run fn on 2 ranks
    with fsdp_lab.simulated_world(8): ...             # be rank 0 of 8 in this process
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "launch": "fsdp_lab.launch",
    "LaunchError": "fsdp_lab.launch",
    "LaunchTimeout": "fsdp_lab.launch",
    "init_distributed": "fsdp_lab.dist",
    "simulated_world": "fsdp_lab.dist",
    "current_device": "fsdp_lab.dist",
    "Timeline": "fsdp_lab.timeline",
    "MixedPrecisionPolicy": "fsdp_lab.precision",
    "MixedPrecision": "fsdp_lab.precision",
}
_SUBMODULES = ("collectives", "dist", "timeline", "precision", "memory", "models", "viz",
               "fsdp1", "fsdp2", "qlora")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"fsdp_lab.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fsdp_lab' has no attribute {name!r}")


def __dir__():
    return __all__
