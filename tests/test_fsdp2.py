"""fsdp_lab.fsdp2.fully_shard against plain single-process training and against PyTorch's fully_shard.

One launch per world size (1, 2, 4) runs every configuration and returns a dict; the
references (single-process training of the same model on the same global batch) run once in
this process. Tests then only compare numbers.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.states import ShardedState
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing

WORLD_SIZES = (1, 2, 4)
STEPS = 5
GLOBAL_BATCH, SEQ = 4, 16
LR = 1e-3
# Adam divides by sqrt(v) + eps: with a tiny eps, gradients near zero turn the round-off of
# summing per-rank gradients (instead of one batch) into visible parameter differences.
EPS = 1e-4
TOL = 1e-6  # parameters: max abs difference
LOSS_REL = 1e-6  # losses (~5): float32 round-off of a mean over ranks
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


# -- what every rank runs ------------------------------------------------------------------------
# Each part returns a dict of results. A part that raises leaves its traceback under
# "failed_parts" and the others still run, so one crash fails only the tests that read its keys
# (and test_every_part_ran, which shows the traceback).
def _rank_suite():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [_part_parity, _part_uneven, _part_extension, _part_vs_torch, _part_dcp]
    out = _run_parts(parts)
    if world == 2:
        out["extras"] = _run_parts([_part_memory, _part_prefetch_order, _part_unshard_api, _part_bad_inputs])
    return out if rank == 0 else {"losses_by_config": {k: v["losses"] for k, v in out.items()
                                                       if isinstance(v, dict) and "losses" in v}}


def _run_parts(parts) -> dict:
    import traceback

    out = {"failed_parts": {}}
    for part in parts:
        try:
            out.update(part())
        except Exception:  # noqa: BLE001 - reported by test_every_part_ran
            out["failed_parts"][part.__name__] = traceback.format_exc()
    return out


def _full_params(model):
    from fsdp_lab.fsdp2 import get_full_state_dict

    return dict(get_full_state_dict(model))


def _ours(name, *, tied=False, freeze=False, accum=1, sync_every_micro=True, checkpoint=False,
          step_by_step=False, **kwargs):
    """({name: results}, model): our fully_shard on the test Llama, trained like the reference."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = Llama(_config(tied), seed=0)
    if freeze:
        _freeze(model)
    if checkpoint:
        apply_activation_checkpointing(model)
    _shard_llama(model, fully_shard, tied=tied, **kwargs)
    if step_by_step:
        losses, params, per_step = _train_step_by_step(model, rank, world, _full_params)
        return {name: {"losses": losses, "params": params[-1], "params_per_step": params,
                       "collectives_per_step": per_step}}, model
    losses = _train(model, rank, world, accum=accum, sync_every_micro=sync_every_micro)
    return {name: {"losses": losses, "params": _full_params(model)}}, model


def _part_parity():
    from torch.distributed.tensor import DTensor

    from fsdp_lab.fsdp2 import CPUOffloadPolicy

    out, model = _ours("raf_true", reshard_after_forward=True, step_by_step=True)
    out["is_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["local_shapes"] = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    for name, kwargs in [("raf_false", dict(reshard_after_forward=False, step_by_step=True)),
                         ("default", dict(step_by_step=True)),
                         ("accum_nosync", dict(accum=2, sync_every_micro=False)),
                         ("accum_sync", dict(accum=2)),
                         ("tied", dict(tied=True)),
                         ("frozen", dict(freeze=True)),
                         ("offload", dict(offload_policy=CPUOffloadPolicy())),
                         ("checkpointed", dict(checkpoint=True))]:
        out.update(_ours(name, **kwargs)[0])
    return out


def _part_uneven():
    """Dim-0 sizes that do not divide by the world size."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict

    small = fully_shard(Uneven())
    out = {"uneven_local": {k: tuple(v.to_local().shape) for k, v in small.state_dict().items()},
           "uneven_full_before": get_full_state_dict(small)}
    losses = _train(small, dist.get_rank(), dist.get_world_size(), uneven=True)
    out["uneven"] = {"losses": losses, "params": get_full_state_dict(small)}
    return out


def _part_extension():
    """A tensor subclass that all-gathers int8 codes + scales (the extension point NF4 uses)."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict
    from fsdp_lab.timeline import Timeline

    rank = dist.get_rank()
    quantized = _quantized_model()
    fully_shard(quantized[0])
    fully_shard(quantized)
    with Timeline() as tl:
        _train_quantized(quantized, rank, dist.get_world_size())
    full = get_full_state_dict(quantized)
    return {"extension": {
        "params": {k: v for k, v in full.items() if k != "0.weight"},
        "weight_type": type(quantized[0].weight._local_tensor).__name__,
        "gathers": [(e.bytes, e.args.get("dtype")) for e in tl.comm_events(rank, "all_gather")
                    if e.args.get("module") == "0"],
    }}


