"""Data parallelism built by hand: DDP, then ZeRO-1, ZeRO-2 and ZeRO-3, on ``fsdp_lab.collectives``.

Lab 03 has the learner write these four classes; they are also fsdp_lab's reference, which the
lab measures beside the learner's. Every stage shares one training step (``DataParallel.step``)
and differs only in what it keeps whole, what it shards, and where it communicates:

=========  =====================  ======================  ==============================
stage      parameters             gradients               optimizer state
=========  =====================  ======================  ==============================
DDP        whole                  whole, all-reduced      whole
ZeRO-1     whole                  whole, reduce-scattered 1/N (this rank's slice)
ZeRO-2     whole                  1/N, reduce-scattered   1/N
                                  as each one is ready
ZeRO-3     1/N, all-gathered per  1/N                     1/N
           unit for forward and
           again for backward
=========  =====================  ======================  ==============================

A rank's slice of a parameter is a contiguous 1/N of its flattened elements (``my_slice``);
every parameter's element count must be divisible by the world size (the small Llamas of the
labs are). The stage names and the memory arithmetic are those of the ZeRO paper (Rajbhandari
et al., 2020); ZeRO-3's hooks follow the pattern of fairscale's and PyTorch's FSDP, without
their flat parameters, prefetching or mixed precision.

The ``### BEGIN SOLUTION`` / ``### END SOLUTION`` / ``### STUB`` comments mark what the
learner writes: ``labs/src/nbbuild.py`` turns each class into the lab's exercise (the marked
lines replaced by the ``### STUB`` lines) and into its solution (the markers dropped).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import collectives
from fsdp_lab.memory.tags import tag
from fsdp_lab.timeline import default_units

LR, EPS = 1e-3, 1e-5  # AdamW's; eps well above float32 round-off, so AdamW does not amplify it


def free_storage(tensor: torch.Tensor) -> None:
    """Release the memory behind ``tensor`` but keep the tensor (shape, dtype, its place in
    autograd's saved tensors): its storage shrinks to 0 bytes. PyTorch's FSDP frees this way."""
    tensor.untyped_storage().resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor`` back its full storage (contents undefined until written)."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class DataParallel:
    """The training step every stage shares; subclasses decide where communication goes.

    ``step(batch)``: forward, backward, ``after_backward()``, ``optimizer.step()``, zero the
    gradients, ``after_step()``; returns this rank's loss. ``setup()`` runs once at the end of
    ``__init__`` and must set ``self.optimizer``. A stage that shards keeps ``self.shards``:
    ``self.shards[i]`` is this rank's slice of ``self.params[i]`` (``my_slice``), the tensor its
    optimizer steps.

    Raises ValueError when a parameter's element count is not divisible by the world size.
    """

    name = "DDP (base)"

    def __init__(self, model: nn.Module, *, lr: float = LR, eps: float = EPS):
        self.model = model
        self.params = list(model.parameters())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lr, self.eps = lr, eps
        self.shards: list[torch.Tensor] | None = None
        uneven = [n for n, p in model.named_parameters() if p.numel() % self.world]
        if uneven:
            raise ValueError(f"{', '.join(uneven)}: element counts not divisible by the world size "
                             f"{self.world}; use a model whose sizes are multiples of it")
        self.setup()

    def make_optimizer(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        """AdamW over ``tensors`` with the lab's learning rate and eps."""
        return torch.optim.AdamW(tensors, lr=self.lr, eps=self.eps)

    def my_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/N of ``tensor``'s elements, as a 1-D view (no copy)."""
        flat = tensor.reshape(-1)
        size = flat.numel() // self.world
        return flat[self.rank * size:(self.rank + 1) * size]

    def new_grad_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped like ``shard`` for its reduced gradient (memory category
        ``sharded_grads``)."""
        return tag(torch.empty_like(shard), "sharded_grads")

    def param_shard(self, param: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's slice of ``param``, a leaf that requires grad: the tensor a
        ZeRO-3 optimizer steps (category ``sharded_params``). ``param``'s own storage is tagged
        ``unsharded_params``: it is the all-gather output whenever the parameter is whole."""
        tag(param, "unsharded_params")
        return tag(self.my_slice(param.data).clone(), "sharded_params").requires_grad_()

    def units(self) -> list[nn.Module]:
        """The modules gathered and freed as one (ZeRO-3): the model's children, each block
        of a ModuleList on its own (embeddings, layers.0, layers.1, ..., norm, output)."""
        return [module for _, module in default_units(self.model)]

    def setup(self) -> None:
        self.optimizer = self.make_optimizer(self.params)

    def step(self, batch) -> torch.Tensor:
        loss = self.model(batch).loss
        loss.backward()
        self.after_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.after_step()
        return loss.detach()

    def after_backward(self) -> None:
        """Runs after ``loss.backward()``, before the optimizer step."""

    def after_step(self) -> None:
        """Runs after the optimizer step."""

    def full_parameters(self, from_shards: bool = False) -> dict[str, torch.Tensor]:
        """{name: a copy of the whole parameter}: the parameter itself, or, with
        ``from_shards`` or when its storage is freed, the all-gather of ``self.shards`` (what a
        ZeRO-3 forward would gather next). Every rank must call this together.

        Raises ValueError when a shard is needed and ``self.shards`` was never set."""
        out = {}
        for i, (name, p) in enumerate(self.model.named_parameters()):
            if not from_shards and p.untyped_storage().nbytes() >= p.numel() * p.element_size():
                out[name] = p.detach().clone()
            else:
                if self.shards is None:
                    raise ValueError("self.shards is not set: keep this rank's shard of every parameter "
                                     "in self.shards (a list in model order) in setup(), as ZeRO-1 does")
                whole = torch.empty(p.numel(), dtype=p.dtype)
                collectives.all_gather_into_tensor(whole, self.shards[i].detach())
                out[name] = whole.view(p.shape)
        return out


class DDP(DataParallel):
    """Stage 0: every rank holds everything; after backward each gradient is averaged over
    the ranks with one all-reduce, so every rank takes the same optimizer step."""

    name = "DDP"

    def after_backward(self):
        ### BEGIN SOLUTION
        for p in self.params:
            collectives.all_reduce(p.grad, op="avg")
        ### END SOLUTION
        ### STUB raise NotImplementedError("average every p.grad over the ranks (one all_reduce per parameter)")


class ZeRO1(DataParallel):
    """ZeRO-1: the optimizer state is sharded. Each rank's AdamW steps only its slice of each
    parameter, so it keeps 1/N of the moments. After backward each whole gradient is
    reduce-scattered (a rank needs only its slice of the average); after the step the updated
    slices are all-gathered back into the whole parameters."""

    name = "ZeRO-1"

    def setup(self):
        ### BEGIN SOLUTION
        self.shards = [self.my_slice(p.data).requires_grad_() for p in self.params]
        self.optimizer = self.make_optimizer(self.shards)
        ### END SOLUTION
        ### STUB raise NotImplementedError("self.shards: this rank's slice of each parameter; self.optimizer over them")

    def after_backward(self):
        ### BEGIN SOLUTION
        for p, shard in zip(self.params, self.shards):
            shard.grad = self.new_grad_shard(shard)
            collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
            p.grad = None
        ### END SOLUTION
        ### STUB raise NotImplementedError("reduce-scatter (average) each p.grad into its shard's .grad; drop p.grad")

    def after_step(self):
        ### BEGIN SOLUTION
        for p, shard in zip(self.params, self.shards):
            collectives.all_gather_into_tensor(p.data.reshape(-1), shard.detach().clone())
        ### END SOLUTION
        ### STUB raise NotImplementedError("all-gather every rank's updated slice back into each whole parameter")


class ZeRO2(DataParallel):
    """ZeRO-2: gradients are sharded too. Each gradient is reduce-scattered the moment
    backward has finished it (a post-accumulate-grad hook) and the whole gradient is dropped
    at once, so only one whole gradient at a time lives beside the 1/N slices."""

    name = "ZeRO-2"

    def setup(self):
        ### BEGIN SOLUTION
        self.shards = [self.my_slice(p.data).requires_grad_() for p in self.params]
        self.optimizer = self.make_optimizer(self.shards)
        for p, shard in zip(self.params, self.shards):
            p.register_post_accumulate_grad_hook(functools.partial(self.reduce_gradient, shard))
        ### END SOLUTION
        ### STUB raise NotImplementedError("shards and optimizer as in ZeRO-1, and a post-accumulate-grad hook on each parameter")

    def reduce_gradient(self, shard, p):
        ### BEGIN SOLUTION
        shard.grad = self.new_grad_shard(shard)
        collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
        p.grad = None
        ### END SOLUTION
        ### STUB raise NotImplementedError("reduce-scatter (average) p.grad into shard.grad, then drop p.grad")

    def after_step(self):
        ### BEGIN SOLUTION
        for p, shard in zip(self.params, self.shards):
            collectives.all_gather_into_tensor(p.data.reshape(-1), shard.detach().clone())
        ### END SOLUTION
        ### STUB raise NotImplementedError("all-gather the updated slices, as in ZeRO-1")


class ZeRO3(DataParallel):
    """ZeRO-3 (what FSDP's FULL_SHARD does): parameters are sharded too. Between uses a
    parameter holds no memory; each unit all-gathers its parameters in a forward pre-hook,
    frees them after its forward, gathers them again in a backward pre-hook, and each
    gradient is reduce-scattered (and its parameter freed) as soon as backward finishes it.
    The optimizer steps the slices; nothing is gathered after the step."""

    name = "ZeRO-3"

    def setup(self):
        ### BEGIN SOLUTION
        self.shards = [self.param_shard(p) for p in self.params]
        self.shard_of = dict(zip(self.params, self.shards))
        for p, shard in zip(self.params, self.shards):
            free_storage(p)
            p.register_post_accumulate_grad_hook(functools.partial(self.reduce_gradient, shard))
        self.optimizer = self.make_optimizer(self.shards)
        for unit in self.units():
            unit.register_forward_pre_hook(lambda module, args: self.gather(module))
            unit.register_forward_hook(lambda module, args, output: self.free(module))
            unit.register_full_backward_pre_hook(lambda module, grad_output: self.gather(module))
        ### END SOLUTION
        ### STUB raise NotImplementedError("shards (self.param_shard), free every parameter, hook its gradient; "
        ### STUB                           "an optimizer over the shards; three hooks on every unit")

    def gather(self, unit):
        ### BEGIN SOLUTION
        for p in unit.parameters():
            alloc_storage(p)
            collectives.all_gather_into_tensor(p.data.reshape(-1), self.shard_of[p].detach())
        ### END SOLUTION
        ### STUB raise NotImplementedError("for each parameter of the unit: alloc_storage, then all-gather the slices into it")

    def free(self, unit):
        ### BEGIN SOLUTION
        for p in unit.parameters():
            free_storage(p)
        ### END SOLUTION
        ### STUB raise NotImplementedError("free the storage of each parameter of the unit")

    def reduce_gradient(self, shard, p):
        ### BEGIN SOLUTION
        shard.grad = self.new_grad_shard(shard)
        collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
        p.grad = None
        free_storage(p)
        ### END SOLUTION
        ### STUB raise NotImplementedError("as in ZeRO-2, and free the parameter: backward is done with it")


STAGES = {"DDP": DDP, "ZeRO-1": ZeRO1, "ZeRO-2": ZeRO2, "ZeRO-3": ZeRO3}
