"""The gradient's life under FSDP1: per-parameter grads -> one flat buffer -> reduce -> shard.

In backward every original parameter's full-shape view (an autograd leaf made by
``FlatParamHandle.use_unsharded_views``) receives its gradient. ``register_grad_hooks``
hooks each leaf after autograd has accumulated into it and moves the gradient into one flat
buffer in the reduce dtype, laid out like the flat parameter (padding stays zero):

* ``"flat"`` (default): the flat buffer is allocated once, before the first gradient, and
  each parameter's gradient is added straight into its slice, then dropped. At most one
  parameter's low-precision gradient exists beside the buffer.
* ``"concat"`` (PyTorch FSDP1 / fairscale before optimize_backward_concat): each gradient is
  upcast to its own reduce-dtype tensor and kept; when all exist they are ``torch.cat``-ed
  with the padding. The per-parameter copies and the concatenation coexist: about twice the
  buffer at the peak.

When every leaf of the handle has its gradient, the unit calls ``start_reduce`` (an
asynchronous reduce-scatter within the shard group; NO_SHARD skips it) and, at the end of
backward, ``finish_reduce`` (all-reduce across replicas for NO_SHARD/HYBRID_SHARD, divide by
the world size, cast to the parameter dtype, and add into each original parameter's
``.grad``, which is a view of one flat sharded gradient).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab import collectives, sync_points
from fsdp_lab.fsdp1.flat_param import FlatParamHandle
from fsdp_lab.memory import tags as _tags
from fsdp_lab.memory.tags import tag

GRAD_ACCUMULATION_MODES = ("flat", "concat")


class GradState:
    """What one handle's gradients are doing between backward and the optimizer step."""

    def __init__(self, reduce_dtype: torch.dtype, mode: str, comm_dtype: torch.dtype | None = None):
        # reduce_dtype: the flat buffer's (accumulation) dtype; comm_dtype: on the wire (default the same)
        self.reduce_dtype, self.mode = reduce_dtype, mode
        self.comm_dtype = comm_dtype or reduce_dtype
        self.buffer: torch.Tensor | None = None   # full flat gradient (kept across no_sync)
        self.pending: dict[int, torch.Tensor] = {}  # concat mode: upcast per-parameter grads
        self.seen: set[int] = set()                # leaves that got a gradient this backward
        self.reduce = None                          # (output, collective handle, input) in flight


def register_grad_hooks(handle: FlatParamHandle, state: GradState, on_ready) -> None:
    """Hook every leaf of ``handle``; call ``on_ready(handle)`` once all have gradients."""
    state.seen = set()
    for index, leaf in enumerate(handle.leaves):
        def hook(leaf, index=index):
            _take_leaf_grad(handle, state, index, leaf)
            if len(state.seen) == len(handle.leaves):
                on_ready(handle)
        leaf.register_post_accumulate_grad_hook(hook)


def _take_leaf_grad(handle: FlatParamHandle, state: GradState, index: int, leaf: torch.Tensor) -> None:
    info = handle.infos[index]
    grad = leaf.grad.reshape(-1)
    leaf.grad = None
    state.seen.add(index)
    if state.mode == "flat":
        if state.buffer is None:
            state.buffer = torch.zeros(handle.padded_numel, dtype=state.reduce_dtype, device=handle.device)
            tag(state.buffer, "unsharded_grads")
        state.buffer[info.offset:info.offset + info.numel].add_(grad)
    else:
        upcast = grad.to(state.reduce_dtype)
        if upcast is grad:
            upcast = grad.clone()
        state.pending[index] = tag(upcast, "unsharded_grads")


def flush_pending(handle: FlatParamHandle, state: GradState) -> None:
    """Concat mode: build the flat gradient from the per-parameter ones (zeros where a
    parameter got none), add it to the buffer; flat mode: nothing to do."""
    if state.mode != "concat" or not state.pending:
        return
    pieces = []
    for index, info in enumerate(handle.infos):
        grad = state.pending.pop(index, None)
        pieces.append(grad if grad is not None else
                      torch.zeros(info.numel, dtype=state.reduce_dtype, device=handle.device))
    pad = handle.padded_numel - handle.numel
    if pad:
        pieces.append(torch.zeros(pad, dtype=state.reduce_dtype, device=handle.device))
    flat = tag(torch.empty(handle.padded_numel, dtype=state.reduce_dtype, device=handle.device), "comm_buffers")
    torch.cat(pieces, out=flat)
    del pieces
    if state.buffer is None:
        state.buffer = flat
    else:
        state.buffer.add_(flat)


