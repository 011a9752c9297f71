"""The parameter's life at rest and in transit: flatten -> pad -> shard, gather, free.

A ``FlatParamHandle`` owns the parameters of one FSDP unit that share a dtype and a
``requires_grad`` flag (a unit with mixed ones gets one handle per kind, see docs/fsdp1.md):

1. **flatten**: the parameters, in registration order, are laid end to end in one 1-D tensor;
2. **pad**: zeros are appended so the length divides the shard group size N;
3. **shard**: rank r keeps the contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded/N``
   (``flat_shard``, tagged "sharded_params"). Each original ``nn.Parameter`` object stays
   registered on its module, but its ``.data`` becomes a 1-D view of the part of
   ``flat_shard`` it owns: full, partial, or empty (shape ``(0,)``). The optimizer steps
   these views, which writes straight into the shard.
4. **unshard**: an all-gather fills ``full`` (padded length, compute dtype, tagged
   "unsharded_params"); forward uses full-shape views of it (``use_unsharded_views``);
5. **reshard**: ``full``'s storage is resized to zero bytes. Autograd still holds views of
   it; the next all-gather into the same storage brings their data back for backward.

The gradient's path (leaf hooks, flat buffer, reduce-scatter) is in ``flat_grad.py``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from fsdp_lab import collectives, sync_points
from fsdp_lab.memory.tags import tag


@dataclasses.dataclass
class ParamInfo:
    """One original parameter inside a flat parameter."""

    fqn: str                               # name relative to the FSDP unit's module
    shape: torch.Size
    numel: int
    offset: int                            # first element in the (unpadded) flat tensor
    param: nn.Parameter                    # the original object: the optimizer holds it
    uses: list[tuple[nn.Module, str]]      # every (module, attribute) holding it (tied weights)


def padded_numel(total: int, world_size: int) -> int:
    """``total`` rounded up to a multiple of ``world_size`` (the flat length after padding)."""
    return math.ceil(total / world_size) * world_size


def shard_boundaries(numels: list[int], world_size: int, rank: int) -> list[tuple[int, int]]:
    """Which elements of each original parameter ``rank`` owns.

    ``numels``: element counts of the parameters in flattening order. Returns one
    ``(start, end)`` per parameter, in that parameter's own flattened index space; ``start ==
    end`` means the rank owns none of it. Raises ValueError for a rank outside the group.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    shard = padded_numel(sum(numels), world_size) // world_size
    lo, hi = rank * shard, (rank + 1) * shard
    bounds, offset = [], 0
    for n in numels:
        start = min(max(lo - offset, 0), n)
        end = min(max(hi - offset, 0), n)
        bounds.append((start, max(start, end)))
        offset += n
    return bounds