def _part_vs_torch():
    """PyTorch's fully_shard on an identical model, fp32 and bf16 params / fp32 reduce."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_lab.fsdp2 import MixedPrecisionPolicy, fully_shard

    out = {}
    for name, ours_mp, torch_mp in [("fp32", MixedPrecisionPolicy(), TorchMP()),
                                    ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                                     TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))]:
        for impl, fs, mp in [("ours", fully_shard, ours_mp), ("torch", torch_fully_shard, torch_mp)]:
            model = _shard_llama(Llama(_config(), seed=0), fs, mp_policy=mp)
            losses = _train(model, dist.get_rank(), dist.get_world_size())
            local = {k: v.to_local().clone() for k, v in model.state_dict().items()}
            out[f"vs_torch_{name}_{impl}"] = {"losses": losses, "local": local}
    return out


def _part_dcp():
    """torch.distributed.checkpoint round trip of the sharded state dict, then a clipped norm."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fsdp_lab.fsdp2 import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _shard_llama(Llama(_config(), seed=0), fully_shard)
    _train(model, rank, world, steps=1)
    path = [tempfile.mkdtemp(prefix="fsdp2_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(model.state_dict(), checkpoint_id=path[0])
    saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    model.load_state_dict(state)
    out = {"dcp_max_diff": max((model.state_dict()[k].to_local() - v).abs().max().item() for k, v in saved.items())}
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=99), rank, world)
    out["clip_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor().item() \
        if _backward(model, batch) else None
    return out


def _part_memory():
    """Unsharded bytes alive wherever an all-gather lands, sharded bytes, the tracker's view (2 ranks)."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import FSDPModule, FSDPParamGroup, fully_shard

    world = dist.get_world_size()
    out = {}
    cfg = LlamaConfig.from_name("cpu")  # 4 layers: "largest groups alive" differs from "whole model"
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=0), dist.get_rank(), world)

    # memory: unsharded bytes alive at every point an all-gather lands
    original_wait = FSDPParamGroup.wait_for_unshard
    for raf in (True, False):
        model = _shard_llama(Llama(cfg, seed=0), fully_shard, reshard_after_forward=raf)
        groups = list({id(m._fsdp_state): m._fsdp_state.group for m in model.modules()
                       if isinstance(m, FSDPModule)}.values())
        peak = [0]

        def probe(self, groups=groups, peak=peak):
            original_wait(self)
            peak[0] = max(peak[0], sum(g.unsharded_bytes() for g in groups))

        FSDPParamGroup.wait_for_unshard = probe
        try:
            model(batch.input_ids, batch.labels).loss.backward()
        finally:
            FSDPParamGroup.wait_for_unshard = original_wait
        out[f"memory_raf_{raf}"] = {
            "peak_unsharded": peak[0],
            "after_backward": sum(g.unsharded_bytes() for g in groups),
            "sharded": {k: v.to_local().untyped_storage().nbytes() for k, v in model.state_dict().items()},
        }
        if raf:
            try:
                from fsdp_lab.memory.tracker import MemoryTracker
                model.zero_grad()
                with MemoryTracker(model) as tracker:
                    model(batch.input_ids, batch.labels).loss.backward()
                out["tracker_max"] = tracker.max_by_category()
            except ImportError:
                out["tracker_max"] = None
    return out


def _part_prefetch_order():
    """The order of all-gathers: implicit backward prefetch and explicit forward prefetch (2 ranks)."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import FSDPParamGroup, fully_shard

    world = dist.get_world_size()
    out = {}
    cfg = LlamaConfig.from_name("cpu")  # 4 layers: "largest groups alive" differs from "whole model"
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=0), dist.get_rank(), world)

    # order of all-gathers: implicit backward prefetch and explicit forward prefetch
    log = []
    original_unshard = FSDPParamGroup.unshard

    def logging_unshard(self, async_op=False):
        if self.sharded_state == ShardedState.SHARDED:
            log.append((self.name, async_op))
        return original_unshard(self, async_op)

    for explicit in (False, True, "no_backward_prefetch_from_layers.3"):
        model = _shard_llama(Llama(cfg, seed=0), fully_shard, reshard_after_forward=True)
        layers = list(model.layers)
        if explicit is True:
            for a, b in zip(layers, layers[1:]):
                a.set_modules_to_forward_prefetch([b])
        elif explicit:
            layers[3].set_modules_to_backward_prefetch([])
        for layer in layers:
            layer.attention.register_forward_pre_hook(lambda m, a, i=layers.index(layer): log.append((f"compute.{i}", None)))
        log.clear()
        FSDPParamGroup.unshard = logging_unshard
        try:
            loss = model(batch.input_ids, batch.labels).loss
            log.append(("backward", None))
            loss.backward()
        finally:
            FSDPParamGroup.unshard = original_unshard
        out[f"order_explicit_{explicit}"] = list(log)
    return out


