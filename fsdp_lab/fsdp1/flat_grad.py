"""The gradient's life under FSDP1: per-parameter grads -> one flat buffer -> reduce -> shard.

Each trainable ``FlatParamHandle`` owns one ``FlatGrad``. In backward every original
parameter's full-shape view (an autograd leaf made by ``use_unsharded_views``) receives its
gradient; the hook ``FlatGrad.expect`` put on it moves the gradient into one flat buffer in
the accumulation dtype, laid out like the flat parameter (padding stays zero):

* ``"flat"`` (default): the flat buffer is allocated once, before the first gradient, and
  each parameter's gradient is added straight into its slice, then dropped. At most one
  parameter's low-precision gradient exists beside the buffer.
* ``"concat"`` (fairscale's ``optimize_backward_concat`` as in its PR #1184; ``"flat"`` is
  its follow-up, PR #1186; PyTorch's FSDP1 instead casts one flat gradient): each gradient is
  upcast to its own accumulation-dtype tensor and kept; when all exist they are
  ``torch.cat``-ed with the padding. The per-parameter copies and the concatenation coexist:
  about twice the buffer at the peak.

Like picotron's ``Bucket.mark_param_as_ready``, the ``FlatGrad`` counts the gradients that
arrived; once all have, it tells its unit (which frees the parameters and prefetches), and
the unit's reduce queue has it ``start_reduce``: an asynchronous reduce-scatter within the
shard group, in the wire dtype (NO_SHARD skips it). ``finish_reduce`` waits for it,
all-reduces across replicas (NO_SHARD, HYBRID_SHARD), averages over the world, casts to the
master dtype and adds the result into each original parameter's ``.grad``, a view of one
flat sharded gradient. Without gradient sync (``no_sync``) the buffer is kept for the next
backward instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from fsdp_lab import collectives, process_group, sync_points
from fsdp_lab.fsdp1.layout import FlatLayout, ShardingSpec
from fsdp_lab.memory.tags import tag

__all__ = ["GRAD_ACCUMULATION_MODES", "GradConfig", "FlatGrad", "ReduceScatter"]

GRAD_ACCUMULATION_MODES = ("flat", "concat")


@dataclasses.dataclass(frozen=True)
class GradConfig:
    """How a unit reduces its gradients (decided once per unit from its policy and strategy).

    ``accumulation_dtype``: the flat buffer's dtype, kept across microbatches without sync;
    ``wire_dtype``: the dtype on the wire (a temporary cast when it differs); ``mode``: one of
    ``GRAD_ACCUMULATION_MODES``; ``replicate_group``: ranks holding the same shard (all-reduced
    after the reduce-scatter; None when there are none); ``world_size``: every rank, the
    gradient is averaged over all of them.
    """

    accumulation_dtype: torch.dtype
    wire_dtype: torch.dtype
    mode: str = "flat"
    replicate_group: object | None = None
    world_size: int = 1


@dataclasses.dataclass
class ReduceScatter:
    """A reduce-scatter in flight: where the shard lands, the collective, what it reads."""

    output: torch.Tensor               # (shard_numel,) wire dtype: this rank's summed shard
    work: collectives.CollectiveHandle | None  # None for a shard group of 1 (nothing to scatter)
    input: torch.Tensor                # (padded_numel,) wire dtype: kept alive until finished


class FlatGrad:
    """The gradient of one flat parameter between backward and the optimizer step.

    ``layout``: the flat parameter's layout; ``spec``: its shard group and devices;
    ``config``: dtypes, mode and replicas; ``master_dtype``: dtype of the flat shard, and so of
    ``.grad``; ``name``: the unit's name (timeline events, sync points).
    """

    def __init__(self, layout: FlatLayout, spec: ShardingSpec, config: GradConfig, master_dtype: torch.dtype,
                 name: str):
        if config.mode not in GRAD_ACCUMULATION_MODES:
            raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATION_MODES}, got {config.mode!r}")
        self.layout, self.spec, self.config = layout, spec, config
        self.master_dtype, self.name = master_dtype, name
        self.buffer: torch.Tensor | None = None      # (padded_numel,) accumulation dtype; kept across no_sync
        self.pending: dict[int, torch.Tensor] = {}   # concat mode: index -> (numel,) accumulation dtype
        self.arrived: set[int] = set()               # parameters whose gradient arrived this backward
        self.expected = 0                            # how many this backward waits for (0: until one arrives)
        self.in_flight: ReduceScatter | None = None

    # --- arrival ----------------------------------------------------------------------------------
    def expect(self, leaves: list[torch.Tensor], on_ready: Callable[[], None]) -> None:
        """Hook every leaf (one per parameter, in layout order); in each backward, call
        ``on_ready()`` once all have their gradient. ``on_ready`` must hold its owner weakly: the
        leaves' hooks keep it alive as long as the leaves live."""
        for index, leaf in enumerate(leaves):
            leaf.register_post_accumulate_grad_hook(functools.partial(self._arrive, index, on_ready))

    def _arrive(self, index: int, on_ready: Callable[[], None], leaf: torch.Tensor) -> None:
        grad = leaf.grad.reshape(-1)
        leaf.grad = None
        if self.expected == 0:  # the backward's first gradient here (also through a kept graph)
            self.arrived, self.expected = set(), len(self.layout.infos)
        self._add(index, grad)
        if len(self.arrived) == self.expected:
            self.expected = 0  # ready once per backward
            on_ready()

    def _add(self, index: int, grad: torch.Tensor) -> None:
        info, dtype = self.layout.infos[index], self.config.accumulation_dtype
        self.arrived.add(index)
        if self.config.mode == "flat":
            if self.buffer is None:
                self.buffer = tag(torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.spec.device),
                                  "unsharded_grads")
            self.buffer[info.offset:info.offset + info.numel].add_(grad)
            return
        upcast = grad.to(dtype)
        self.pending[index] = tag(upcast.clone() if upcast is grad else upcast, "unsharded_grads")

    @property
    def partly_arrived(self) -> bool:
        """Some but not all gradients arrived this backward (the rest count as zero)."""
        return self.expected > 0 and bool(self.arrived)

    @property
    def holds_unreduced(self) -> bool:
        """A full gradient kept from earlier backwards (``no_sync``) waits for its reduce."""
        return self.buffer is not None or bool(self.pending)

    # --- without sync: keep the full gradient ----------------------------------------------------
    def keep_unreduced(self) -> None:
        """Concat mode: build the flat gradient from the per-parameter ones (zeros where a
        parameter got none) and add it to the buffer; flat mode: the buffer already holds it."""
        if self.config.mode != "concat" or not self.pending:
            return
        device, dtype = self.spec.device, self.config.accumulation_dtype
        pieces = [self.pending.pop(i, None) for i in range(len(self.layout.infos))]
        pieces = [p if p is not None else torch.zeros(info.numel, dtype=dtype, device=device)
                  for p, info in zip(pieces, self.layout.infos)]
        pad = self.layout.padded_numel - self.layout.numel
        if pad:
            pieces.append(torch.zeros(pad, dtype=dtype, device=device))
        flat = tag(torch.empty(self.layout.padded_numel, dtype=dtype, device=device), "comm_buffers")
        torch.cat(pieces, out=flat)
        del pieces
        if self.buffer is None:
            self.buffer = flat
        else:
            self.buffer.add_(flat)

    # --- the reduce-scatter ------------------------------------------------------------------------
    def start_reduce(self) -> None:
        """Issue the reduce-scatter of the flat gradient within the shard group (asynchronous)."""
        self.keep_unreduced()
        full, self.buffer = self.buffer, None
        if full is None:
            return
        if full.dtype != self.config.wire_dtype:  # a temporary buffer for the collective only
            full = tag(full.to(self.config.wire_dtype), "comm_buffers")
        if self.spec.group is not None:
            process_group.ensure_reducible(full.dtype, self.spec.group)
        if self.spec.size == 1:
            self.in_flight = ReduceScatter(output=full, work=None, input=full)
            return
        output = tag(torch.empty(self.layout.shard_numel, dtype=full.dtype, device=full.device), "sharded_grads")
        # the flat gradient dies after this reduce: let gloo reduce in place (no full-size receive buffer)
        work = collectives.reduce_scatter_tensor(output, full, group=self.spec.group, async_op=True,
                                                 meta={"module": self.name}, input_is_scratch=True,
                                                 before_issue=functools.partial(sync_points.fire, "reduce_scatter", self.name))
        self.in_flight = ReduceScatter(output=output, work=work, input=full)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter, all-reduce across replicas, average, and add the result
        into the original parameters' ``.grad`` (views of one flat sharded gradient)."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return
        if pending.work is not None:
            pending.work.wait()
            collectives.release(pending.input)  # reduced in place: only the shard in output is kept
        output = pending.output
        del pending
        if self.config.replicate_group is not None:
            collectives.all_reduce(output, group=self.config.replicate_group, meta={"module": self.name},
                                   before_issue=functools.partial(sync_points.fire, "reduce_scatter", self.name))
        output.div_(self.config.world_size)
        sharded = tag(output.to(self.spec.home, self.master_dtype), "sharded_grads")
        slices = self.layout.local_slices()
        for info, (a, b) in zip(self.layout.infos, slices):
            if info.param.grad is not None:  # accumulation across steps without zero_grad
                sharded[a:b].add_(info.param.grad.reshape(-1))
        for info, (a, b) in zip(self.layout.infos, slices):
            info.param.grad = sharded[a:b]

    # --- recovery ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop everything of an interrupted backward: wait for an issued reduce-scatter (every
        rank issued it, so it completes) and drop it, the full-size buffer and the per-parameter
        gradients. Reduced shards already in ``.grad`` stay."""
        if self.in_flight is not None and self.in_flight.work is not None:
            self.in_flight.work.wait()
        self.in_flight, self.buffer, self.pending = None, None, {}
        self.arrived, self.expected = set(), 0
