"""OOM-safe microbatching: find the largest microbatch that fits, on every rank at once.

    amb = AutoMicrobatch(model, optimizer, global_batch_size=16)
    for batch in batches:
        result = amb.train_step(batch)      # loss, microbatch_size, retries

``train_step`` splits this rank's batch into microbatches, runs forward/backward on each
(gradients accumulate, each microbatch's loss weighted by its share of the batch), then steps
the optimizer. When any rank runs out of memory, all ranks agree on it (``fsdp_lab.oom.agree``:
MAX of "I ran out", MIN of "I am done"), return FSDP to its sharded idle state
(``FSDPModule.recover_from_error``), drop partial gradients, halve the microbatch and run the
same batch again. A finished step therefore equals a step with a fixed microbatch of the size
chosen (same gradients up to round-off).

Deadlock freedom: while *sync hooks* are installed, every FSDP collective is preceded by the
same two-flag all-reduce (``fsdp_lab.oom.sync_hook`` at ``fsdp_lab.sync_points``), so a rank
whose peer failed learns of it before entering a collective the peer will never join. The
hooks cost a tiny all-reduce per collective: they are removed after ``stable_steps`` clean
steps and re-installed after an OOM, after ``after_eval()`` and when thrashing is detected.
Thrashing (CUDA): ``num_alloc_retries`` growing in ``THRASHING_STREAK`` (2) consecutive steps
on any rank (MAX all-reduce) counts as an OOM for the next step's microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import oom, sync_points
from fsdp_lab.checks import check_bool, check_model_and_optimizer, check_positive_int
from fsdp_lab.oom import PeerOutOfMemoryError, agree, suspend_budget

# Steps in a row whose allocator retries grew that count as an out-of-memory (Composer's rule).
THRASHING_STREAK = 2

__all__ = ["AutoMicrobatch", "StepResult", "MicrobatchSearchError", "OptimizerStepOOMError", "split_batch"]


class MicrobatchSearchError(RuntimeError):
    """No microbatch size that divides the batch fits in memory (raised on every rank)."""


class OptimizerStepOOMError(RuntimeError):
    """The optimizer step ran out of memory (raised on every rank while sync hooks are installed).

    The step's memory does not depend on the microbatch size, so it is not retried.
    """


@dataclasses.dataclass
class StepResult:
    """What one ``train_step`` did: mean loss on this rank, the microbatch size that finished,
    how many microbatches that took, how many times the batch was retried after an OOM, and
    whether the sync hooks were installed during the step."""

    loss: float
    microbatch_size: int
    num_microbatches: int
    retries: int
    hooks: bool


def _default_loss(model: nn.Module, microbatch: Any) -> torch.Tensor:
    return model(microbatch).loss


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if dataclasses.is_dataclass(batch):
        return _batch_len(getattr(batch, dataclasses.fields(batch)[0].name))
    if isinstance(batch, (tuple, list)):
        return _batch_len(batch[0])
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    raise TypeError(f"cannot find the batch size of a {type(batch).__name__}; pass tensors, tuples, dicts "
                    "or a dataclass of tensors (batch along dim 0)")


def split_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` (dim 0) of every tensor in ``batch`` (tensor, tuple, list, dict or dataclass)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if dataclasses.is_dataclass(batch):
        return type(batch)(**{f.name: split_batch(getattr(batch, f.name), start, stop)
                              for f in dataclasses.fields(batch)})
    if isinstance(batch, (tuple, list)):
        return type(batch)(split_batch(x, start, stop) for x in batch)
    if isinstance(batch, dict):
        return {k: split_batch(v, start, stop) for k, v in batch.items()}
    return batch


def _alloc_retries(device: torch.device) -> int | None:
    """The CUDA caching allocator's ``num_alloc_retries`` (None off CUDA: nothing to detect)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _max_flag(value: bool) -> bool:
    """True if ``value`` is true on any rank (``oom._flag``: a one-element all-reduce, ``oom_flag``)."""
    if not dist.is_initialized():
        return bool(value)
    return bool(oom._flag(int(value), "max"))


