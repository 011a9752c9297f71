"""What both memory trackers share: the model and optimizer they watch, the hooks that mark
phase boundaries and give gradients and optimizer state their roles, and the results.

``MemoryTracker`` (``memory.tracker``, fed by dispatch) and ``AllocatorTracker``
(``memory.allocator_tracker``, fed by the allocators' reports) subclass ``TrackerBase`` and
supply how a storage is registered or moved to a role (``_classify``, ``_see_storage``, ``_on_tag``),
what identifies a storage in their ledger (``_key_of``), what a saved tensor and a storage resize
do (``_pack``/``_unpack``, the ``resize_`` wrapper), ``_mark`` where marks are not immediate, and
their ``__enter__``/``__exit__``, built from ``_hook_in``, ``_unhook`` and ``_finish`` here. The bookkeeping is ``memory.ledger.StorageLedger``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_lab.checks import check_model_and_optimizer
from fsdp_lab.memory import tags
from fsdp_lab.memory.ledger import StorageLedger
from fsdp_lab.memory.ownership import reachable_storage_ids
from fsdp_lab.memory.results import MemoryResult, cuda_stats


class TrackerBase(StorageLedger):
    """The model, optimizer, device and phase modules of a tracker, and what it hooks into them
    (arguments: see ``MemoryTracker``).

    Raises ValueError for a ``phase_modules`` name the model does not have, or a CUDA ``device``
    when this process sees no GPU; TypeError when ``model`` is not a module or ``optimizer`` not
    an optimizer.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 *, device: torch.device | str | None = None, phase_modules: Iterable[str] | None = None):
        super().__init__()
        check_model_and_optimizer("MemoryTracker", model, optimizer)
        self.model, self.optimizer = model, optimizer
        inferred = device is None
        if inferred:
            param = next(iter(model.parameters()), None) if model is not None else None
            device = param.device if param is not None else "cpu"
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError(
                ("the model's parameters are on the meta device, which holds no bytes: give them memory "
                 "first (model.to_empty(device=...)), build the model under FakeTensorMode to measure "
                 "without memory, or pass device=") if inferred else
                ("MemoryTracker(device='meta'): meta tensors hold no bytes; under FakeTensorMode a fake "
                 "tensor counts as the device it stands for (leave device out, or name that one)"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"MemoryTracker(device={str(device)!r}) but this process sees no CUDA GPU "
                             f"(torch {torch.__version__}); leave device out to track the model's own "
                             "device, or pass device='cpu'")
        self._device_type = self.device.type
        modules = _modules_by_name(model) if model is not None else {}
        if phase_modules is None:
            phase_modules = [n for n, m in modules.items() if n and _is_phase_module(n, m, modules)]
        elif isinstance(phase_modules, str):  # one name, not its letters
            phase_modules = [phase_modules]
        missing = [n for n in phase_modules if n not in modules]
        if missing:
            raise ValueError(f"phase_modules {missing} are not submodules of the model; "
                             f"use names from model.named_modules()")
        self._phase_modules = [(n, modules[n]) for n in phase_modules]
        self._ran = False  # set by __enter__: results before it would be zeros that measured nothing
        self._reset()

    # ---- bookkeeping -------------------------------------------------------------------

    def _reset(self) -> None:
        self._reset_ledger()
        self._timeline: list[tuple[str, dict[str, int]]] = []
        self._handles: list = []
        self._buffer_keys: set[int] = set()
        self._params: list = []  # the model's parameters as the tracker started (one walk of the model)
        self._cuda: dict[str, int] = {}
        self._grad_marks = WeakIdKeyDictionary()  # tensor -> [(ends, label)] marked when its gradient arrives
        self._active = False

    # called with the innermost tag_scope category whenever one opens or closes (None: the
    # tracker reads ``tags.current_scope()`` itself when it needs it)
    _on_scope = None

    def _before_results(self) -> None:
        """Run before every result is read. Raises RuntimeError before the tracker has run (its
        zeros would read as a step that used no memory); a source that books elsewhere brings
        its figures in here too."""
        if not self._ran:
            raise RuntimeError("this MemoryTracker has not measured anything yet: run the step inside "
                               "`with MemoryTracker(model, optimizer) as mt:`, then read mt.peak(), mt.result() ...")

    def peak(self) -> dict[str, int]:
        self._before_results()
        return super().peak()

    def peak_total(self) -> int:
        self._before_results()
        return super().peak_total()

    def current(self) -> dict[str, int]:
        self._before_results()
        return super().current()

    def max_by_category(self) -> dict[str, int]:
        self._before_results()
        return super().max_by_category()

    def _check_not_running(self) -> None:
        """Raise RuntimeError when this tracker is inside its ``with`` block already (entering
        it again would unhook the running measurement's hooks from under it)."""
        if self._active:
            raise RuntimeError(
                "this MemoryTracker is already running: a tracker measures one `with` block at a "
                "time; to measure an inner block too, make a second MemoryTracker for it "
                "(source='dispatch' trackers nest; one source='allocator' tracker runs at a time)")

    def _tracks(self, storage) -> bool:
        """Whether ``storage`` is on the tracked device (a fake tensor's storage is on "meta"
        and counts when the tracker counts fake tensors)."""
        device = storage.device.type
        return device == self._device_type or (device == "meta" and self._count_fake)

    @staticmethod
    def _key_of(storage) -> int:
        """What identifies a storage in this tracker's ledger."""
        return storage._cdata

    def _mark(self, label: str) -> None:
        """A phase boundary: record a timeline point."""
        if not self._active:  # a tensor hook firing after the tracker exited
            return
        self._label = label
        self._timeline.append((label, dict(self._totals)))

    # ---- hooks -------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        in_backward = torch._C._current_graph_task_id

        def fwd_pre(name):
            def hook(module, args):
                if in_backward() != -1:
                    return
                self._mark(f"forward {name} start")
                grad_in = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
                if grad_in is not None:
                    self._mark_when_grad_arrives(grad_in, f"backward {name} end", ends=True)
            return hook

        def fwd_post(name):
            def hook(module, args, output):
                if in_backward() != -1:
                    self._mark(f"recompute {name}")
                    return
                self._mark(f"forward {name} end")
                out = output if isinstance(output, torch.Tensor) else None
                if out is None and isinstance(output, (tuple, list, Mapping)):  # a Hugging Face output too
                    values = output.values() if isinstance(output, Mapping) else output
                    out = next((o for o in values if isinstance(o, torch.Tensor) and o.requires_grad), None)
                if out is not None and out.requires_grad:
                    self._mark_when_grad_arrives(out, f"backward {name} start", ends=False)
            return hook

        for name, module in self._phase_modules:
            self._handles.append(module.register_forward_pre_hook(fwd_pre(name)))
            self._handles.append(module.register_forward_hook(fwd_post(name)))
        if self.model is not None:
            for p in self._params:
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

    def _mark_when_grad_arrives(self, tensor: torch.Tensor, label: str, *, ends: bool) -> None:
        """Mark ``label`` when ``tensor``'s gradient arrives. One module's output is often the next
        one's input, so one gradient can end the later module's backward and start the earlier
        one's: one hook per tensor marks its ends before its starts (hooks of one tensor would fire
        in the order forward registered them, the start first)."""
        marks = self._grad_marks.get(tensor)
        if marks is None:
            marks = self._grad_marks[tensor] = []

            def mark_all(grad):
                for _, each in sorted(marks, key=lambda m: not m[0]):
                    self._mark(each)
            tensor.register_hook(mark_all)
        marks.append((ends, label))

    def _register_existing(self) -> None:
        # runs at every tracker's start, before ``_install_hooks``: each list of the model's
        # tensors is walked once
        if self.model is not None:
            params = self._params = list(self.model.parameters())
            buffers = list(self.model.buffers())
            self._classify(params, "params")
            self._classify([p.grad for p in params if p.grad is not None], "grads")
            self._classify(buffers, "other")
            # a buffer autograd saves (RoPE tables) is the model's, not this step's activations
            self._buffer_keys = {self._key_of(t.untyped_storage()) for t in buffers if _is_plain(t)
                                 and t.device.type != "meta"}
        if self.optimizer is not None:
            self._classify(_state_tensors(self.optimizer), "optimizer_state")
        # tagged storages of the tracked model only: a model dropped earlier but not yet
        # collected, or another live model, holds tagged storages too
        owned = reachable_storage_ids([self.model, self.optimizer]) if tags._tags else set()
        for st, cat in list(tags._tags.items()):
            if self._tracks(st) and st._cdata in owned:
                self._see_storage(st, cat)

    # ---- entering and leaving ----------------------------------------------------------

    def _hook_in(self, wrap_resize: Callable[[Callable], Callable]) -> None:
        """Install the saved-tensor hooks (``_pack``/``_unpack``), ``wrap_resize(original)`` in
        place of ``UntypedStorage.resize_`` (how FSDP frees and refills unsharded parameters,
        which dispatch does not see), the tag listener, and on CUDA start the allocator's peak
        here. ``_unhook`` removes them, and the model and optimizer hooks."""
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._orig_resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = wrap_resize(self._orig_resize)
        tags.add_listener(self._on_tag, self._on_scope)
        if self._device_type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _unhook(self, exc) -> None:
        tags.remove_listener(self._on_tag)
        torch.UntypedStorage.resize_ = self._orig_resize
        self._saved_hooks.__exit__(*exc)
        self._saved_hooks = None  # it holds this tracker's bound methods: a cycle through the model
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _finish(self) -> None:
        """After the step: gradients and optimizer state in their roles as they are now (FSDP
        assigns sharded gradients without the accumulation hook), the end mark, and on CUDA the
        allocator's own figures."""
        if self.model is not None:
            self._classify([p.grad for p in self._params if p.grad is not None], "grads")
        if self.optimizer is not None:
            self._classify(_state_tensors(self.optimizer), "optimizer_state")
        self._mark("end")
        self._active = False
        if self._device_type == "cuda":
            self._cuda = cuda_stats(self.device, self.peak_total())

    # ---- results -----------------------------------------------------------------------

    def timeline(self) -> list[tuple[str, dict[str, int]]]:
        """[(label, {category: bytes})] at each phase boundary ("forward layers.0 start",
        "backward layers.0 end", "optimizer step end" ...), in order. This and the other results
        raise RuntimeError before the tracker has run."""
        self._before_results()
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


def _is_plain(t) -> bool:
    return isinstance(t, torch.Tensor) and not hasattr(type(t), "__tensor_flatten__")