def _part_unshard_api():
    """The public unshard / reshard API (2 ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fsdp_lab.fsdp2 import fully_shard

    out = {}
    model = _shard_llama(Llama(LlamaConfig.from_name("cpu"), seed=0), fully_shard, reshard_after_forward=True)
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=0), dist.get_rank(), dist.get_world_size())
    model(batch.input_ids, batch.labels).loss.backward()  # one step first: the root's lazy init has run
    layer = model.layers[0]
    handle = layer.unshard(async_op=True)
    handle.wait()
    weight = layer.feed_forward.w1.weight
    out["unsharded_type"] = (type(weight).__name__, tuple(weight.shape))
    out["unsharded_w1"] = weight.detach().clone()
    layer.reshard()
    out["resharded_is_dtensor"] = isinstance(layer.feed_forward.w1.weight, DTensor)
    return out


def _part_bad_inputs():
    """Bad input: each must raise a clear error (2 ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_lab.fsdp2 import fully_shard

    world = dist.get_world_size()
    out = {}

    def tied_separately():
        m = Llama(LlamaConfig.from_name("cpu-tied", n_layers=1), seed=0)
        fully_shard(m.tok_embeddings)
        fully_shard(m.output)

    def twice():
        m = nn.Linear(4, 4)
        fully_shard(m)
        fully_shard(m)

    def mixed_devices():
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
        fully_shard(m)

    def mesh_mismatch():
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
        fully_shard(nn.Linear(4, 4), mesh=mesh["a"])

    def integer_param():
        m = nn.Linear(4, 4)
        m.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
        fully_shard(m)

    def int_reshard():
        fully_shard(nn.Linear(4, 4), reshard_after_forward=2)

    out["errors"] = {}
    for fn in (tied_separately, twice, mixed_devices, mesh_mismatch, integer_param, int_reshard):
        try:
            fn()
            out["errors"][fn.__name__] = None
        except Exception as exc:  # noqa: BLE001 - the test looks at type and message
            out["errors"][fn.__name__] = (type(exc).__name__, str(exc))
    return out


def _backward(model, batch):
    model(batch.input_ids, batch.labels).loss.backward()
    return True


# -- references in this process -------------------------------------------------------------------
def _reference(tied=False, freeze=False, accum=1, uneven=False):
    model = Uneven() if uneven else Llama(_config(tied), seed=0)
    if freeze:
        _freeze(model)
    per_step = []

    def snapshot(step):
        per_step.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    losses = _train(model, 0, 1, accum=accum, uneven=uneven, after_step=snapshot)
    return {"losses": losses, "params": per_step[-1], "params_per_step": per_step}


@pytest.fixture(scope="module")
def references():
    return {
        "plain": _reference(),
        "accum": _reference(accum=2),
        "tied": _reference(tied=True),
        "frozen": _reference(freeze=True),
        "uneven": _reference(uneven=True),
    }


_LAUNCHED: dict[int, list] = {}


def _launched(world):
    if world not in _LAUNCHED:
        _LAUNCHED[world] = fsdp_lab.launch(_rank_suite, world_size=world, timeout=600)
    return _LAUNCHED[world]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def suite(request):
    return request.param, _launched(request.param)


@pytest.fixture(scope="module")
def extras():
    """Rank 0's results of the checks that run on 2 ranks only."""
    return _launched(2)[0]["extras"]


def _mean_losses(results, name):
    per_rank = [results[0][name]["losses"]] + [r["losses_by_config"][name] for r in results[1:]]
    return [sum(step) / len(per_rank) for step in zip(*per_rank)]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name,ref", [("raf_true", "plain"), ("raf_false", "plain"), ("default", "plain"),
                                      ("accum_nosync", "accum"), ("accum_sync", "accum"), ("tied", "tied"),
                                      ("frozen", "frozen"), ("offload", "plain"), ("checkpointed", "plain"),
                                      ("uneven", "uneven")])
def test_matches_single_process(suite, references, name, ref):
    world, results = suite
    expected = references[ref]
    assert _mean_losses(results, name) == pytest.approx(expected["losses"], rel=LOSS_REL, abs=TOL)
    assert _max_diff(results[0][name]["params"], expected["params"]) <= TOL


