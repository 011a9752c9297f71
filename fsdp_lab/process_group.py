"""The process group behind a collective, looked up once per group, and how to call it.

torch.distributed's collective functions check their arguments, look up the group's size and
backend, build an options object, then call the process group's own method. fsdp_lab's
collectives (``fsdp_lab.collectives``) call that method themselves with what this module keeps:
``lookup`` finds a group's size, this rank's place in it and (``backend``) the backend per
device type once, and keeps them while the group lives (a group made again, as a simulated
world is each time, is a new one); ``options`` makes each options object once; ``direct`` says
when a call must go through torch's function after all, because the function does more than
check and call.
"""

from __future__ import annotations

import datetime
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import has_torch_function

from fsdp_lab.dist import backend_for, loopback_interface

# The process group's own methods behind torch.distributed's all_gather_single and
# reduce_scatter_single (torch >= 2.13; before, all_gather_into_tensor and reduce_scatter_tensor).
ALL_GATHER = "all_gather_single" if hasattr(c10d.ProcessGroup, "all_gather_single") else "_allgather_base"
REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(c10d.ProcessGroup, "reduce_scatter_single")
                  else "_reduce_scatter_base")


class Group(NamedTuple):
    """What a collective needs of its process group, looked up once per group by ``lookup``."""

    pg: c10d.ProcessGroup
    size: int
    rank: int  # this rank's place in the group
    backends: dict  # device type -> "gloo", "nccl" or "fake", filled on first use


_groups: "weakref.WeakKeyDictionary[c10d.ProcessGroup, Group]" = weakref.WeakKeyDictionary()


def lookup(group) -> Group:
    """``group`` (None: the default group) with its size and this rank's place in it.

    Kept while the group lives: looked up on every call (``dist.get_world_size``,
    ``dist.get_backend``) they cost about 1 us a call on a 2-core CPU, a third of a bare call's
    host time on torch's fake backend. Raises ValueError when no process group is initialised
    or when this rank is not in ``group``."""
    pg = dist.group.WORLD if group is None else group
    try:
        return _groups[pg]
    except (KeyError, TypeError):  # TypeError: None or torch's "not a member" marker
        pass
    if pg is None:
        raise ValueError("no process group is initialised: run the code under fsdp_lab.launch(...), "
                         "or call torch.distributed.init_process_group first")
    if not isinstance(pg, c10d.ProcessGroup):
        raise ValueError(f"group {group!r} is not a process group this rank belongs to (new_group returns "
                         "a marker on ranks outside the group): call its collectives only on its ranks")
    info = _groups[pg] = Group(pg, pg.size(), pg.rank(), {})
    return info


def backend(info: Group, tensor: torch.Tensor) -> str:
    """The backend that runs ``info``'s collectives on ``tensor``: per tensor, a
    "cpu:gloo,cuda:nccl" group runs CPU tensors on gloo and CUDA tensors on NCCL."""
    device_type = tensor.device.type
    name = info.backends.get(device_type)
    if name is None:
        name = info.backends[device_type] = backend_for(device_type, info.pg)
    return name


_options_made: dict = {}


def options(kind: type, async_op: bool, reduce_op=None, root: int | None = None):
    """A process-group options object (``c10d.AllgatherOptions`` …; ``root``: a broadcast's
    source, as the group's rank), made once per setting and shared: the backends read it during
    the call and keep no reference to it."""
    key = (kind, async_op, reduce_op, root)
    try:
        return _options_made[key]
    except KeyError:
        pass
    except TypeError:  # a ReduceOp that cannot be a key (a premultiplied sum): made per call
        key = None
    made = kind()
    if hasattr(made, "asyncOp"):  # all-reduce's since torch 2.8; the others' already in 2.6
        made.asyncOp = async_op
    if reduce_op is not None:
        made.reduceOp = reduce_op
    if root is not None:
        made.rootRank, made.rootTensor = root, 0
    if key is not None:
        _options_made[key] = made
    return made


def direct(info: Group, *tensors: torch.Tensor) -> bool:
    """Whether the process group's own method can take ``tensors`` as they are. Not when
    torch.distributed's function would do more than check its arguments and call it: for a
    complex tensor (viewed as real pairs), a ``__torch_function__`` subclass or mode (handed
    the call), or a group inside ``_coalescing_manager`` (the call is queued)."""
    if has_torch_function(tensors) or info.pg in c10d._world.pg_coalesce_state:
        return False
    for tensor in tensors:
        if tensor.is_complex():
            return False
    return True


_reducible_checked: dict[tuple[str, torch.dtype], bool] = {}


def ensure_reducible(dtype: torch.dtype, group=None) -> None:
    """Raise TypeError if this group's backend cannot sum tensors of ``dtype``.

    Only gloo is asked (NCCL sums every floating dtype the FSDP policies allow; integer and
    bool dtypes are refused for gradient reductions by the policies, not here), once per
    dtype, on a one-rank gloo group of this process's own: no other rank takes part, so a
    rank that checks while a peer has stopped on an error (an out-of-memory one, say) cannot
    wait for it.
    """
    device = "cuda" if backend_for("cuda", group) == "nccl" else "cpu"  # where gradients are reduced
    backend_name = backend_for(device, group)
    if backend_name != "gloo":
        return
    key = (backend_name, dtype)
    if key not in _reducible_checked:
        _reducible_checked[key] = _gloo_sums(dtype)
    if not _reducible_checked[key]:
        raise TypeError(
            f"the {backend_name} backend of torch {torch.__version__} cannot reduce {dtype}; "
            f"set reduce_dtype=torch.float32 in the mixed-precision policy"
        )


def _gloo_sums(dtype: torch.dtype) -> bool:
    """Whether gloo, in this torch, sums CPU tensors of ``dtype``: a one-element all-reduce on a
    group of one rank over loopback, its store in this process (nothing leaves the process)."""
    gloo = dist.ProcessGroupGloo
    settings = gloo._Options()
    interface = loopback_interface()
    settings._devices = [gloo.create_device(interface=interface) if interface else gloo.create_default_device()]
    settings._threads = 1
    settings._timeout = datetime.timedelta(seconds=60)
    alone = gloo(dist.HashStore(), 0, 1, settings)
    try:
        alone.allreduce([torch.zeros(1, dtype=dtype)]).wait()
        return True
    except (RuntimeError, TypeError, ValueError):  # gloo: "Invalid scalar type"
        return False