def start_reduce(handle: FlatParamHandle, state: GradState) -> None:
    """Issue the reduce-scatter of the flat gradient within the shard group (asynchronous)."""
    flush_pending(handle, state)
    full, state.buffer = state.buffer, None
    if full is None:
        return
    if full.dtype != state.comm_dtype:  # a temporary buffer for the collective only
        full = tag(full.to(state.comm_dtype), "comm_buffers")
    if handle.shard_group is not None:
        collectives.ensure_reducible(full.dtype, handle.shard_group)
    if handle.shard_size == 1:
        state.reduce = (full, None, None)
        return
    output = tag(torch.empty(handle.shard_numel, dtype=full.dtype, device=full.device), "sharded_grads")
    sync_points.fire("reduce_scatter", handle.unit_name)
    # the flat gradient dies after this reduce: let gloo reduce in place (no full-size receive buffer)
    work = collectives.reduce_scatter_tensor(output, full, group=handle.shard_group, async_op=True,
                                             meta={"module": handle.unit_name}, input_is_scratch=True)
    state.reduce = (output, work, full)


def finish_reduce(handle: FlatParamHandle, state: GradState, *, replicate_group, world_size: int) -> None:
    """Wait for the reduce-scatter, all-reduce across replicas, average, and add the result
    into the original parameters' ``.grad`` (views of one flat sharded gradient)."""
    if state.reduce is None:
        return
    output, work, _input = state.reduce
    state.reduce = None
    if work is not None:
        work.wait()
    if replicate_group is not None:
        sync_points.fire("reduce_scatter", handle.unit_name)
        collectives.all_reduce(output, group=replicate_group, meta={"module": handle.unit_name})
    output.div_(world_size)
    home = handle.flat_shard.device
    sharded = output.to(home, handle.dtype)
    if sharded is output:
        sharded = output
    tag(sharded, "sharded_grads")
    for info, (a, b) in zip(handle.infos, handle.local_slices()):
        if info.param.grad is not None:  # accumulation across steps without zero_grad
            sharded[a:b].add_(info.param.grad.reshape(-1))
    for info, (a, b) in zip(handle.infos, handle.local_slices()):
        info.param.grad = sharded[a:b]


@torch.no_grad()
def clip_grad_norm(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``FullyShardedDataParallel.clip_grad_norm_``: the global norm from the shards, then scale.

    Sharded gradients are summed per rank and all-reduced over the shard group (replicas of
    HYBRID_SHARD/NO_SHARD hold the same values, so they are not added again); gradients of
    parameters FSDP does not manage (ignored modules) are whole on every rank and added once.
    Returns the total norm (float32 tensor) before clipping.
    """
    from fsdp_lab.fsdp1.fully_sharded import FullyShardedDataParallel

    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    sharded = [i.param.grad for u in units for h in u._handles for i in h.infos if i.param.grad is not None]
    replicated = [p.grad for p in model.parameters()
                  if p.grad is not None and getattr(p, "_fsdp1_unit", None) is None]
    device = units[0].compute_device if units else torch.device("cpu")

    def local(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        if inf:
            return torch.stack([g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                                for g in grads]).max().to(device)
        return sum(g.float().norm(norm_type) ** norm_type for g in grads).to(device)

    total = local(sharded)
    group = units[0].shard_group if units else None
    if group is not None:
        collectives.all_reduce(total, op="max" if inf else "sum", group=group)
    other = local(replicated)
    total = torch.maximum(total, other) if inf else (total + other) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.device, g.dtype))
    return total


class GradBufferPeak(TorchDispatchMode):
    """Peak bytes held by FSDP's gradient buffers, sampled after every op.

        with GradBufferPeak() as gp:
            loss.backward()
        gp.peak  # bytes

    Counts live storages tagged with ``categories`` (default: full-size gradients and
    communication inputs, which live only inside one backward). This isolates what
    ``grad_accumulation`` changes: on gloo the reduce-scatter's own receive buffer (same
    size as its input) sits in the total peak of both modes alike.
    """

    def __init__(self, categories=("unsharded_grads", "comm_buffers")):
        super().__init__()
        self.categories, self.peak = set(categories), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = sum(st.nbytes() for st, cat in list(_tags._tags.items()) if cat in self.categories)
        self.peak = max(self.peak, live)
        return out