def test_every_part_ran(suite):
    world, results = suite
    failed = dict(results[0]["failed_parts"])
    if world == 2:
        failed.update(results[0]["extras"]["failed_parts"])
    assert not failed, "\n".join(f"{name} raised on rank 0:\n{trace}" for name, trace in failed.items())


@pytest.mark.parametrize("name", ["raf_true", "raf_false", "default"])
def test_parameters_match_single_process_after_every_step(suite, references, name):
    _, results = suite
    steps = results[0][name]["params_per_step"]
    assert len(steps) == STEPS
    for step, (ours, reference) in enumerate(zip(steps, references["plain"]["params_per_step"])):
        assert _max_diff(ours, reference) <= TOL, f"step {step}"


@pytest.mark.parametrize("name", ["raf_true", "raf_false", "default"])
def test_collectives_per_step_match_the_schedule(suite, name):
    # One group per block plus the root's, each gathered before forward and reduce-scattered
    # once. Resharded after forward, a group is gathered again for backward. By default
    # (reshard_after_forward=None) the root keeps its parameters between forward and backward,
    # as PyTorch's fully_shard does (it frees them only when reshard_after_forward=True is explicit).
    _, results = suite
    blocks = CONFIG["n_layers"]
    all_gathers = {"raf_true": 2 * (blocks + 1), "raf_false": blocks + 1, "default": 2 * blocks + 1}[name]
    for step in results[0][name]["collectives_per_step"]:
        assert step == {"all_gather": all_gathers, "reduce_scatter": blocks + 1}, step


def test_frozen_params_unchanged(suite, references):
    _, results = suite
    initial = Llama(_config(), seed=0).state_dict()
    params = results[0]["frozen"]["params"]
    frozen = [k for k in params if ".attention.wq" in k or ".attention.wk" in k or k.endswith("attention_norm.weight")]
    assert frozen and all(torch.equal(params[k], initial[k]) for k in frozen)
    assert not torch.equal(params["layers.0.attention.wv.weight"], initial["layers.0.attention.wv.weight"])