class AutoMicrobatch:
    """Train with the largest microbatch that fits, searched by halving on out-of-memory.

    Args:
        model: the model (FSDP2 ``fully_shard``-ed, FSDP1-wrapped or plain).
        optimizer: its optimizer; ``train_step`` calls ``step()`` and ``zero_grad()``.
        global_batch_size: samples in the batch each ``train_step`` gets on this rank
            (this rank's share of the global batch); split into microbatches.
        start: first microbatch size to try (default: the whole batch). Sizes tried are
            divisors of ``global_batch_size``: ``start`` (or its largest divisor below), then
            the largest divisor at most half the last size that ran out of memory.
        min_microbatch: never try below this size.
        loss_fn: ``loss_fn(model, microbatch) -> scalar loss`` (default ``model(mb).loss``).
        stable_steps: clean steps after which the sync hooks are removed (3, as in Composer).
        detect_thrashing: step down when CUDA allocator retries grow in ``THRASHING_STREAK`` (2)
            consecutive steps.

    Raises ValueError for a bad size argument, TypeError for a ``detect_thrashing`` that is not a bool.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, global_batch_size: int,
                 start: int | None = None, *, min_microbatch: int = 1,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None, stable_steps: int = 3,
                 detect_thrashing: bool = True):
        check_model_and_optimizer("AutoMicrobatch", model, optimizer, required=True)
        for name, value in (("global_batch_size", global_batch_size), ("min_microbatch", min_microbatch),
                            ("stable_steps", stable_steps)):
            check_positive_int(name, value)
        check_bool("detect_thrashing", detect_thrashing)
        start = global_batch_size if start is None else start
        if not isinstance(start, int) or not min_microbatch <= start <= global_batch_size:
            raise ValueError(f"start must be an int between min_microbatch={min_microbatch} and "
                             f"global_batch_size={global_batch_size}, got {start!r}")
        first = self._largest_divisor(global_batch_size, start, min_microbatch)
        if first is None:
            raise ValueError(f"no microbatch size between min_microbatch={min_microbatch} and start={start} "
                             f"divides global_batch_size={global_batch_size}; lower min_microbatch")
        self.model, self.optimizer = model, optimizer
        self.global_batch_size, self.min_microbatch = global_batch_size, min_microbatch
        self.microbatch_size = first
        self.loss_fn = loss_fn or _default_loss
        self.stable_steps, self.detect_thrashing = stable_steps, detect_thrashing
        self.history: list[dict] = []  # one dict per event: step, event, microbatch_size
        self.tried: list[int] = []
        self.steps = 0
        self._clean = 0
        self._hook = False
        self._retry_streak, self._last_retries = 0, None
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if dist.is_initialized():
            oom.flag_group()  # a collective: every rank builds its AutoMicrobatch
        self._install_hooks()

    # -- hooks -------------------------------------------------------------------------------
    @property
    def hooks_installed(self) -> bool:
        """Whether the sync hooks run before every FSDP collective right now."""
        return self._hook

    def _install_hooks(self) -> None:
        self._clean = 0
        if not self._hook and dist.is_initialized() and dist.get_world_size() > 1:
            oom.enable_sync_hooks(self)
            self._hook = True
            self._log("hooks_installed")

    def remove_hooks(self) -> None:
        """Remove the sync hooks now (they come back after an OOM, an eval or thrashing)."""
        if self._hook:
            oom.disable_sync_hooks(self)
            self._hook = False
            self._log("hooks_removed")

    def close(self) -> None:
        """Remove the sync hooks for good (call on every rank when done training with this object)."""
        self.remove_hooks()

    def after_eval(self) -> None:
        """Call after evaluation: memory use may have changed, so the sync hooks come back."""
        self._install_hooks()

    def _log(self, event: str, **extra) -> None:
        self.history.append({"step": self.steps, "event": event, "microbatch_size": self.microbatch_size, **extra})

    # -- the step --------------------------------------------------------------------------
    def train_step(self, batch: Any) -> StepResult:
        """Forward/backward over microbatches of ``batch``, then one optimizer step (same on all ranks).

        Raises ValueError if the batch does not hold ``global_batch_size`` samples;
        ``MicrobatchSearchError`` when no size fits (with this rank's memory breakdown);
        ``OptimizerStepOOMError`` when the optimizer step itself runs out of memory.
        """
        n = _batch_len(batch)
        if n != self.global_batch_size:
            raise ValueError(f"train_step got a batch of {n} samples; this AutoMicrobatch was made for "
                             f"global_batch_size={self.global_batch_size}")
        retries, hooks_during = 0, self.hooks_installed
        while True:
            self.tried.append(self.microbatch_size)
            failed, breakdown = False, ""
            try:
                loss = self._forward_backward(batch)
                sync_points.fire("optimizer_step", "")
            except torch.OutOfMemoryError as error:
                failed, breakdown = True, f"{error}\n{self._breakdown()}"
            except PeerOutOfMemoryError:
                pass
            if not agree(failed):
                break
            self._log("oom", this_rank=failed)
            self._recover()
            retries += 1
            self._step_down(breakdown)
            hooks_during = True
        self._optimizer_step()
        result = StepResult(loss, self.microbatch_size, n // self.microbatch_size, retries, hooks_during)
        self.steps += 1
        self._after_clean_step()  # may lower the size for the next step (thrashing)
        return result

    def _forward_backward(self, batch: Any) -> float:
        size, total = self.microbatch_size, 0.0
        for begin in range(0, self.global_batch_size, size):
            microbatch = split_batch(batch, begin, begin + size)
            loss = self.loss_fn(self.model, microbatch) * (size / self.global_batch_size)
            loss.backward()
            total = total + loss.detach()
            del loss
        return float(total)

    def _recover(self) -> None:
        with suspend_budget():
            for module in self.model.modules():
                if hasattr(module, "recover_from_error"):
                    module.recover_from_error()
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.model.parameters():
                p.grad = None
        self._install_hooks()

    def _step_down(self, breakdown: str) -> None:
        size = self.microbatch_size
        smaller = self._largest_divisor(self.global_batch_size, size // 2, self.min_microbatch)
        if smaller is not None:
            self.microbatch_size = smaller
            return
        where = breakdown or "a peer rank ran out of memory (see its breakdown); this rank's memory:\n" + \
            self._breakdown()
        if size == 1:
            raise MicrobatchSearchError(f"out of memory even at microbatch size 1 (tried {self.tried}); "
                                        f"shard over more ranks, offload, checkpoint activations or shorten the "
                                        f"sequence. Memory at the failure:\n{where}")
        raise MicrobatchSearchError(
            f"global_batch_size={self.global_batch_size} is not divisible by any microbatch size that fits: "
            f"tried {self.tried}, smallest size tried {size}, min_microbatch={self.min_microbatch}; lower "
            f"min_microbatch or pick a batch size with more divisors. Memory at the failure:\n{where}")

    def _optimizer_step(self) -> None:
        failed, breakdown = False, ""
        try:
            self.optimizer.step()
        except torch.OutOfMemoryError as error:
            failed, breakdown = True, f"{error}\n{self._breakdown()}"
        # While hooks are on, all ranks agree on a failed step. Once settled (hooks off) that
        # all-reduce is skipped like the hooks: a failing rank raises on its own.
        if (_max_flag(failed) if self.hooks_installed else failed):
            with suspend_budget():
                self.optimizer.zero_grad(set_to_none=True)
            raise OptimizerStepOOMError(
                "the optimizer step ran out of memory" + (" on this rank" if failed else " on another rank") +
                "; its memory does not depend on the microbatch size, so the step is not retried (parameters of "
                "ranks that finished it are updated). Offload the optimizer (CPUOffloadPolicy) or shard over more "
                f"ranks.\n{breakdown}")
        self.optimizer.zero_grad(set_to_none=True)

    def _after_clean_step(self) -> None:
        if self.detect_thrashing and self._thrashing():
            self._log("thrashing")
            self._install_hooks()
            smaller = self._largest_divisor(self.global_batch_size, self.microbatch_size // 2, self.min_microbatch)
            if smaller is not None:
                self.microbatch_size = smaller
            return
        self._clean += 1
        if self._clean >= self.stable_steps:
            self.remove_hooks()

    def _thrashing(self) -> bool:
        retries = _alloc_retries(self.device)
        if retries is None:
            return False
        grew = self._last_retries is not None and retries > self._last_retries
        self._last_retries = retries
        self._retry_streak = self._retry_streak + 1 if grew else 0
        agreed = _max_flag(self._retry_streak >= THRASHING_STREAK)
        if agreed:
            self._retry_streak = 0
        return agreed

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _largest_divisor(n: int, at_most: int, at_least: int) -> int | None:
        for size in range(min(at_most, n), at_least - 1, -1):
            if n % size == 0:
                return size
        return None

    def _breakdown(self) -> str:
        tracker = oom.active_budget()
        if tracker is not None:
            return tracker.breakdown()
        if self.device.type == "cuda":
            return (f"  allocated {torch.cuda.memory_allocated(self.device) / 2**20:.1f} MiB, reserved "
                    f"{torch.cuda.memory_reserved(self.device) / 2**20:.1f} MiB\n"
                    + torch.cuda.memory_summary(self.device, abbreviated=True))
        return "  (no memory tracker active: wrap training in fsdp_lab.oom.memory_budget to see categories)"
