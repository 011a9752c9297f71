"""Dynamic loss scaling for float16 training on sharded gradients.

float16 has 5 exponent bits: gradients below about 6.1e-5 lose precision (subnormals) and below
about 3e-8 (half the smallest subnormal, 6e-8) become zero, while values above 65504 overflow to inf. Loss scaling
(Micikevicius et al., "Mixed Precision Training", 2017) multiplies the loss by a large factor S
before backward, so small gradients stay representable, and divides the gradients by S before
the optimizer step. When some gradient overflowed (inf or NaN), the step is skipped and S
halves; after ``growth_interval`` clean steps S doubles.

Under FSDP each rank holds only its shard of every gradient, so one rank can see an inf that
the others do not. The ranks must agree, or some would step and others skip and the replicas
drift apart: the "found inf" flag is all-reduced across the process group before deciding.
That is what PyTorch's ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` adds to
``torch.amp.GradScaler`` (it all-reduces with the default op, SUM: any non-zero sum means skip);
this class all-reduces with MAX (1 means skip), and has the same update rule and defaults (init
scale 2**16, growth 2, backoff 0.5, interval 2000), written to be read in one sitting.

bfloat16 keeps float32's 8 exponent bits and needs no loss scaling.

    scaler = ShardedLossScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)      # unscales, agrees on inf across ranks, skips the step if any
    scaler.update()             # halves the scale after an overflow, doubles it after a clean run
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lab import collectives


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements: ``t.to_local()`` for a DTensor (FSDP2's sharded
    gradients), ``t`` itself otherwise. Writing into it writes into ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def unscale_and_check(grads: list[torch.Tensor], scale: float, group=None) -> bool:
    """Divide every gradient in ``grads`` by ``scale`` in place and return True when any
    element on ANY rank of ``group`` is inf or NaN (one MAX all-reduce of a one-element flag;
    nothing is communicated outside a distributed run). Every rank of the group must call it.

    Raises ValueError when ``scale`` is not a positive finite number.
    """
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    found = torch.zeros(1)
    for g in grads:
        local = local_tensor(g)
        if not torch.isfinite(local).all():
            found.fill_(1.0)
        local.mul_(1.0 / scale)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        collectives.all_reduce(found, op="max", group=group, name="found_inf")
    return bool(found.item())


class ShardedLossScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank.

    ``scale(loss)`` returns ``loss * scale``; ``unscale_(optimizer)`` divides the gradients of
    the optimizer's parameters by the scale and agrees across ranks whether any is inf/NaN;
    ``step(optimizer)`` unscales if not done yet and runs ``optimizer.step()`` unless an
    overflow was found (returns whether it stepped); ``update()`` adjusts the scale: times
    ``backoff_factor`` after an overflow, times ``growth_factor`` after ``growth_interval``
    consecutive clean steps. ``skipped`` counts skipped steps.

    Raises ValueError for a non-positive scale or factors on the wrong side of 1, and
    RuntimeError when ``unscale_`` is called twice before ``update()`` (as torch's GradScaler).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if init_scale <= 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                             f"{backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be at least 1, got {growth_interval}")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self._growth_tracker = 0
        self._found_inf: bool | None = None  # None: not unscaled since the last update()
        self.skipped = 0

    def get_scale(self) -> float:
        """The current scale factor."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``.backward()`` on it)."""
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the optimizer's gradients by the scale, in place; returns whether any rank
        found an inf or NaN. Call at most once between updates (e.g. before clipping)."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._found_inf = unscale_and_check(grads, self._scale, self.group)
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done yet) and step, unless some rank found an overflow. Returns True
        when the optimizer stepped."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        if self._found_inf:
            self.skipped += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust the scale from this step's verdict (the rule of torch's ``_amp_update_scale_``)."""
        if self._found_inf is None:
            raise RuntimeError("update() needs unscale_() or step() first in this iteration")
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
