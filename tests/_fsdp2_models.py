"""The models and training loops of tests/test_fsdp2.py, shared by its ranks and its host side.

The test Llama's configuration, the ``Uneven`` model, the ``Int8Rows`` all-gather extension
and its quantized model, ``_train`` (the training loop every rank and every single-process
reference runs), the collective counter and ``_shard_llama``. What each rank runs is in
tests/_fsdp2_parts.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

STEPS = 5
GLOBAL_BATCH, SEQ = 4, 16
LR = 1e-3
# Adam divides by sqrt(v) + eps: with a tiny eps, gradients near zero turn the round-off of
# summing per-rank gradients (instead of one batch) into visible parameter differences.
EPS = 1e-4
CONFIG = dict(n_layers=2)


def _config(tied=False):
    return LlamaConfig.from_name("cpu-tied" if tied else "cpu", **CONFIG)


def _freeze(model):
    """A frozen subset mixed with trainable parameters in the same groups."""
    for name, p in model.named_parameters():
        if ".attention.wq" in name or ".attention.wk" in name or name.endswith("attention_norm.weight"):
            p.requires_grad_(False)


class Uneven(nn.Module):
    """Shapes that do not divide by 2 or 4: a 5x3 weight, a bias of 7, a 7x5 weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 7)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Int8Rows(torch.Tensor):
    """A small quantized weight for the all-gather extension: int8 codes + one fp32 scale per row.

    Any op dequantizes it. ``fsdp_shard`` pads rows to ``ceil(rows / world)`` per rank;
    ``fsdp_pre_all_gather`` sends codes and scales (not floats); ``fsdp_post_all_gather``
    builds an ``Int8Rows`` of the full shape on the gathered buffers themselves.
    """

    @staticmethod
    def __new__(cls, codes, scales, shape, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scales, shape, dtype=torch.float32):
        self.codes, self.scales = codes, scales

    @classmethod
    def quantize(cls, weight):
        scales = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        return cls(torch.round(weight / scales).to(torch.int8), scales, weight.shape)

    def dequantize(self):
        return (self.codes.float() * self.scales)[: self.shape[0]].to(self.dtype)

    def __tensor_flatten__(self):
        return ["codes", "scales"], (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Rows(inner["codes"], inner["scales"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return Int8Rows(args[0].codes, args[0].scales, args[0].shape, args[0].dtype)
        unwrap = lambda x: x.dequantize() if isinstance(x, Int8Rows) else x  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))

    def fsdp_shard(self, rank, world_size):
        rows = -(-self.shape[0] // world_size)
        codes = torch.zeros(rows, self.shape[1], dtype=torch.int8)
        scales = torch.ones(rows, 1)
        mine = self.codes[rank * rows:(rank + 1) * rows]
        codes[: mine.shape[0]] = mine
        scales[: mine.shape[0]] = self.scales[rank * rows:(rank + 1) * rows]
        return Int8Rows(codes, scales, (rows, self.shape[1]), self.dtype)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.codes, self.scales), (tuple(outer_size),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None  # out's codes and scales are the refilled all-gather outputs
        codes, scales = outputs
        return Int8Rows(codes, scales, metadata[0], param_dtype), (codes, scales)


def _quantized_model():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))
    model[0].weight = nn.Parameter(Int8Rows.quantize(model[0].weight.detach()), requires_grad=False)
    return model


def _plain_quantized_model():
    model = _quantized_model()
    model[0].weight = nn.Parameter(model[0].weight.dequantize(), requires_grad=False)
    return model


def _quant_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train_quantized(model, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    rows = 4 // world
    for step in range(STEPS):
        x, y = _quant_batch(step)
        nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()


def _uneven_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=g), torch.randn(4, 7, generator=g)


def _train(model, rank, world, *, accum=1, sync_every_micro=True, steps=STEPS, uneven=False, after_step=None):
    """5 AdamW steps; returns the per-step losses of this rank (mean over microbatches).
    ``after_step(step)`` runs after each optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            last = micro == accum - 1
            if hasattr(model, "set_requires_gradient_sync") and not sync_every_micro:
                model.set_requires_gradient_sync(last)
            if uneven:
                x, y = _uneven_batch(step * accum + micro)
                rows = x.shape[0] // world
                loss = nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]),
                                              y[rank * rows:(rank + 1) * rows])
            else:
                batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=step * accum + micro), rank, world)
                loss = model(batch.input_ids, batch.labels).loss
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / accum)
        if after_step is not None:
            after_step(step)
    return losses


class _CountCollectives:
    """A collectives recorder that only counts calls by name (the CommDebugMode pattern)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def mark(self):
        return None

    def record_comm(self, start, name, nbytes, *, lane, **args):
        self.counts[name] = self.counts.get(name, 0) + 1

    def open_comm(self, start, name, nbytes, *, lane, **args):
        self.record_comm(start, name, nbytes, lane=lane)
        return self

    def close_on_completion(self, works):
        pass

    def close(self):
        pass


def _train_step_by_step(model, rank, world, full_params):
    """Train like ``_train``, keeping the full parameters and the collectives of every step."""
    from fsdp_lab import collectives

    counter, per_step, params = _CountCollectives(), [], []
    seen = {}

    def after_step(step):
        per_step.append({k: v - seen.get(k, 0) for k, v in counter.counts.items()})
        params.append(full_params(model))  # its own all-gathers are taken out of the next step's counts
        seen.clear()
        seen.update(counter.counts)

    collectives.add_recorder(counter)
    try:
        losses = _train(model, rank, world, after_step=after_step)
    finally:
        collectives.remove_recorder(counter)
    return losses, params, per_step


def _shard_llama(model, fully_shard, tied=False, **kwargs):
    if tied:
        fully_shard([model.tok_embeddings, model.output], **kwargs)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


class EnergyLlama(Llama):
    """The test Llama with a second entry point that uses the root's own parameters
    (embedding, final norm) without calling ``forward``."""

    def hidden_energy(self, input_ids):
        cos, sin = self.rope_cos[:input_ids.shape[1]], self.rope_sin[:input_ids.shape[1]]
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h).pow(2).mean()


def _train_two_entry_points(model, rank, world, steps=3):
    """Each step: ``hidden_energy`` plus the language-model loss, one backward."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        batch = shard_batch(global_batch(model.config.vocab_size, GLOBAL_BATCH, SEQ, step=step), rank, world)
        (model.hidden_energy(batch.input_ids) + model(batch).loss).backward()
        optimizer.step()
        optimizer.zero_grad()


def two_forwards_one_backward(model, rank, world, steps=3):
    """Each step: the losses of two batches summed, one backward (a module's backward runs twice)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    for step in range(steps):
        first, second = (shard_batch(global_batch(model.config.vocab_size, GLOBAL_BATCH, SEQ, step=s), rank, world)
                         for s in (step, step + steps))
        (model(first).loss + model(second).loss).backward()
        optimizer.step()
        optimizer.zero_grad()
