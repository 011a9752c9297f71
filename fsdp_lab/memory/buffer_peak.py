"""``GradBufferPeak``: the peak bytes of chosen tagged buffers during a block, op by op.

A ``MemoryTracker`` reports a whole step's peak, which on gloo is set by buffers every
gradient path has alike (the reduce-scatter's receive buffer). To compare two ways of
building a gradient (FSDP1's ``grad_accumulation="flat"`` against ``"concat"``), this
dispatch mode samples only the storages tagged with the given categories
(``fsdp_lab.memory.tags``) after every op and keeps the largest total.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.memory import tags

__all__ = ["GradBufferPeak"]


class GradBufferPeak(TorchDispatchMode):
    """Peak bytes held by FSDP's gradient buffers, sampled after every op.

        with GradBufferPeak() as gp:
            loss.backward()
        gp.peak  # bytes

    Counts live storages tagged with ``categories`` (default: full-size gradients and
    communication inputs, which live only inside one backward).
    """

    def __init__(self, categories=("unsharded_grads", "comm_buffers")):
        super().__init__()
        self.categories, self.peak = set(categories), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = sum(st.nbytes() for st, cat in list(tags._tags.items()) if cat in self.categories)
        self.peak = max(self.peak, live)
        return out