def test_parameters_are_dtensors_with_chunk_shapes(suite):
    world, results = suite
    assert results[0]["is_dtensor"]
    cfg = _config()
    assert results[0]["local_shapes"]["tok_embeddings.weight"] == (cfg.vocab_size // world, cfg.dim)
    assert results[0]["local_shapes"]["layers.0.feed_forward.w1.weight"] == (cfg.ffn_hidden // world, cfg.dim)


def test_uneven_shapes_padded_like_torch_chunk(suite):
    world, results = suite
    local = results[0]["uneven_local"]
    # rank 0 gets ceil(rows / world) rows, as torch.chunk gives
    assert local["a.weight"] == (-(-5 // world), 3)
    assert local["b.bias"] == (-(-7 // world),)
    full = results[0]["uneven_full_before"]
    assert _max_diff(full, Uneven().state_dict()) == 0.0


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_matches_torch_fully_shard(suite, policy):
    world, results = suite
    ours, theirs = results[0][f"vs_torch_{policy}_ours"], results[0][f"vs_torch_{policy}_torch"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=TOL)
    assert _max_diff(ours["local"], theirs["local"]) <= TOL
    for other in results[1:]:
        mine = other["losses_by_config"][f"vs_torch_{policy}_ours"]
        assert mine == pytest.approx(other["losses_by_config"][f"vs_torch_{policy}_torch"], abs=TOL)


def test_bf16_differs_from_fp32(suite):
    """The bf16 comparison is not vacuous: bf16 compute changes the losses."""
    _, results = suite
    assert results[0]["vs_torch_bf16_ours"]["losses"] != results[0]["vs_torch_fp32_ours"]["losses"]


def test_checkpoint_round_trip_bit_exact(suite):
    _, results = suite
    assert results[0]["dcp_max_diff"] == 0.0


def test_clip_grad_norm_on_dtensors(suite):
    _, results = suite
    assert results[0]["clip_norm"] is not None and results[0]["clip_norm"] > 0


# -- 2-rank checks -----------------------------------------------------------------------------
def _group_bytes(cfg, world):
    """Gathered (padded) fp32 bytes of the root group and of one layer group, worked from shapes."""
    def padded(shape):
        rows = -(-shape[0] // world) * world
        n = rows
        for d in shape[1:]:
            n *= d
        return 4 * n
    layer = Llama(cfg, seed=0).layers[0]
    layer_bytes = sum(padded(p.shape) for p in layer.parameters())
    root_bytes = sum(padded(p.shape) for p in (torch.empty(cfg.vocab_size, cfg.dim), torch.empty(cfg.dim),
                                                 torch.empty(cfg.vocab_size, cfg.dim)))
    return root_bytes, layer_bytes


def test_unsharded_peak_is_largest_groups_alive_not_whole_model(extras):
    cfg = LlamaConfig.from_name("cpu")
    root_bytes, layer_bytes = _group_bytes(cfg, 2)
    memory = extras["memory_raf_True"]
    # forward: root + one layer; backward: root + the layer running (the prefetched one is
    # still in flight, its bytes in the all-gather output buffer)
    assert memory["peak_unsharded"] == root_bytes + layer_bytes
    assert memory["after_backward"] == 0
    whole = root_bytes + cfg.n_layers * layer_bytes
    assert extras["memory_raf_False"]["peak_unsharded"] == whole
    assert extras["memory_raf_False"]["after_backward"] == 0


def test_sharded_bytes_are_ceil_divided(extras):
    full = Llama(LlamaConfig.from_name("cpu"), seed=0).state_dict()
    for key, nbytes in extras["memory_raf_True"]["sharded"].items():
        shape = full[key].shape
        rows = -(-shape[0] // 2)
        assert nbytes == 4 * full[key][:rows].numel(), key


def test_tracker_sees_unsharded_params_of_largest_groups(extras):
    if extras["tracker_max"] is None:
        pytest.skip("fsdp_lab.memory.tracker not available")
    root_bytes, layer_bytes = _group_bytes(LlamaConfig.from_name("cpu"), 2)
    assert extras["tracker_max"]["unsharded_params"] == root_bytes + layer_bytes


def test_implicit_backward_prefetch_order(extras):
    log = extras["order_explicit_False"]
    backward = log[log.index(("backward", None)) + 1:]
    # backward starts with the last layer's all-gather issued ahead (async) by the root, and
    # each layer prefetches the one before it
    assert [name for name, async_op in backward if async_op] == ["layers.3", "layers.2", "layers.1", "layers.0"]


def test_explicit_forward_prefetch_issues_next_layer_before_compute(extras):
    log = extras["order_explicit_True"]
    for i in range(3):
        assert log.index((f"layers.{i + 1}", True)) < log.index((f"compute.{i}", None))
    without = extras["order_explicit_False"]
    assert (f"layers.1", True) not in without[:without.index(("backward", None))]


def test_explicit_backward_prefetch_list_replaces_implicit(extras):
    log = extras["order_explicit_no_backward_prefetch_from_layers.3"]
    backward = log[log.index(("backward", None)) + 1:]
    # layers.3 prefetches nothing, so layers.2 is gathered on demand (synchronously)
    assert ("layers.2", False) in backward and ("layers.2", True) not in backward
    assert ("layers.1", True) in backward and ("layers.0", True) in backward


def test_public_unshard_and_reshard(extras):
    name, shape = extras["unsharded_type"]
    assert name == "Parameter" and shape == (352, 128)
    full = Llama(LlamaConfig.from_name("cpu"), seed=0).layers[0].feed_forward.w1.weight
    assert torch.equal(extras["unsharded_w1"], full.detach())
    assert extras["resharded_is_dtensor"]


@pytest.mark.parametrize("case,error,words", [
    ("tied_separately", "ValueError", "already managed by fully_shard"),
    ("twice", "ValueError", "already sharded"),
    ("mixed_devices", "ValueError", "different devices"),
    ("mesh_mismatch", "ValueError", "the mesh has 1 ranks but the world has 2"),
    ("integer_param", "TypeError", "floating-point"),
    ("int_reshard", "NotImplementedError", "not supported"),
])
def test_bad_input_errors(extras, case, error, words):
    raised = extras["errors"][case]
    assert raised is not None, f"{case} did not raise"
    assert raised[0] == error and words in raised[1], raised


def test_extension_all_gathers_codes_and_scales(suite):
    world, results = suite
    extension = results[0]["extension"]
    reference = _plain_quantized_model()
    _train_quantized(reference, 0, 1)
    expected = {k: v for k, v in reference.state_dict().items() if k != "0.weight"}
    assert _max_diff(extension["params"], expected) <= TOL
    assert extension["weight_type"] == "Int8Rows"
    rows = -(-6 // world)
    # per rank: int8 codes (rows x 8), fp32 scales (rows), fp32 bias shard (rows), as raw bytes
    expected_bytes = world * (rows * 8 + rows * 4 + rows * 4)
    assert extension["gathers"] and all(g == (expected_bytes, "uint8") for g in extension["gathers"])
