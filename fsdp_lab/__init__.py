"""fsdp_lab: learn, measure and debug Fully Sharded Data Parallel training.

Importing the package touches no GPU and starts nothing: the public names below are
loaded on first use.

    import fsdp_lab
    fsdp_lab.start_fork_server()                      # optional: ranks' imports start now
    results = fsdp_lab.launch(fn, world_size=2)       # run fn on 2 ranks
    with fsdp_lab.simulated_world(8): ...             # be rank 0 of 8 in this process
"""

from __future__ import annotations

import importlib

# torch imports its compiler (torch._dynamo) lazily, the first time an optimizer is built. That
# import leaves a reference cycle through the stack of frames it ran under (torch.fx.wrap keeps
# its own frame), so the first model and optimizer of a process, and every local of the
# functions that built them, would outlive ``del`` until the garbage collector runs. Imported
# here, under import frames only, it holds nothing of the user's. (About 1 s, paid once; any
# training script pays it anyway at its first optimizer.)
import torch._dynamo  # noqa: E402, F401

__version__ = "0.1.0"

# ``launch`` is both a submodule and the function it defines. Binding the function here,
# after the submodule is loaded, keeps ``fsdp_lab.launch`` the function even when other code
# later runs ``import fsdp_lab.launch`` (a repeated import does not rebind the attribute).
from fsdp_lab.launch import LaunchError, LaunchTimeout, launch, start_fork_server  # noqa: E402
from fsdp_lab.compare import compare  # noqa: E402  (same reason: module and function share a name)

# public name -> module that defines it, loaded on first use
_EXPORTS = {
    "init_distributed": "fsdp_lab.dist",
    "exit_distributed": "fsdp_lab.dist",
    "simulated_world": "fsdp_lab.dist",
    "current_device": "fsdp_lab.dist",
    "Timeline": "fsdp_lab.timeline",
    "MixedPrecisionPolicy": "fsdp_lab.precision",
    "MixedPrecision": "fsdp_lab.precision",
    "fully_shard": "fsdp_lab.fsdp2",
    "FSDPModule": "fsdp_lab.fsdp2",
    "CPUOffloadPolicy": "fsdp_lab.fsdp2",
    "OffloadPolicy": "fsdp_lab.fsdp2",
    "MemoryTracker": "fsdp_lab.memory",
    "estimate": "fsdp_lab.memory",
    "to_nf4": "fsdp_lab.qlora.nf4",
    "NF4Tensor": "fsdp_lab.qlora.nf4_tensor",
    "apply_lora": "fsdp_lab.qlora.lora",
    "merge_lora": "fsdp_lab.qlora.lora",
    "FullyShardedDataParallel": "fsdp_lab.fsdp1",
    "AutoMicrobatch": "fsdp_lab.automicrobatch",
    "memory_budget": "fsdp_lab.oom",
    "inject_oom": "fsdp_lab.oom",
}
_SUBMODULES = ("collectives", "dist", "timeline", "precision", "memory", "models", "viz",
               "fsdp1", "fsdp2", "qlora", "automicrobatch", "oom", "sync_points", "doctor")

__all__ = ["launch", "LaunchError", "LaunchTimeout", "start_fork_server", "compare"] + sorted(_EXPORTS) + list(_SUBMODULES)


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
