"""MemoryTracker: where the bytes of one training step go, measured from tensor storages.

Every tensor's bytes live in a storage (``tensor.untyped_storage()``); views share it. The
tracker is a ``TorchDispatchMode``: each op's outputs (and any input it has not seen) are
looked up by storage, so each storage is counted once, and a weak reference on the storage
object removes its bytes the moment the storage dies. ``UntypedStorage.resize_`` (how FSDP
frees and refills unsharded parameters) bypasses dispatch, so it is patched while tracking.
Nothing here asks the allocator, which is why it works on CPU, on CUDA and on fake tensors.

What existed before tracking started counts only if the tracked model or optimizer holds it
(``memory.ownership``): storages of a model dropped earlier but not yet collected, or of
another live model, never count, so a run reads the same as in a fresh process.

A storage's category, strongest first:

1. an explicit tag (``fsdp_lab.memory.tags.tag``), from the moment it is set;
2. ``params``: the model's parameters; ``grads``: their ``.grad``; ``optimizer_state``: the
   tensors in ``optimizer.state``;
3. ``activations``: saved for backward (seen by ``saved_tensors_hooks``) while still saved,
   whether allocated in the step or before it (the batch's input ids and labels), except the
   model's buffers;
4. ``other``: storages that existed before tracking started (buffers, the batch);
5. ``temporaries``: everything else allocated while tracking, or the ``tag_scope`` default.

A storage that is a temporary at the moment of the peak and becomes a gradient, an optimizer
state, an activation or a tagged buffer right after (the op that allocates a gradient
returns before autograd stores it in ``.grad``) is counted in its final role in ``peak()``.

The bookkeeping (records, totals, peak) is ``memory.ledger.StorageLedger``; this module feeds it.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from fsdp_lab.memory import tags
from fsdp_lab.memory.ownership import reachable_storage_ids
from fsdp_lab.memory.results import MemoryResult, cuda_stats, format_rows, merge_ranks  # noqa: F401
from fsdp_lab.memory.ledger import SAVED_BECOME_ACTIVATIONS, StorageLedger

# ops after which a known storage may have changed size
_RESIZING_OPS = {torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage,
                 torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.set_.source_Tensor}
# tensor types that wrap inner tensors (DTensor, NF4): the tracker sees their inner ops instead
_WRAPPER_TYPES: dict[type, bool] = {}
# ops whose output is a view of their input: nothing new to count
_PASSTHROUGH_OPS = {torch.ops.aten.detach.default}



class _Saved:
    """A tensor held by autograd for backward; its death tells the tracker it was released."""

    __slots__ = ("tensor", "info", "tracker")

    def __init__(self, tensor, info, tracker):
        self.tensor, self.info, self.tracker = tensor, info, tracker

    def __del__(self):
        tracker = self.tracker
        # the info may belong to an earlier run of the tracker (it resets on enter)
        if tracker is not None and tracker._live.get(self.info.key) is self.info:
            tracker._change(self.info, saved_delta=-1)


def _is_plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not hasattr(type(t), "__tensor_flatten__")


class MemoryTracker(StorageLedger, TorchDispatchMode):
    """Measure memory by category over one (or a few) training steps.

        with MemoryTracker(model, optimizer) as mt:
            model(batch).loss.backward(); optimizer.step()
        mt.peak(); mt.current(); mt.timeline(); mt.result()

    Args:
        model: the module whose parameters (and ``.grad``) are ``params``/``grads``; its
            children and the elements of its ModuleLists (``layers.0`` ...) mark phase
            boundaries in forward and backward. May be None.
        optimizer: its ``state`` tensors are ``optimizer_state``; its ``step`` is a phase.
        device: count only storages on this device (default: the model's parameter device,
            else cpu). Fake tensors count as the device they pretend to be on.
        phase_modules: names of submodules that mark phases (default: see ``model``).

    Raises ValueError for a ``phase_modules`` name the model does not have, or a CUDA
    ``device`` when this process sees no GPU.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 *, device: torch.device | str | None = None, phase_modules: Iterable[str] | None = None):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        if device is None:
            param = next(iter(model.parameters()), None) if model is not None else None
            device = param.device if param is not None else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"MemoryTracker(device={str(device)!r}) but this process sees no CUDA GPU "
                             f"(torch {torch.__version__}); leave device out to track the model's own "
                             "device, or pass device='cpu'")
        self._device_type = self.device.type
        modules = _modules_by_name(model) if model is not None else {}
        if phase_modules is None:
            phase_modules = [n for n, m in modules.items() if n and _is_phase_module(n, m, modules)]
        missing = [n for n in phase_modules if n not in modules]
        if missing:
            raise ValueError(f"phase_modules {missing} are not submodules of the model; "
                             f"use names from model.named_modules()")
        self._phase_modules = [(n, modules[n]) for n in phase_modules]
        self._reset()

    # ---- bookkeeping -------------------------------------------------------------------

    def _reset(self) -> None:
        self._reset_ledger()
        self._timeline: list[tuple[str, dict[str, int]]] = []
        self._handles: list = []
        self._buffer_keys: set[int] = set()
        self._cuda: dict[str, int] = {}
        self._active = False

    def _classify(self, tensors: Iterable[torch.Tensor], base: str) -> None:
        """Register or move the storages of ``tensors`` to ``base`` (explicit tags still win)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for inner in _plain_tensors(t):
                info = self._see(inner, base)
                if info is not None and info.base != base and not _tagged(inner):
                    self._change(info, base=base)

    def _on_tag(self, st, category: str) -> None:
        """A storage was tagged while tracking: count it in its new role from now on."""
        if st.device.type != self._device_type:
            return
        info = self._live.get(st._cdata)
        if info is None:
            self._see_storage(st, category)
        elif info.base != category:
            self._change(info, base=category)

    def _mark(self, label: str) -> None:
        """A phase boundary: record a timeline point."""
        if not self._active:  # a tensor hook firing after the tracker exited
            return
        self._label = label
        self._timeline.append((label, dict(self._totals)))

    # ---- hooks -------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        # a storage no op has shown yet existed before tracking (the batch's input ids, which the
        # embedding saves before any op reads them): ``other``, as an op's unseen input would be
        info = self._see(t, "other") if _is_plain(t) else None
        counts = info is not None and info.base in SAVED_BECOME_ACTIVATIONS and info.key not in self._buffer_keys
        if not counts:
            if info is None or t.grad_fn is None:
                # a tensor without grad_fn can be kept as it is (no cycle through autograd's
                # graph), sparing a detach per save
                return t
            return _Saved(t.detach(), info, None)
        self._change(info, saved_delta=1)
        return _Saved(t.detach(), info, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _install_hooks(self) -> None:
        in_backward = torch._C._current_graph_task_id

        def fwd_pre(name):
            def hook(module, args):
                if in_backward() != -1:
                    return
                self._mark(f"forward {name} start")
                grad_in = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
                if grad_in is not None:
                    grad_in.register_hook(lambda g: self._mark(f"backward {name} end"))
            return hook

        def fwd_post(name):
            def hook(module, args, output):
                if in_backward() != -1:
                    self._mark(f"recompute {name}")
                    return
                self._mark(f"forward {name} end")
                out = output if isinstance(output, torch.Tensor) else None
                if out is None and isinstance(output, (tuple, list)):
                    out = next((o for o in output if isinstance(o, torch.Tensor)), None)
                if out is not None and out.requires_grad:
                    out.register_hook(lambda g: self._mark(f"backward {name} start"))
            return hook

        for name, module in self._phase_modules:
            self._handles.append(module.register_forward_pre_hook(fwd_pre(name)))
            self._handles.append(module.register_forward_hook(fwd_post(name)))
        if self.model is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p: self._classify([p.grad], "grads")))
        if self.optimizer is not None:
            def step_pre(opt, args, kwargs):
                self._mark("optimizer step start")

            def step_post(opt, args, kwargs):
                self._classify(_state_tensors(opt), "optimizer_state")
                self._mark("optimizer step end")
            self._handles.append(self.optimizer.register_step_pre_hook(step_pre))
            self._handles.append(self.optimizer.register_step_post_hook(step_post))

    def _register_existing(self) -> None:
        if self.model is not None:
            self._classify(self.model.parameters(), "params")
            self._classify([p.grad for p in self.model.parameters() if p.grad is not None], "grads")
            self._classify(self.model.buffers(), "other")
            # a buffer autograd saves (RoPE tables) is the model's, not this step's activations
            self._buffer_keys = {t.untyped_storage()._cdata for t in self.model.buffers() if _is_plain(t)
                                 and t.device.type != "meta"}
        if self.optimizer is not None:
            self._classify(_state_tensors(self.optimizer), "optimizer_state")
        # tagged storages of the tracked model only: a model dropped earlier but not yet
        # collected, or another live model, holds tagged storages too
        owned = reachable_storage_ids([self.model, self.optimizer]) if tags._tags else set()
        for st, cat in list(tags._tags.items()):
            if st.device.type == self._device_type and st._cdata in owned:
                self._see_storage(st, cat)

    # ---- context manager ---------------------------------------------------------------

    def __enter__(self):
        self._reset()
        self._active = True
        # fake tensors are the measurement when the caller runs under FakeTensorMode; otherwise
        # they are some library's internal tracing and hold no memory
        self._count_fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        self._register_existing()
        self._install_hooks()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        def resize_(storage, size):
            result = orig(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        if self._device_type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        tags.add_listener(self._on_tag)
        self._mark("start")
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        tags.remove_listener(self._on_tag)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._saved_hooks.__exit__(*exc)
        self._saved_hooks = None  # it holds this tracker's bound methods: a cycle through the model
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.model is not None:
            self._classify([p.grad for p in self.model.parameters() if p.grad is not None], "grads")
        if self.optimizer is not None:
            self._classify(_state_tensors(self.optimizer), "optimizer_state")
        self._mark("end")
        self._active = False
        if self._device_type == "cuda":
            self._cuda = cuda_stats(self.device, self._peak_total)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let tensor subclasses (DTensor, NF4) unwrap first; their inner ops come back here.
        for t in types:
            wrapper = _WRAPPER_TYPES.get(t)
            if wrapper is None:
                wrapper = _WRAPPER_TYPES[t] = hasattr(t, "__tensor_flatten__")
            if wrapper:
                return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in _PASSTHROUGH_OPS:
            return out
        see, live = self._see, self._live
        for a in args:  # a storage unknown here existed before tracking (the batch, ...)
            if isinstance(a, torch.Tensor):
                try:
                    known = a.untyped_storage()._cdata in live
                except (RuntimeError, NotImplementedError):  # sparse, nested: nothing to count
                    known = True
                if not known:
                    see(a, "other")
            elif type(a) in (list, tuple):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        see(x, "other")
        if isinstance(out, torch.Tensor):
            see(out, None, True)
        elif type(out) in (list, tuple):
            for x in out:
                if isinstance(x, torch.Tensor):
                    see(x, None, True)
        if func in _RESIZING_OPS:
            self._resized(args[0].untyped_storage())
        return out

    # ---- results -----------------------------------------------------------------------

    def timeline(self) -> list[tuple[str, dict[str, int]]]:
        """[(label, {category: bytes})] at each phase boundary ("forward layers.0 start",
        "backward layers.0 end", "optimizer step end" ...), in order."""
        return [(label, dict(snap)) for label, snap in self._timeline]

    def result(self) -> MemoryResult:
        """Everything measured, as a picklable MemoryResult."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return MemoryResult(rank=rank, device=str(self.device), peak=self.peak(),
                            peak_label=self._peak_label, current=self.current(),
                            timeline=self.timeline(), max_by_category=self.max_by_category(),
                            cuda=dict(self._cuda))


def _modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """``model.named_modules()`` plus the same names without FSDP1's ``_fsdp_wrapped_module``
    step, so ``layers.0`` is found in a wrapped model too (the outer wrapper, whose forward
    includes the all-gather, wins over the module it wraps)."""
    named = dict(model.named_modules())
    clean: dict[str, nn.Module] = {}
    for name, module in named.items():
        short = name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module").rstrip(".")
        clean.setdefault(short, module)
    return clean | named


def _is_phase_module(name: str, module: nn.Module, modules: dict[str, nn.Module]) -> bool:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or "_fsdp_wrapped_module" in name:
        return False
    parent = name.rpartition(".")[0]
    if not parent:
        return True
    return "." not in parent and isinstance(modules.get(parent), (nn.ModuleList, nn.ModuleDict))


def _plain_tensors(t) -> list[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return []
    if type(t).__name__ == "DTensor":
        return _plain_tensors(t._local_tensor)
    if hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain_tensors(getattr(t, n))]
    return [t]


def _tagged(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and tags.category_of(t.untyped_storage()) is not None


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
