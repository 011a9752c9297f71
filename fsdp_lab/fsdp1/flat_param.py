"""The parameter's life at rest and in transit: flatten -> pad -> shard, gather, free.

A ``FlatParamHandle`` owns the parameters of one FSDP unit that share a dtype and a
``requires_grad`` flag (a unit with mixed ones gets one handle per kind, see docs/fsdp1.md):

1. **flatten**: the parameters, in registration order, are laid end to end in one 1-D tensor;
2. **pad**: zeros are appended so the length divides the shard group size N;
3. **shard**: rank r keeps the contiguous slice ``[r*S, (r+1)*S)`` with ``S = padded/N``
   (``flat_shard``, tagged "sharded_params"; the arithmetic is ``layout.py``). Each original
   ``nn.Parameter`` object stays registered on its module, but its ``.data`` becomes a 1-D
   view of the part of ``flat_shard`` it owns: full, partial, or empty (shape ``(0,)``).
   The optimizer steps these views, which writes straight into the shard.
4. **unshard**: an all-gather fills ``full`` (padded length, compute dtype, tagged
   "unsharded_params"); forward uses full-shape views of it (``use_unsharded_views``);
5. **reshard**: ``full``'s storage is resized to zero bytes. Autograd still holds views of
   it; the next all-gather into the same storage brings their data back for backward.

The gradient's path (leaf hooks, flat buffer, reduce-scatter) is the handle's ``flat_grad``
(``flat_grad.py``). The handle implements ``handle.FlatHandle``, the protocol every FSDP1
flat parameter (and any extension, e.g. NF4 weights) follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Iterator

import torch

from fsdp_lab import collectives, sync_points
from fsdp_lab.fsdp1.flat_grad import FlatGrad, GradConfig
from fsdp_lab.fsdp1.layout import FlatLayout, ParamInfo, ShardedParam, ShardingSpec
from fsdp_lab.memory.tags import tag
from fsdp_lab.states import ShardedState
from fsdp_lab.torch_versions import set_version

__all__ = ["FlatParamHandle"]


@dataclasses.dataclass
class _AllGather:
    """An all-gather in flight into ``full``."""

    work: collectives.CollectiveHandle | None  # None: nothing issued (a group of 1, or stopped before)
    input: torch.Tensor                        # (shard_numel,) compute dtype: kept alive until finished
    version: int                               # ``full``'s autograd version before the gather


class FlatParamHandle:
    """The flat parameter of one (unit, dtype, requires_grad) group and its views.

    ``infos``: the parameters, in flattening order. ``spec``: shard group and devices.
    ``compute_dtype``: dtype of the gathered parameters (the policy's ``param_dtype`` or the
    parameters' own). ``grad_config``: how its gradient is reduced; required when the
    parameters require grad. Raises ValueError for trainable parameters without one.
    """

    def __init__(self, infos: list[ParamInfo], spec: ShardingSpec, *, compute_dtype: torch.dtype,
                 unit_name: str, grad_config: GradConfig | None = None):
        self.layout = FlatLayout(infos, spec.rank, spec.size)
        self.spec = spec
        self.dtype = infos[0].param.dtype            # the shard's (master) dtype
        self.compute_dtype = compute_dtype
        self.requires_grad = infos[0].param.requires_grad
        if self.requires_grad and grad_config is None:
            raise ValueError(f"{infos[0].fqn}: a trainable flat parameter needs a GradConfig")
        self.flat_shard = self._flatten_and_shard()  # (shard_numel,) master dtype, on spec.home
        self._alias = spec.size == 1 and compute_dtype == self.dtype and not spec.offload
        self.state = ShardedState.UNSHARDED if self._alias else ShardedState.SHARDED
        self._all_gather: _AllGather | None = None
        self.leaves: list[torch.Tensor] = []          # full-shape views on the modules; autograd leaves
        self._leaves_tracked = False                  # ... made by a tracked forward, kept until reset()
        self.flat_grad = FlatGrad(self.layout, spec, grad_config, self.dtype, unit_name) \
            if self.requires_grad else None
        self._unit_name = unit_name
        self.use_sharded_views()  # the whole parameters die here (unless the caller holds them) ...
        if self._alias:  # nothing to gather: forward reads the shard itself
            self.full = self.flat_shard
        else:  # ... before the gather buffer is made (and emptied), so a rank never holds both
            self.full = torch.empty(self.layout.padded_numel, dtype=compute_dtype, device=spec.device)
            tag(self.full, "unsharded_params")       # (padded_numel,) compute dtype
            self.full.untyped_storage().resize_(0)

    # --- names and sizes -----------------------------------------------------------------------------
    @property
    def unit_name(self) -> str:
        return self._unit_name

    @unit_name.setter
    def unit_name(self, name: str) -> None:
        self._unit_name = name
        if self.flat_grad is not None:
            self.flat_grad.name = name

    @property
    def infos(self) -> list[ParamInfo]:
        return self.layout.infos

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """For each parameter, the range of it this rank owns (in its own flattened indices)."""
        return self.layout.bounds

    def local_slices(self) -> list[tuple[int, int]]:
        """For each parameter, its owned range as (start, end) offsets into ``flat_shard``."""
        return self.layout.local_slices()

    # --- 1-3: flatten, pad, shard -------------------------------------------------------------
    @torch.no_grad()
    def _flatten_and_shard(self) -> torch.Tensor:
        # only this rank's slice is ever allocated: no padded whole flat copy of the unit
        lo, n = self.layout.shard_start, self.layout.shard_numel
        shard = torch.zeros(n, dtype=self.dtype, device=self.spec.home)
        for info in self.infos:
            a, b = max(info.offset, lo), min(info.offset + info.numel, lo + n)
            if a < b:
                shard[a - lo:b - lo].copy_(info.param.detach().reshape(-1)[a - info.offset:b - info.offset])
        return tag(shard, "sharded_params")

    def use_sharded_views(self) -> None:
        """Point every original Parameter at its (possibly empty) slice of the shard and put
        the Parameter objects back on their modules."""
        for info, (a, b) in zip(self.infos, self.local_slices()):
            info.param.data = self.flat_shard[a:b]
            for module, name in info.uses:
                module._parameters[name] = info.param

    # --- 4: unshard ------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Start the all-gather into ``full`` (asynchronous; ``wait_for_unshard`` finishes it)."""
        if self.state != ShardedState.SHARDED:
            return
        self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        source = self.flat_shard
        if source.device != self.spec.device or source.dtype != self.compute_dtype:
            source = source.to(self.spec.device, self.compute_dtype, non_blocking=self.spec.offload)
            tag(source, "comm_buffers")
        self.state = ShardedState.GATHERING
        # Refilling the storage autograd saved views of is the point of resharding: the bytes
        # are the same parameters, so autograd's in-place check must not fire. gloo copies
        # each rank's chunk in on completion (a version bump per chunk), so the version is
        # put back after wait_for_unshard, not here.
        self._all_gather = _AllGather(work=None, input=source, version=self.full._version)
        if self.spec.size == 1:
            self.full.copy_(source)
            return
        # the sync point fires after every allocation, the collective's own included (if it
        # raises, the handle is GATHERING with nothing issued: reset frees it)
        self._all_gather.work = collectives.all_gather_into_tensor(
            self.full, source, group=self.spec.group, async_op=True, meta={"module": self.unit_name},
            before_issue=partial(sync_points.fire, "all_gather", self.unit_name))

    def wait_for_unshard(self) -> None:
        """Block until ``full`` holds every rank's shard (issuing the all-gather if needed)."""
        if self.state == ShardedState.SHARDED:
            self.unshard()
        if self.state != ShardedState.GATHERING:
            return
        pending, self._all_gather = self._all_gather, None
        if pending.work is not None:
            pending.work.wait()
            if pending.input is not self.flat_shard:  # a cast or device copy made for the wire
                collectives.release(pending.input)
        set_version(self.full, pending.version)
        self.state = ShardedState.UNSHARDED

    def use_unsharded_views(self, track_grads: bool) -> bool:
        """Give every module a full-shape view of ``full`` in place of the Parameter.

        With ``track_grads`` each view is an autograd leaf (sharing ``full``'s storage) whose
        gradient ``flat_grad`` collects. The leaves are made at the first such forward and kept
        (views of ``full``, whose storage is freed and refilled in place; dropped by ``reset``
        only): a unit that runs forward twice before one backward (two losses summed) then gets
        one gradient per leaf, the sum of both, as autograd gives PyTorch's flat parameter, and a
        backward through a graph kept from before (``retain_graph``, a second loss of the same
        forward) finds its leaves, hooks and, under checkpointing, its views again. Otherwise
        plain views (kept as ``leaves`` too, for ``restore_unsharded_views``, unless tracked
        leaves exist). Returns True when it made new leaves (``flat_grad`` must expect them).
        """
        made = track_grads and not self._leaves_tracked
        if made:
            self.leaves = [self.layout.full_view(self.full, index).detach().requires_grad_(True)
                           for index in range(len(self.infos))]
            self._leaves_tracked = True
        if track_grads:
            views = self.leaves
        else:
            views = [self.layout.full_view(self.full, index) for index in range(len(self.infos))]
            if not self._leaves_tracked:
                self.leaves = views
        for info, view in zip(self.infos, views):
            for module, name in info.uses:
                module._parameters[name] = view
        return made

    def restore_unsharded_views(self) -> None:
        """Put the views made in forward back on the modules (backward may re-run the
        forward of checkpointed modules, which must see full-shape parameters)."""
        for info, leaf in zip(self.infos, self.leaves):
            for module, name in info.uses:
                module._parameters[name] = leaf

    # --- 5: reshard ------------------------------------------------------------------------------
    def reshard(self) -> bool:
        """Free ``full``'s bytes; True if there were any to free (False for an aliased
        NO_SHARD handle or one already sharded). Waits for an issued all-gather first."""
        if self._alias or self.state == ShardedState.SHARDED:
            return False
        if self.state == ShardedState.GATHERING:
            self.wait_for_unshard()
        self.full.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED
        return True

    def unsharded_bytes(self) -> int:
        """Bytes held right now by the gathered flat parameter (0 when resharded)."""
        return 0 if self._alias else self.full.untyped_storage().nbytes()

    def to_idle(self) -> None:
        """Between steps: gathered bytes freed, the Parameters on the modules (the leaves kept)."""
        self.reshard()
        self.use_sharded_views()

    def reset(self) -> None:
        """Back to idle after an interrupted step: finish an issued all-gather, free, and drop
        the gradient being built or reduced (``FlatGrad.reset``) and the leaves, which may hold
        a gradient the broken backward did not collect."""
        self.to_idle()
        self.leaves, self._leaves_tracked = [], False
        if self.flat_grad is not None:
            self.flat_grad.reset()

    # --- whole parameters: summon_full_params and state dicts -------------------------------------
    @torch.no_grad()
    def _gather(self, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new padded flat tensor in ``dtype`` holding every rank's ``local`` shard."""
        out = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.spec.device)
        source = local.to(self.spec.device, dtype)
        if self.spec.size == 1:
            out.copy_(source)
        else:
            collectives.all_gather_into_tensor(out, source, group=self.spec.group, meta={"module": self.unit_name})
        return out

    def gather_param_shaped(self, parts: dict[int, torch.Tensor], dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Whole tensors of the parameters' shapes from parts laid out like the parameters on
        each rank (``parts[i]`` has parameter i's local shape, e.g. its optimizer state): one
        all-gather over the shard group; every rank must pass the same indices and dtype.
        Returns full-shape views of one new gathered tensor, by index."""
        flat = torch.zeros(self.layout.shard_numel, dtype=dtype, device=self.spec.device)
        slices = self.local_slices()
        for index, part in parts.items():
            a, b = slices[index]
            flat[a:b].copy_(part.reshape(-1))
        full = self._gather(flat, dtype)
        return {index: self.layout.full_view(full, index) for index in parts}

    def local_part(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor shaped like parameter ``index`` (1-D, as the parameter's
        ``.data``). Raises ValueError for a wrong shape."""
        if tuple(whole.shape) != tuple(self.infos[index].shape):
            raise ValueError(f"shape {tuple(whole.shape)} is not the parameter's {tuple(self.infos[index].shape)}")
        start, end = self.layout.bounds[index]
        return whole.reshape(-1)[start:end]

    def _local_grad(self) -> tuple[torch.Tensor, bool]:
        """This rank's flat sharded gradient (zeros where a parameter has none) and whether
        any rank of the shard group has a gradient at all."""
        grad = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.spec.device)
        present = 0
        for info, (a, b) in zip(self.infos, self.local_slices()):
            if info.param.grad is not None:
                grad[a:b].copy_(info.param.grad.reshape(-1))
                present = 1
        flag = torch.tensor([present], dtype=torch.int32, device=self.spec.device)
        if self.spec.size > 1:
            collectives.all_reduce(flag, op="max", group=self.spec.group, meta={"module": self.unit_name})
        return grad, bool(flag.item())

    @contextlib.contextmanager
    def full_params(self, *, writeback: bool, offload_to_cpu: bool, with_grads: bool,
                    materialize: bool) -> Iterator[None]:
        """Inside the block every parameter of this handle has its full shape in the master
        dtype (one all-gather; every rank takes part). ``materialize=False`` (``rank0_only`` on
        another rank) frees the gathered tensor at once and leaves the parameters sharded.
        ``offload_to_cpu`` keeps the full parameters in host memory; ``with_grads`` gathers
        the sharded gradients too (``.grad`` gets the full shape; None where no rank has one).
        On exit, with ``writeback``, this rank's part of each (possibly modified) full tensor
        goes back into the shard (and, with ``with_grads``, into the sharded gradient)."""
        full = self._gather(self.flat_shard, self.dtype)
        grad, has_grad = (self._local_grad() if with_grads else (None, False))
        full_grad = self._gather(grad, self.dtype) if has_grad else None
        del grad
        if not materialize:
            del full, full_grad
            yield
            return
        if offload_to_cpu:
            full = full.cpu()
        saved_grads = [info.param.grad for info in self.infos]
        try:
            for index, info in enumerate(self.infos):
                info.param.grad = None  # .grad must match the new shape: set after .data
                info.param.data = self.layout.full_view(full, index)
                if with_grads:
                    info.param.grad = self.layout.full_view(full_grad, index) if full_grad is not None else None
            yield
        finally:
            lo, hi = self.layout.shard_start, self.layout.shard_start + self.layout.shard_numel
            with torch.no_grad():
                if writeback:
                    self.flat_shard.copy_(full[lo:hi])
                if writeback and with_grads and full_grad is not None:
                    for saved, (a, b) in zip(saved_grads, self.local_slices()):
                        if saved is not None:
                            saved.copy_(full_grad[lo + a:lo + b])
            for info in self.infos:
                info.param.grad = None
            self.use_sharded_views()
            for info, saved in zip(self.infos, saved_grads):
                info.param.grad = saved

    def sharded_entry(self, index: int) -> ShardedParam:
        """Parameter ``index``'s part on this rank, for a sharded state dict (a CPU copy)."""
        (start, end), (a, b) = self.layout.bounds[index], self.local_slices()[index]
        local = self.flat_shard[a:b].detach().cpu().clone()
        return ShardedParam(local, start, end, tuple(self.infos[index].shape))

    @torch.no_grad()
    def load_sharded_entry(self, index: int, value, name: str) -> None:
        """Copy a ``ShardedParam`` saved by ``sharded_entry`` into parameter ``index``'s part of the
        shard. Raises ValueError when it is not this rank's part (another world size or wrapping)."""
        info, (start, end) = self.infos[index], self.layout.bounds[index]
        if not isinstance(value, ShardedParam) or (value.start, value.end, tuple(value.shape)) != \
                (start, end, tuple(info.shape)):
            got = (value.start, value.end) if isinstance(value, ShardedParam) else type(value).__name__
            raise ValueError(f"{name}: saved slice {got} is not this rank's slice {(start, end)}; "
                             f"load a sharded state dict on the same world size and wrapping, or use a full one "
                             f"(torch.distributed.checkpoint keeps one rank's copy of each ShardedParam: for "
                             f"it save fsdp_lab.fsdp1.dcp_state_dict(model))")
        self._copy_local(index, value.local)

    @torch.no_grad()
    def load_full_entry(self, index: int, value: torch.Tensor, name: str) -> None:
        """Copy this rank's part of the full tensor ``value`` into parameter ``index``'s part of the
        shard. Raises ValueError for a wrong shape."""
        info, (start, end) = self.infos[index], self.layout.bounds[index]
        if tuple(value.shape) != tuple(info.shape):
            raise ValueError(f"{name}: state dict has shape {tuple(value.shape)}, model has {tuple(info.shape)}")
        self._copy_local(index, value.reshape(-1)[start:end])

    def _copy_local(self, index: int, local: torch.Tensor) -> None:
        a, b = self.local_slices()[index]
        self.flat_shard[a:b].copy_(local.to(self.flat_shard.device, self.dtype))
