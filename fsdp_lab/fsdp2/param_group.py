"""A group's collectives: one all-gather to unshard, one reduce-scatter for its gradients.

Every ``fully_shard`` call makes one ``FSDPParamGroup`` of the parameters it manages. The
group batches its parameters' per-parameter steps (see ``param.py``) into one collective
each way:

* **unshard** = copy-in (every parameter's shard, cast to the compute dtype, into this rank's
  rows of the flat output buffer) -> one ``all_gather_into_tensor`` (async) -> copy-out
  (``split_with_sizes_copy`` from the rank-major output into each parameter's
  ``all_gather_outputs``). When the inputs
  do not share one dtype (e.g. NF4 bytes beside float scales) the buffer is ``uint8`` and
  each input travels as its raw bytes.
* **reshard** = point modules back at the sharded DTensors and free the unsharded storage.
* **reduce** = copy-in of the padded gradients in the wire dtype -> one
  ``reduce_scatter_tensor`` (average, async) -> each parameter's rows become its sharded grad.
  With a 2-D mesh (HSDP) both collectives run within the shard group (the mesh's last dim)
  and the reduced shard is then averaged over the replicas (an all-reduce on the first dim).

State is a ``states.ShardedState`` (SHARDED -> GATHERING -> UNSHARDED -> SHARDED) plus the
all-gather in flight (one ``_AllGather``), which lets ``unshard(async_op=True)`` serve
prefetching: issue now, ``wait_for_unshard()`` when needed. ``reset()`` brings the group back
to SHARDED after an interrupted step.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn as nn

from fsdp_lab import collectives, process_group, sync_points
from fsdp_lab.fsdp2.param import FSDPParam
from fsdp_lab.memory.tags import tag
from fsdp_lab.states import ShardedState, assert_in_states
from fsdp_lab.torch_versions import versions_kept

__all__ = ["FSDPParamGroup", "set_synchronous"]

# True: every collective is waited for right after it is issued (no overlap with compute);
# a baseline for measuring what overlap buys. See ``set_synchronous``.
_SYNCHRONOUS = False


def set_synchronous(synchronous: bool) -> bool:
    """Wait for every all-gather and reduce-scatter as soon as it is issued (True) or let them
    run under compute (False, the default). Prefetches still happen, only eagerly finished.
    Returns the previous setting."""
    global _SYNCHRONOUS
    previous, _SYNCHRONOUS = _SYNCHRONOUS, bool(synchronous)
    return previous


class _AllGather:
    """An all-gather in flight: its handle, output buffer and what to copy out where."""

    def __init__(self, handle, output, buffer_dtype, inputs, dtypes, owners, split_numels):
        self.handle = handle
        self.output = output              # (world * sum(split_numels),) buffer_dtype, rank-major; this rank's
                                          # rows were the collective's input (the copied-in shards)
        self.buffer_dtype = buffer_dtype  # the wire dtype, or uint8 when the inputs' dtypes differ
        self.inputs, self.dtypes = inputs, dtypes  # every all-gather input and its wire dtype
        self.owners = owners              # how many of the inputs each FSDPParam gave, in order
        self.split_numels = split_numels  # elements (of buffer_dtype) per input and rank


class _ReduceScatter:
    """A reduce-scatter in flight; ``wait()`` hands each parameter its reduced rows."""

    def __init__(self, handle, input, output, output_is_temporary, params, split_numels,
                 replicate_group=None, name="", divide_by: float | None = None,
                 partials: list | None = None):
        self.handle, self.input, self.output, self.params = handle, input, output, params
        self.output_is_temporary, self.split_numels = output_is_temporary, split_numels
        self.replicate_group, self.name = replicate_group, name
        self.divide_by = divide_by  # None: the collectives averaged; else they summed, divide here
        # HSDP: a list (each parameter's rows kept from earlier microbatches, or None, taken at
        # issue) means all-reduce now; None means keep the reduced rows for a later all-reduce
        self.partials = partials

    def wait(self) -> None:
        self.handle.wait()
        collectives.release(self.input)
        shards = torch.split(self.output, self.split_numels)
        if self.replicate_group is not None and self.partials is None:
            # accumulating across microbatches: no all-reduce, no division and no .grad yet
            tag(self.output, "sharded_grads")
            for fsdp_param, shard in zip(self.params, shards):
                fsdp_param.keep_partial_reduced_grad(shard)
            return
        if self.replicate_group is not None:  # HSDP: average (or sum) the shard over the replicas
            for partial, shard in zip(self.partials, shards):
                if partial is not None:  # the earlier microbatches' rows, reduced within the shard group
                    shard.add_(partial)
            self.partials = partial = None  # the last views of the earlier outputs: their bytes go now
            collectives.all_reduce(self.output, op="avg" if self.divide_by is None else "sum",
                                   group=self.replicate_group, meta={"module": self.name},
                                   before_issue=functools.partial(sync_points.fire, "reduce_scatter", self.name))
        if self.divide_by is not None and self.divide_by != 1:
            self.output.div_(self.divide_by)
        for fsdp_param, shard in zip(self.params, shards):
            fsdp_param.accumulate_sharded_grad(shard)
        if self.output_is_temporary and not any(_holds(p, self.output) for p in self.params):
            collectives.release(self.output)  # its rows were added into the sharded grads


def _holds(fsdp_param: FSDPParam, buffer: torch.Tensor) -> bool:
    """Whether the parameter's sharded grad is a view of ``buffer`` (no cast was needed)."""
    grad = fsdp_param.sharded_param.grad
    return grad is not None and grad._local_tensor.untyped_storage()._cdata == buffer.untyped_storage()._cdata


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call and their collectives on ``mesh``.

    ``name`` labels timeline events (``meta={"module": name}``).
    """

    def __init__(self, fsdp_params: list[FSDPParam], modules: list[nn.Module], mesh, device: torch.device,
                 reshard_after_forward: bool, name: str = ""):
        self.fsdp_params = fsdp_params
        # HSDP: gather and reduce-scatter within the shard group (the mesh's last dim), then
        # all-reduce the reduced shard across the replicas (its first dim)
        self.mesh, self.group, self.device = mesh, mesh.get_group(mesh.ndim - 1), device
        self.world_size = mesh.size(mesh.ndim - 1)
        self.rank = mesh.get_local_rank(mesh.ndim - 1)  # within the shard group
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: False reduce-scatters but leaves the replicas apart
        self.unshard_in_backward = True  # False: backward needs none of the values (an embedding's weight)
        # PyTorch's FSDPModule knobs: gradients = the ranks' sum / this (None: the mean), and
        # whether the collectives must sum (dividing apart) even when they could average
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.name = name
        # frozen when sharded, in a narrower master dtype than training would give: said once if trained
        self._frozen_narrower = [p for p in fsdp_params if p.trained_master_dtype is not None]
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: _AllGather | None = None  # in flight while GATHERING

    def check_trainable_dtypes(self, paths: dict[int, str]) -> None:
        """Raise ValueError when the group's trainable parameters do not share one dtype
        (``paths``: module id -> its name in the root, to name the parameters).

        Their gradients are reduce-scattered in one buffer of one wire dtype, so a float64
        gradient beside float32 ones would travel (and be averaged) in float32. PyTorch's
        ``fully_shard`` refuses the same groups at its lazy init ("FSDP expects uniform original
        parameter dtype"); frozen parameters of other dtypes are fine (they have no gradient).
        """
        trainable = [p for p in self.fsdp_params if p.sharded_param.requires_grad]
        if len({p.orig_dtype for p in trainable}) <= 1 and len({p.dtypes.wire for p in trainable}) <= 1:
            return
        names = ", ".join(f"{_param_name(p, paths)} {str(p.orig_dtype).removeprefix('torch.')}" for p in trainable)
        where = "the root module" if self.name in ("", "root") else self.name
        raise ValueError(
            f"fully_shard on {where} groups trainable parameters of different dtypes ({names}); "
            "their gradients are reduce-scattered in one buffer of one dtype. Cast them to one dtype "
            "(model.to(dtype)), freeze those of the other dtype, or call fully_shard on the modules of "
            "each dtype separately")

    # -- unshard ---------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather every parameter of the group (no-op if gathered or being gathered).

        With ``async_op`` the collective is only issued; ``wait_for_unshard()`` finishes it.
        """
        if self.sharded_state != ShardedState.SHARDED:
            return
        inputs, dtypes, owners = [], [], []
        for fsdp_param in self.fsdp_params:
            param_inputs, param_dtypes = fsdp_param.all_gather_inputs()
            inputs += param_inputs
            dtypes += param_dtypes
            owners.append(len(param_inputs))
        uniform = len(set(dtypes)) == 1
        buffer_dtype = dtypes[0] if uniform else torch.uint8
        if uniform:  # _foreach_copy_ casts to param_dtype on the way in
            sources = [t.reshape(-1) for t in inputs]
        else:  # every input as raw bytes
            sources = [t.to(d).reshape(-1).view(torch.uint8) for t, d in zip(inputs, dtypes)]
        split_numels = [s.numel() for s in sources]
        shard_numel = sum(split_numels)
        output = tag(torch.empty(shard_numel * self.world_size, dtype=buffer_dtype, device=self.device),
                     "comm_buffers")
        # As PyTorch's FSDP2: the input is this rank's own rows of the output (the all-gather
        # leaves them as they are), so a gather in flight holds one buffer, not two.
        flat_input = output.narrow(0, shard_numel * self.rank, shard_numel)
        torch._foreach_copy_(list(torch.split(flat_input, split_numels)), sources)
        # the sync point fires after every allocation, the collective's own included
        handle = collectives.all_gather_into_tensor(output, flat_input, group=self.group, async_op=True,
                                                    meta={"module": self.name},
                                                    before_issue=functools.partial(sync_points.fire, "all_gather", self.name))
        self._all_gather = _AllGather(handle, output, buffer_dtype, inputs, dtypes, owners, split_numels)
        self.sharded_state = ShardedState.GATHERING
        if not async_op or _SYNCHRONOUS:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an issued all-gather: copy-out, build unsharded params, point modules at them."""
        pending, self._all_gather = self._all_gather, None
        if pending is None:
            return
        assert_in_states(self.sharded_state, ShardedState.GATHERING, where=f"{self.name} wait_for_unshard")
        pending.handle.wait()
        destinations, index = [], 0
        for fsdp_param, count in zip(self.fsdp_params, pending.owners):
            outs = fsdp_param.alloc_all_gather_outputs(pending.inputs[index:index + count],
                                                       pending.dtypes[index:index + count])
            destinations += [o.view(pending.buffer_dtype).view(self.world_size, -1) for o in outs]
            index += count
        # Refilling storage that autograd may have saved in forward is not a mutation of the
        # values it saw, so the version counters stay as they were.
        with versions_kept(destinations):
            torch.split_with_sizes_copy(pending.output.view(self.world_size, -1), pending.split_numels, dim=1,
                                        out=destinations)
        collectives.release(pending.output)  # the input is a view of it
        index = 0
        for fsdp_param, count in zip(self.fsdp_params, pending.owners):
            fsdp_param.init_unsharded_param([t.shape for t in pending.inputs[index:index + count]])
            fsdp_param.to_unsharded()
            index += count
        self.sharded_state = ShardedState.UNSHARDED
        if self._frozen_narrower:  # empty unless fully_shard saw frozen parameters of a narrower shard
            self._warn_trained_in_frozen_dtype()

    def _warn_trained_in_frozen_dtype(self) -> None:
        """Once per parameter: it was frozen at ``fully_shard`` (so its shard kept the frozen
        rule's dtype) and trains now, in that dtype rather than ``main_params_dtype``'s."""
        late = [p for p in self._frozen_narrower if p.requires_grad]
        if not late:
            return
        self._frozen_narrower = [p for p in self._frozen_narrower if not p.requires_grad]
        kept, wanted, where = late[0].dtypes.master, late[0].trained_master_dtype, self.name or "the root module"
        warnings.warn(
            f"{len(late)} parameters of the fully_shard group {where} were frozen when sharded, so their shards "
            f"kept {kept}; trained now, they update in {kept}, not in main_params_dtype's {wanted}. Unfreeze "
            "them before fully_shard to train them in it", stacklevel=2)

    def reshard(self) -> None:
        """Point modules back at the sharded parameters and free the unsharded storage."""
        if self._all_gather is not None:
            self.wait_for_unshard()  # never leave a collective behind
        if self.sharded_state != ShardedState.UNSHARDED:
            return
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
            fsdp_param.free_unsharded_param()
        self.sharded_state = ShardedState.SHARDED

    def reset(self) -> None:
        """After an interrupted step: finish an issued all-gather (every rank issued it), free the
        unsharded parameters and drop their unreduced gradients; the group is SHARDED again."""
        self.wait_for_unshard()
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset()
        self.sharded_state = ShardedState.SHARDED

    # -- gradients -------------------------------------------------------------------------
    def reduce_grads(self, before: Callable[[], None] | None = None) -> _ReduceScatter | None:
        """Issue the reduce-scatter of every gradient the group holds; None if it holds none.

        Without gradient sync the gradients are set aside unsharded instead (no collective).
        Frozen parameters never have gradients, so they never take part. ``before()`` runs only
        when a reduce-scatter is issued, before its buffers are made (the hooks wait there for the
        previous one, so one is in flight at a time).
        """
        if not self.requires_gradient_sync:
            for fsdp_param in self.fsdp_params:
                fsdp_param.accumulate_unsharded_grad()
            return None
        params, grads = [], []
        all_reduce = self.requires_all_reduce or self.replicate_group is None
        # no gradient this time, rows kept from earlier microbatches: they must reach the replicas
        kept_rows = [all_reduce and p.partial_reduced_grad is not None for p in self.fsdp_params]
        if before is not None and any(p.holds_unsharded_grad() or kept
                                      for p, kept in zip(self.fsdp_params, kept_rows)):
            before()  # a reduce-scatter will be issued; nothing of it (not even a cast) exists yet
        for fsdp_param, kept in zip(self.fsdp_params, kept_rows):
            grad = fsdp_param.take_unsharded_grad()
            if grad is None and kept:
                grad = torch.zeros(fsdp_param.orig_size, dtype=fsdp_param.dtypes.wire, device=self.device)
            if grad is not None:
                params.append(fsdp_param)
                grads.append(fsdp_param.padded_unsharded_grad(grad))
        if not params:
            return None
        wire_dtype = params[0].dtypes.wire  # one policy per group: the same for every parameter
        process_group.ensure_reducible(wire_dtype, self.group)  # e.g. bf16 on an old gloo: clear error
        split_numels = [g.numel() // self.world_size for g in grads]
        flat_input = tag(torch.empty(sum(split_numels) * self.world_size, dtype=wire_dtype, device=self.device),
                         "comm_buffers")
        # rank r's chunk of the input holds rows [r*padded_rows, (r+1)*padded_rows) of every gradient
        columns = torch.split(flat_input.view(self.world_size, -1), split_numels, dim=1)
        torch._foreach_copy_(list(columns), [g.view(self.world_size, -1) for g in grads])
        del grads
        # the output becomes the sharded grads, unless they accumulate in another dtype: then it
        # is a temporary comm buffer, freed once its rows have been added (``_ReduceScatter.wait``)
        temporary = any(p.dtypes.accumulation != wire_dtype or p.dtypes.master != wire_dtype for p in params)
        output = tag(torch.empty(sum(split_numels), dtype=wire_dtype, device=self.device),
                     "comm_buffers" if temporary else "sharded_grads")
        replicas = self.mesh.size(0) if self.replicate_group is not None else 1
        divide_by = self.gradient_divide_factor
        if divide_by is None and self.force_sum_reduction_for_comms:
            divide_by = float(self.world_size * replicas)
        op = "avg" if self.world_size > 1 and divide_by is None else "sum"
        # flat_input dies after the reduce-scatter: on gloo each chunk is then summed in place onto
        # its owner, with no receive buffer as large as the input (NCCL's needs none either)
        handle = collectives.reduce_scatter_tensor(output, flat_input, op=op, group=self.group, async_op=True,
                                                   meta={"module": self.name}, input_is_scratch=True,
                                                   before_issue=functools.partial(sync_points.fire, "reduce_scatter", self.name))
        if _SYNCHRONOUS:
            handle.wait()  # the later _ReduceScatter.wait() then only hands out the shards
        # taken now, so that a second reduction in the same backward does not see them again
        partials = None
        if all_reduce and self.replicate_group is not None:
            partials = [p.take_partial_reduced_grad() for p in params]
        return _ReduceScatter(handle, flat_input, output, temporary, params, split_numels,
                              self.replicate_group, self.name, divide_by, partials)

    # -- inspection --------------------------------------------------------------------------
    def unsharded_bytes(self) -> int:
        """Bytes of unsharded parameter storage this group holds right now."""
        return sum(out.untyped_storage().nbytes() for p in self.fsdp_params for out in p.all_gather_outputs)

    def sharded_bytes(self) -> int:
        """Bytes of this rank's padded shards (the storage behind the DTensors)."""
        return sum(p.sharded_local_tensor.untyped_storage().nbytes() for p in self.fsdp_params)


def _param_name(fsdp_param, paths: dict[int, str]) -> str:
    """A parameter's name in the root module, e.g. ``layers.0.attention.wq.weight``."""
    infos = fsdp_param.module_infos
    if not infos:
        return "a parameter"
    module, attribute = infos[0]
    path = paths.get(id(module), type(module).__name__)
    return f"{path}.{attribute}" if path else attribute