class FlatParamHandle:
    """The flat parameter of one (unit, dtype, requires_grad) group and its views.

    ``shard_group``: the process group the flat tensor is split over (None with
    ``shard_size == 1``: nothing to split, as in NO_SHARD). ``compute_dtype``: dtype of the
    gathered parameters (MixedPrecision.param_dtype or the parameters' own).
    ``offload``: keep the shard in host memory and copy it to ``device`` before gathering.
    """

    def __init__(self, infos: list[ParamInfo], *, unit_name: str, shard_group, shard_rank: int,
                 shard_size: int, device: torch.device, compute_dtype: torch.dtype, offload: bool):
        self.infos = infos
        self.unit_name = unit_name
        self.shard_group, self.shard_rank, self.shard_size = shard_group, shard_rank, shard_size
        self.device, self.compute_dtype, self.offload = device, compute_dtype, offload
        self.dtype = infos[0].param.dtype
        self.requires_grad = infos[0].param.requires_grad
        self.numel = sum(i.numel for i in infos)
        self.padded_numel = padded_numel(self.numel, shard_size)
        self.shard_numel = self.padded_numel // shard_size
        self.bounds = shard_boundaries([i.numel for i in infos], shard_size, shard_rank)
        self._flatten_and_shard()
        self._alias = shard_size == 1 and compute_dtype == self.dtype and not offload
        if self._alias:  # nothing to gather: forward reads the shard itself
            self.full = self.flat_shard
        else:
            self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
            tag(self.full, "unsharded_params")
            self.full.untyped_storage().resize_(0)
        self.state = "unsharded" if self._alias else "sharded"
        self._gather = None          # CollectiveHandle of an all-gather in flight
        self._gather_input = None    # kept alive until the all-gather finishes
        self.leaves: list[torch.Tensor] = []
        self.grad_state = None       # set by flat_grad.py during backward

    # --- 1-3: flatten, pad, shard -------------------------------------------------------------
    @torch.no_grad()
    def _flatten_and_shard(self) -> None:
        home = torch.device("cpu") if self.offload else self.device
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=home)
        for info in self.infos:
            flat[info.offset:info.offset + info.numel].copy_(info.param.detach().reshape(-1))
        lo = self.shard_rank * self.shard_numel
        self.flat_shard = flat[lo:lo + self.shard_numel].clone()
        tag(self.flat_shard, "sharded_params")
        del flat
        self.use_sharded_views()

    def local_slices(self) -> list[tuple[int, int]]:
        """For each parameter, its owned range as (start, end) offsets into ``flat_shard``."""
        lo = self.shard_rank * self.shard_numel
        return [(i.offset + s - lo, i.offset + e - lo) for i, (s, e) in zip(self.infos, self.bounds)]

    def use_sharded_views(self) -> None:
        """Point every original Parameter at its (possibly empty) slice of the shard and put
        the Parameter objects back on their modules."""
        for info, (a, b) in zip(self.infos, self.local_slices()):
            info.param.data = self.flat_shard[a:b]
            for module, name in info.uses:
                module._parameters[name] = info.param

    # --- 4: unshard ------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Start the all-gather into ``full`` (asynchronous; ``wait_unshard`` finishes it)."""
        if self.state != "sharded":
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        source = self.flat_shard
        if source.device != self.device or source.dtype != self.compute_dtype:
            source = source.to(self.device, self.compute_dtype, non_blocking=self.offload)
            tag(source, "comm_buffers")
        self._gather_input = source
        self.state = "gathering"
        # Refilling the storage autograd saved views of is the point of resharding: the bytes
        # are the same parameters, so autograd's in-place check must not fire. gloo copies
        # each rank's chunk in on completion (a version bump per chunk), so the version is
        # put back after wait_unshard, not here.
        self._version = self.full._version
        if self.shard_size == 1:
            self.full.copy_(source)
            return
        sync_points.fire("all_gather", self.unit_name)  # after the allocations: nothing fails between
        self._gather = collectives.all_gather_into_tensor(
            self.full, source, group=self.shard_group, async_op=True, meta={"module": self.unit_name})

    def wait_unshard(self) -> None:
        """Block until ``full`` holds every rank's shard (no-op when not gathering)."""
        if self.state == "sharded":
            self.unshard()
        if self.state != "gathering":
            return
        if self._gather is not None:
            self._gather.wait()
        torch._C._autograd._unsafe_set_version_counter((self.full,), (self._version,))
        self._gather, self._gather_input = None, None
        self.state = "unsharded"

    def use_unsharded_views(self, track_grads: bool) -> None:
        """Give every module a full-shape view of ``full`` in place of the Parameter.

        With ``track_grads`` each view is a fresh autograd leaf (sharing ``full``'s storage)
        whose gradient ``flat_grad.py`` collects; otherwise a plain view.
        """
        self.leaves = []
        for info in self.infos:
            view = self.full[info.offset:info.offset + info.numel].view(info.shape)
            if track_grads:
                view = view.detach().requires_grad_(True)
            self.leaves.append(view)
            for module, name in info.uses:
                module._parameters[name] = view

    def restore_leaf_views(self) -> None:
        """Put the views made in forward back on the modules (backward may re-run the
        forward of checkpointed modules, which must see full-shape parameters)."""
        for info, leaf in zip(self.infos, self.leaves):
            for module, name in info.uses:
                module._parameters[name] = leaf

    # --- 5: reshard ------------------------------------------------------------------------------
    def reshard(self) -> None:
        """Free ``full``'s bytes (no-op for an aliased NO_SHARD handle or when already sharded)."""
        if self._alias or self.state == "sharded":
            return
        if self.state == "gathering":
            self.wait_unshard()
        self.full.untyped_storage().resize_(0)
        self.state = "sharded"

    def unsharded_bytes(self) -> int:
        """Bytes held right now by the gathered flat parameter (0 when resharded)."""
        return 0 if self._alias else self.full.untyped_storage().nbytes()

    # --- full-precision gather for summon_full_params / state dicts ---------------------------
    @torch.no_grad()
    def gather_full_precision(self) -> torch.Tensor:
        """A new padded flat tensor in the parameters' own dtype with every rank's shard."""
        out = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        source = self.flat_shard.to(self.device)
        if self.shard_size == 1:
            out.copy_(source)
        else:
            collectives.all_gather_into_tensor(out, source, group=self.shard_group,
                                               meta={"module": self.unit_name})
        return out
