"""One parameter's life under FSDP2: sharded -> gathered -> used -> freed -> grad reduced.

``FSDPParam`` owns everything that is *per parameter*; ``param_group.py`` batches the
collectives of many parameters and ``fully_shard.py`` decides *when* each step runs.

1. **Shard** (``__init__``). The full tensor is cut along dim 0 the way ``torch.chunk`` cuts
   it: every rank gets ``ceil(rows / world_size)`` rows, the last ranks fewer (maybe none).
   Each rank stores its rows in a *padded* buffer of the full ``ceil`` size, so all ranks
   all-gather the same number of elements; the public parameter is a ``DTensor``
   (``Shard(0)``) whose local tensor is the unpadded view of that buffer. Optimizers and
   state dicts see only DTensors.
2. **All-gather inputs** (``all_gather_inputs``). The padded shard (or, for a tensor subclass
   with ``fsdp_pre_all_gather``, whatever it chooses to send, e.g. packed NF4 bytes).
3. **Unshard** (``alloc_all_gather_outputs`` + ``init_unsharded_param``). The group copies
   the gathered bytes into this parameter's ``all_gather_outputs`` (one flat tensor per
   input, rank-major, padding included); the unsharded parameter is a view of them, or what
   ``fsdp_post_all_gather`` builds from them. It is created once and kept: between uses its
   storage is resized to 0 (``free_unsharded_param``), so autograd's saved references stay
   valid and come back to life when the next all-gather refills the same storage.
4. **Swap** (``to_unsharded`` / ``to_sharded``). The module's attribute points at the
   unsharded ``nn.Parameter`` during forward/backward and at the sharded DTensor otherwise.
5. **Gradient** (``take_unsharded_grad`` / ``padded_unsharded_grad`` / ``accumulate_sharded_grad``).
   The full-size gradient autograd left on the unsharded parameter is padded to the gathered
   size for the group's reduce-scatter; this rank's reduced rows become (or are added to)
   the DTensor's ``.grad``.

Mixed precision: ``self.dtypes`` (``fsdp_lab.precision.param_dtypes``, decided once; table in
docs/precision.md) names four roles. The shard is stored in the **master** dtype and gathered
in the **compute** dtype; gradients travel in the **wire** dtype; reduced shards are added to
the sharded gradient in the **accumulation** dtype (kept in a private buffer when that differs
from the master dtype, ``.grad`` being its cast), and gradients set aside without sync in the
unsharded accumulation dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_lab.memory.tags import listened, tag
from fsdp_lab.checks import check_bool
from fsdp_lab.precision import ParamDtypes

__all__ = ["FSDPParam", "OffloadPolicy", "CPUOffloadPolicy", "padded_rows"]


def padded_rows(rows: int, world_size: int) -> int:
    """Rows every rank stores for a parameter of ``rows`` rows: ``ceil(rows / world_size)``
    (the last ranks hold fewer real rows, padded to this size)."""
    return -(-rows // world_size)


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (PyTorch's default ``OffloadPolicy()``)."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; the optimizer step runs on CPU.

    pin_memory: pin the CPU shards for faster copies to the GPU (ignored without CUDA).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        check_bool("pin_memory", self.pin_memory)


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for dim in reversed(size):
        stride.append(running)
        running *= dim
    return tuple(reversed(stride))


def _free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


class FSDPParam:
    """State of one original parameter managed by a ``fully_shard`` group.

    ``module_infos``: every (module, attribute name) through which the parameter is reached
    (more than one for tied weights). ``device``: where compute runs; ``offload`` keeps the
    shard (and its gradient) on CPU instead. ``dtypes``: its compute, master, wire and
    accumulation dtypes (``fsdp_lab.precision.param_dtypes``; default: the parameter's own for
    all). Raises ValueError for a 0-dim parameter.
    """

    def __init__(self, param: nn.Parameter, module_infos: list[tuple[nn.Module, str]], mesh, device: torch.device,
                 dtypes: ParamDtypes | None = None, offload: bool = False, pin_memory: bool = False):
        if param.dim() == 0:
            raise ValueError(f"cannot shard the 0-dim parameter {module_infos[0][1]!r} on dim 0; "
                             "give it shape (1,) or keep it out of fully_shard")
        # weak: a module holds its group's state, which holds this parameter (no cycle back)
        self._module_refs = [(weakref.ref(module), name) for module, name in module_infos]
        self.mesh, self.device = mesh, device
        # HSDP (a 2-D mesh, replicate x shard): shard over the last dim, replicate over the first
        shard_dim = mesh.ndim - 1
        self.rank, self.world_size = mesh.get_local_rank(shard_dim), mesh.size(shard_dim)
        self.orig_size, self.orig_dtype = param.shape, param.dtype
        self._initially_requires_grad = param.requires_grad
        # set by fully_shard when frozen in a narrower master dtype than training would give it
        self.trained_master_dtype: torch.dtype | None = None
        self.dtypes = dtypes or ParamDtypes(*(param.dtype,) * 5)
        # (local_rows, *orig_size[1:]) in dtypes.accumulation; only when that is not dtypes.master
        self._sharded_main_grad: torch.Tensor | None = None
        self._exposed_grad: tuple[torch.Tensor, int] | None = None  # (the .grad it was cast to, its version)
        self.offload, self.pin_memory = offload, pin_memory and torch.cuda.is_available()
        rows = self.orig_size[0]
        self.padded_rows = padded_rows(rows, self.world_size)
        self.padded_sharded_size = torch.Size([self.padded_rows, *self.orig_size[1:]])
        self.local_rows = max(0, min(self.padded_rows, rows - self.rank * self.padded_rows))
        # per all-gather input: (world_size * its numel,) in its dtype (compute dtype, plain parameter)
        self.all_gather_outputs: list[torch.Tensor] = []
        self._unsharded_param: nn.Parameter | None = None  # orig_size, compute dtype (a view of the outputs)
        self._unsharded_inner_tensors: list[torch.Tensor] = []
        self._metadata = None
        self.unsharded_accumulated_grad: torch.Tensor | None = None  # orig_size, accumulation dtype (no sync)
        # HSDP without the replica all-reduce: this rank's reduced rows so far (padded shard, wire dtype)
        self.partial_reduced_grad: torch.Tensor | None = None
        self._init_sharded_param(param.detach())

    # -- 1. shard -------------------------------------------------------------------------
    def _init_sharded_param(self, data: torch.Tensor) -> None:
        storage_device = torch.device("cpu") if self.offload else self.device
        if data.is_meta:  # meta-device init: shards on meta until Module.to_empty (reset_sharded_param)
            if hasattr(data, "fsdp_shard") or hasattr(data, "fsdp_pre_all_gather"):
                raise NotImplementedError(f"{self.module_infos[0][1]!r} is a {type(data).__name__} on the meta "
                                          "device; quantized weights need values: quantize after initialising")
            storage_device = torch.device("meta")
        if hasattr(data, "fsdp_shard"):  # a tensor subclass that shards (and pads) itself
            local = data.fsdp_shard(self.rank, self.world_size).to(storage_device)
            self._sharded_data = None
        else:
            padded = torch.zeros(self.padded_sharded_size, dtype=self.dtypes.master, device=storage_device)
            start = self.rank * self.padded_rows
            padded[: self.local_rows].copy_(data[start:start + self.local_rows])
            if self.pin_memory and storage_device.type == "cpu":
                padded = padded.pin_memory()
            if not padded.is_meta:
                tag(padded, "sharded_params")
            self._sharded_data = padded  # (padded_rows, *orig_size[1:]) master dtype; rows past local_rows are 0
            local = padded.narrow(0, 0, self.local_rows)
        self.is_extension = hasattr(local, "fsdp_pre_all_gather")
        placements = (Replicate(),) * (self.mesh.ndim - 1) + (Shard(0),)
        self._spec = DTensorSpec(self.mesh, placements, tensor_meta=TensorMeta(
            self.orig_size, _contiguous_stride(self.orig_size), self.dtypes.master))
        self.sharded_param = nn.Parameter(self._to_dtensor(local), requires_grad=self.requires_grad)

    def reset_sharded_param(self) -> None:
        """Adopt the shard ``Module._apply`` left on the module (``to_empty(device=...)`` after
        building on the meta device, or a device move): a new padded buffer on its device holds
        its rows, and the module gets a new sharded parameter over it. No-op when unchanged."""
        module, name = self.module_infos[0]
        current = module._parameters[name]
        local = current.to_local() if isinstance(current, DTensor) else current
        held = self._sharded_data if self._sharded_data is not None else self.sharded_local_tensor
        if local.device == held.device and (local.is_meta or
                                            local.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()):
            return
        if self.is_extension:
            data = local
        else:
            data = torch.zeros(self.padded_sharded_size, dtype=self.dtypes.master, device=local.device)
            if not local.is_meta:
                tag(data, "sharded_params")
                data[: self.local_rows].copy_(local.detach().reshape(self.local_rows, *self.orig_size[1:]))
            self._sharded_data = data
            data = data.narrow(0, 0, self.local_rows)
        self.sharded_param = nn.Parameter(self._to_dtensor(data), requires_grad=self.requires_grad)
        self.to_sharded()

    def _to_dtensor(self, local: torch.Tensor) -> DTensor:
        # DTensor(...) wraps ``local`` itself (DTensor.from_local would take a view, which a
        # quantized subclass need not support)
        return DTensor(local, self._spec, requires_grad=False)

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains: the sharded parameter's flag once it exists (a model may
        be frozen after ``fully_shard``, as with PyTorch's), else the original parameter's."""
        sharded = getattr(self, "sharded_param", None)
        return sharded.requires_grad if sharded is not None else self._initially_requires_grad

    @property
    def module_infos(self) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute name) holding this parameter, among the modules still alive."""
        return [(module, name) for ref, name in self._module_refs if (module := ref()) is not None]

    @property
    def sharded_local_tensor(self) -> torch.Tensor:
        return self.sharded_param._local_tensor

    # -- 2. all-gather inputs -------------------------------------------------------------
    def all_gather_inputs(self) -> tuple[list[torch.Tensor], list[torch.dtype]]:
        """What this rank contributes to the group's all-gather, and the dtype each travels in."""
        if self.is_extension:
            module = self.module_infos[0][0]
            from fsdp_lab.precision import MixedPrecisionPolicy
            # as PyTorch passes it: param_dtype None when the parameter already has it
            compute = self.dtypes.compute
            policy = MixedPrecisionPolicy(param_dtype=compute if compute != self.orig_dtype else None,
                                          reduce_dtype=self.dtypes.wire)
            local = self.sharded_local_tensor
            if self.offload:
                local = local.to(self.device, non_blocking=True)
            inputs, self._metadata = local.fsdp_pre_all_gather(
                self.mesh, self.orig_size, _contiguous_stride(self.orig_size), module, policy)
            return list(inputs), [t.dtype for t in inputs]
        data = self._sharded_data
        if self.offload:
            data = data.to(self.device, non_blocking=True)
        return [data], [self.dtypes.compute]

    # -- 3. unshard -----------------------------------------------------------------------
    def alloc_all_gather_outputs(self, inputs: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """The flat, rank-major tensors the group copies gathered data into (allocated once,
        refilled by resizing their storage)."""
        if not self.all_gather_outputs:
            with _made_for_training():
                self.all_gather_outputs = [
                    tag(torch.empty(t.numel() * self.world_size, dtype=d, device=self.device), "unsharded_params")
                    for t, d in zip(inputs, dtypes)
                ]
        for out in self.all_gather_outputs:
            _alloc_storage(out)
        return self.all_gather_outputs

    def init_unsharded_param(self, input_sizes: list[torch.Size]) -> None:
        """Build (first time) or refresh the unsharded parameter from ``all_gather_outputs``."""
        with _made_for_training():
            self._init_unsharded_param(input_sizes)

    def _init_unsharded_param(self, input_sizes: list[torch.Size]) -> None:
        outputs = tuple(out.view(self.world_size * size[0], *size[1:]) if len(size) else out
                        for out, size in zip(self.all_gather_outputs, input_sizes))
        if self.is_extension:
            local = self.sharded_local_tensor
            dtype = self.dtypes.compute
            if self._unsharded_param is not None:
                for inner in self._unsharded_inner_tensors:
                    _alloc_storage(inner)
                local.fsdp_post_all_gather(outputs, self._metadata, dtype, out=self._unsharded_param)
                return
            unsharded, inner = local.fsdp_post_all_gather(outputs, self._metadata, dtype)
            self._unsharded_inner_tensors = list(inner)
        else:
            if self._unsharded_param is not None:
                return  # a view of all_gather_outputs[0], whose storage was just refilled
            unsharded = outputs[0].narrow(0, 0, self.orig_size[0])
        self._unsharded_param = nn.Parameter(unsharded, requires_grad=self.requires_grad)
        self._grad_watched = False
        self._watch_unsharded_grad()

    def _watch_unsharded_grad(self) -> None:
        """From now on, tell a running memory tracker the full gradient is ``unsharded_grads``
        the moment autograd writes it, as FSDP1's gradient hooks do: this module's post-backward,
        which takes and reduces it, runs later, and in between a tracker saw a temporary."""
        if self._grad_watched or not self._unsharded_param.requires_grad:
            return
        self._unsharded_param.register_post_accumulate_grad_hook(_tag_unsharded_grad)
        self._grad_watched = True

    def free_unsharded_param(self) -> None:
        """Release the unsharded bytes; the tensors stay, with storage of size 0."""
        for tensor in [*self.all_gather_outputs, *self._unsharded_inner_tensors]:
            _free_storage(tensor)

    @property
    def unsharded_param(self) -> nn.Parameter:
        if self._unsharded_param is None:
            raise RuntimeError("the parameter has not been all-gathered yet; call unshard() first")
        return self._unsharded_param

    # -- 4. swap --------------------------------------------------------------------------
    def to_unsharded(self) -> None:
        unsharded = self.unsharded_param
        if unsharded.requires_grad != self.requires_grad:  # frozen or unfrozen since the last gather
            unsharded.requires_grad_(self.requires_grad)
            self._watch_unsharded_grad()
        for module, name in self.module_infos:
            module._parameters[name] = unsharded

    def to_sharded(self) -> None:
        for module, name in self.module_infos:
            module._parameters[name] = self.sharded_param

    def reset(self) -> None:
        """After an interrupted step: modules see the shard, the unsharded bytes are freed and
        the unreduced gradients (this step's, any accumulated without sync and any reduced
        within the shard group but not yet across the replicas) dropped."""
        self.to_sharded()
        self.free_unsharded_param()
        if self._unsharded_param is not None:
            self._unsharded_param.grad = None
        self.unsharded_accumulated_grad = None
        self.partial_reduced_grad = None

    # -- 5. gradient ----------------------------------------------------------------------
    def holds_unsharded_grad(self) -> bool:
        """Whether ``take_unsharded_grad`` would return a gradient (it takes nothing)."""
        return (self._unsharded_param is not None and self._unsharded_param.grad is not None) \
            or self.unsharded_accumulated_grad is not None

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Remove and return the full gradient (plus what was accumulated without sync), or None."""
        grad = None
        if self._unsharded_param is not None and self._unsharded_param.grad is not None:
            grad = tag(self._unsharded_param.grad, "unsharded_grads")
            self._unsharded_param.grad = None
        if self.unsharded_accumulated_grad is not None:
            acc, self.unsharded_accumulated_grad = self.unsharded_accumulated_grad, None
            # added as it is, rounded once into acc's dtype (PyTorch's ``acc += grad``), not cast first
            grad = acc if grad is None else acc.add_(grad)
        return grad

    def accumulate_unsharded_grad(self) -> None:
        """Without gradient sync: keep the full gradient aside (in the reduce dtype) for later."""
        if self._unsharded_param is None or self._unsharded_param.grad is None:
            return
        grad, self._unsharded_param.grad = self._unsharded_param.grad, None
        dtype = self.dtypes.unsharded_accumulation
        if self.unsharded_accumulated_grad is None:
            self.unsharded_accumulated_grad = tag(grad.to(dtype, copy=grad.dtype != dtype), "unsharded_grads")
        else:
            self.unsharded_accumulated_grad.add_(grad)  # one rounding, as above

    def padded_unsharded_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` with dim 0 padded to ``world_size * padded_rows`` (a copy only when padding is needed)."""
        padded_rows = self.world_size * self.padded_rows
        if grad.shape[0] == padded_rows:
            return grad
        padded = grad.new_zeros((padded_rows, *grad.shape[1:]))
        padded[: grad.shape[0]].copy_(grad)
        return padded

    def keep_partial_reduced_grad(self, reduced_shard: torch.Tensor) -> None:
        """HSDP with ``requires_all_reduce`` False: add this microbatch's reduced rows (a flat
        slice of the group's output, padded shard, wire dtype) to what waits for the all-reduce."""
        if self.partial_reduced_grad is None:
            self.partial_reduced_grad = reduced_shard  # a view: the group's output stays, as sharded_grads
        else:
            self.partial_reduced_grad.add_(reduced_shard)

    def take_partial_reduced_grad(self) -> torch.Tensor | None:
        """Remove and return the rows kept by ``keep_partial_reduced_grad``, or None."""
        partial, self.partial_reduced_grad = self.partial_reduced_grad, None
        return partial

    def accumulate_sharded_grad(self, reduced_shard: torch.Tensor) -> None:
        """Make this rank's reduced rows (a flat slice of the padded shard) the DTensor's grad, or add them to it."""
        local = reduced_shard.view(self.padded_sharded_size).narrow(0, 0, self.local_rows)
        if self.dtypes.accumulation != self.dtypes.master:
            self._accumulate_main_grad(local, self.dtypes.accumulation)
            return
        local = local.to(self.dtypes.master)
        if self.offload:
            local = local.to("cpu", non_blocking=True)
        tag(local, "sharded_grads")
        existing = self.sharded_param.grad
        if existing is not None:
            existing._local_tensor.add_(local)
            return
        self.sharded_param.grad = self._to_dtensor(local)

    def _accumulate_main_grad(self, local: torch.Tensor, acc_dtype: torch.dtype) -> None:
        """Accumulate in ``acc_dtype`` (a private buffer) and expose its cast as ``.grad``.

        The buffer restarts from ``.grad`` whenever the optimizer changed it since it was
        written (set to None, replaced, or zeroed in place: its version counter moved).
        """
        existing = self.sharded_param.grad
        exposed = None if existing is None else existing._local_tensor
        acc = self._sharded_main_grad
        fresh = self._exposed_grad is not None and exposed is self._exposed_grad[0] \
            and exposed._version == self._exposed_grad[1]
        if acc is None or not fresh:
            acc = None if exposed is None else exposed.to(acc_dtype, copy=True)
        local = local.to("cpu" if self.offload else local.device)
        acc = tag(local.to(acc_dtype, copy=True), "sharded_grads") if acc is None else acc.add_(local.to(acc_dtype))
        self._sharded_main_grad = acc
        out = tag(acc.to(self.dtypes.master), "sharded_grads")
        self.sharded_param.grad = self._to_dtensor(out)
        self._exposed_grad = (out, out._version)


def _tag_unsharded_grad(param: torch.Tensor) -> None:
    if listened() and param.grad is not None:
        tag(param.grad, "unsharded_grads")


def _made_for_training():
    """Tensors FSDP keeps from one pass to the next are made as normal tensors even in a pass under
    ``torch.inference_mode`` (an inference tensor could not take part in a later training step)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
