"""What each rank of tests/test_fsdp2.py's launches runs: ``_rank_suite`` and its ``_part_*``.

One launch per world size calls ``_rank_suite``; every part returns a dict of results that the
host's tests compare. Ranks import this module by name (``fsdp_lab.launch`` sends the caller's
``sys.path``). The models and the training loop are in tests/_fsdp2_models.py.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import tempfile

import torch
import torch.nn as nn

from fsdp_lab.states import ShardedState
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing

from _fsdp2_models import (GLOBAL_BATCH, SEQ, Uneven, _config, _freeze, _quantized_model, _shard_llama,
                           _train, _train_quantized, _train_step_by_step)


CLIP_MAX_NORM = 1.0  # below the test model's gradient norm after one step (about 3.5): clip_grad_norm_ scales


# -- what every rank runs ------------------------------------------------------------------------
# Each part returns a dict of results. A part that raises leaves its traceback under
# "failed_parts" and the others still run, so one crash fails only the tests that read its keys
# (and test_every_part_ran, which shows the traceback).
def _rank_suite():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    from _torch_reference import TORCH_FSDP2_ON_CPU

    parts = [_part_parity, _part_uneven, _part_extension, _part_dcp]
    if TORCH_FSDP2_ON_CPU:  # PyTorch's fully_shard beside ours
        parts.insert(3, _part_vs_torch)
    out = _run_parts(parts)
    if world == 2:
        out["extras"] = _run_parts([_part_memory, _part_prefetch_order, _part_unshard_api, _part_bad_inputs,
                                    _part_requires_grad_changed_after_sharding, _part_two_forwards_one_backward,
                                    _part_forward_method])
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


def _local_state(model) -> dict:
    """This rank's shard of every entry of a sharded model's state dict, copied."""
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _fully_shard_implementations() -> list:
    """[(name, fully_shard)]: ours, and PyTorch's where it runs on CPU ranks."""
    from fsdp_lab.fsdp2 import fully_shard
    from _torch_reference import TORCH_FSDP2_ON_CPU

    impls = [("ours", fully_shard)]
    if TORCH_FSDP2_ON_CPU:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        impls.append(("torch", torch_fully_shard))
    return impls


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
    """PyTorch's fully_shard on an identical model: fp32; bf16 params with an fp32 reduce; bf16
    params with the default reduce dtype; an fp32 model reduced and accumulated in bf16."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_lab.fsdp2 import MixedPrecisionPolicy, fully_shard

    out = {}
    bf16 = torch.bfloat16
    # "bf16_default": ours with no reduce_dtype reduces in param_dtype, as PyTorch's did up to
    # 2.14 (2.15 reduces in the parameter's own dtype instead), so torch's is told so explicitly
    # "reduce_bf16_accum": an fp32 model reduced in bf16 over two microbatches without sync in
    # between; with main_grads_dtype=None ours keeps them in bf16 as PyTorch's does, each added in
    # with one rounding
    accumulate = dict(accum=2, sync_every_micro=False)
    for name, ours_mp, torch_mp, train in [
            ("fp32", MixedPrecisionPolicy(), TorchMP(), {}),
            ("bf16", MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32),
             TorchMP(param_dtype=bf16, reduce_dtype=torch.float32), {}),
            ("bf16_default", MixedPrecisionPolicy(param_dtype=bf16), TorchMP(param_dtype=bf16, reduce_dtype=bf16), {}),
            ("reduce_bf16_accum", MixedPrecisionPolicy(reduce_dtype=bf16, main_grads_dtype=None),
             TorchMP(reduce_dtype=bf16), accumulate)]:
        for impl, fs, mp in [("ours", fully_shard, ours_mp), ("torch", torch_fully_shard, torch_mp)]:
            model = _shard_llama(Llama(_config(), seed=0), fs, mp_policy=mp)
            losses = _train(model, dist.get_rank(), dist.get_world_size(), **train)
            local = _local_state(model)
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
    saved = _local_state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    dist.barrier()  # every rank has read its shards before rank 0 removes the files
    if rank == 0:
        shutil.rmtree(path[0])
    model.load_state_dict(state)
    out = {"dcp_max_diff": max((model.state_dict()[k].to_local() - v).abs().max().item() for k, v in saved.items()),
           "dcp_checkpoint_left": rank == 0 and pathlib.Path(path[0]).exists()}
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=99), rank, world)
    _backward(model, batch)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM)  # a DTensor: the global norm
    out["clip"] = {"norm": norm.full_tensor().item(),
                   "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}  # clipped
    return out


def _four_layers_and_batch():
    """The CPU Llama's config and this rank's share of step 0's batch."""
    import torch.distributed as dist

    cfg = LlamaConfig.from_name("cpu")  # 4 layers: "largest groups alive" differs from "whole model"
    return cfg, shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=0), dist.get_rank(), dist.get_world_size())


def _part_memory():
    """Unsharded bytes alive wherever an all-gather lands, sharded bytes, the tracker's view (2 ranks)."""
    from fsdp_lab.fsdp2 import FSDPModule, FSDPParamGroup, fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker

    out = {}
    cfg, batch = _four_layers_and_batch()

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
            model.zero_grad()
            with MemoryTracker(model) as tracker:
                model(batch.input_ids, batch.labels).loss.backward()
            out["tracker_max"] = tracker.max_by_category()
            # one all-gather in flight, then waited for: the communication buffers it holds
            with MemoryTracker(model) as tracker:
                handle = model.layers[0].unshard(async_op=True)
                in_flight = tracker.current()["comm_buffers"]
                handle.wait()
                out["gather_comm_buffers"] = {"in_flight": in_flight, "waited": tracker.current()["comm_buffers"]}
                model.layers[0].reshard()
    out["step_peaks"] = _step_peaks_beside_torch(cfg, batch)
    return out


def _step_peaks_beside_torch(cfg, batch) -> dict[str, int]:
    """The tracked peak (bytes, this rank) of one AdamW step, after one untracked step, of the
    same Llama sharded by ours and, where it runs on CPU ranks, by PyTorch's ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from _torch_reference import TORCH_FSDP2_ON_CPU
    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.memory.tracker import MemoryTracker

    peaks = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        if name == "torch" and not TORCH_FSDP2_ON_CPU:
            continue
        model = _shard_llama(Llama(cfg, seed=0), shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for tracked in (False, True):
            with MemoryTracker(model, opt) if tracked else contextlib.nullcontext() as tracker:
                model(batch.input_ids, batch.labels).loss.backward()
                opt.step()
                opt.zero_grad()
        peaks[name] = tracker.peak_total()
        del model, opt, tracker
    return peaks


def _part_prefetch_order():
    """The order of all-gathers: implicit backward prefetch and explicit forward prefetch (2 ranks)."""
    from fsdp_lab.fsdp2 import FSDPParamGroup, fully_shard

    out = {}
    cfg, batch = _four_layers_and_batch()

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
    from torch.distributed.tensor import DTensor

    from fsdp_lab.fsdp2 import fully_shard

    out = {}
    cfg, batch = _four_layers_and_batch()
    model = _shard_llama(Llama(cfg, seed=0), fully_shard, reshard_after_forward=True)
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


def _part_requires_grad_changed_after_sharding():
    """A block frozen after fully_shard ("freeze"), and one frozen before it and unfrozen after the
    first step ("unfreeze"), 3 AdamW steps; ours, and PyTorch's fully_shard where it runs on CPU."""
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    impls = _fully_shard_implementations()
    out = {}
    for case in ("freeze", "unfreeze"):
        for impl, fs in impls:
            model = Llama(_config(), seed=0)
            block = model.layers[0]
            block.requires_grad_(case == "freeze")  # trainable when sharded, or frozen then
            _shard_llama(model, fs)
            if case == "freeze":
                block.requires_grad_(False)
            before = {n: p.full_tensor().clone() for n, p in block.named_parameters()}
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            grads_of_block = []
            for step in range(3):
                if case == "unfreeze" and step == 1:
                    block.requires_grad_(True)
                    optimizer.add_param_group({"params": list(block.parameters())})
                batch = shard_batch(global_batch(model.config.vocab_size, GLOBAL_BATCH, SEQ, step=step), rank, world)
                model(batch).loss.backward()
                grads_of_block.append(sum(p.grad is not None for p in block.parameters()))
                optimizer.step()
                optimizer.zero_grad()
            out[f"requires_grad_{case}_{impl}"] = {
                "block_unchanged": all(torch.equal(before[n], p.full_tensor()) for n, p in block.named_parameters()),
                "grads_of_block": grads_of_block,
                "local": _local_state(model)}
    # a bf16 model: a block frozen at sharding keeps bf16 shards (the frozen rule) where the others get
    # float32 masters; unfrozen later, it trains in bf16, and fully_shard says so once
    import warnings

    model = Llama(_config(), seed=0).to(torch.bfloat16)
    model.layers[0].requires_grad_(False)
    _shard_llama(model, fully_shard)
    model.layers[0].requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            batch = shard_batch(global_batch(model.config.vocab_size, GLOBAL_BATCH, SEQ, step=step), rank, world)
            model(batch).loss.backward()
    out["unfrozen_bf16"] = {"warnings": [str(w.message) for w in caught if "frozen when sharded" in str(w.message)],
                            "dtypes": (model.layers[0].attention.wq.weight.dtype, model.layers[1].attention.wq.weight.dtype)}
    return out


def _part_two_forwards_one_backward():
    """Ours (and PyTorch's fully_shard where it runs on CPU) through ``two_forwards_one_backward``."""
    import torch.distributed as dist

    from _fsdp2_models import two_forwards_one_backward

    impls = _fully_shard_implementations()
    out = {}
    for impl, fs in impls:
        model = _shard_llama(Llama(_config(), seed=0), fs)
        two_forwards_one_backward(model, dist.get_rank(), dist.get_world_size())
        out[f"two_forwards_{impl}"] = {"local": _local_state(model),
                                       "full": _full_params(model) if impl == "ours" else None}
    return out


def _part_forward_method():
    """A method other than forward, registered with register_fsdp_forward_method, ours and PyTorch's."""
    import weakref

    import torch.distributed as dist

    from fsdp_lab.fsdp2 import register_fsdp_forward_method
    from _fsdp2_models import EnergyLlama, _train_two_entry_points

    out = {}
    for impl, fs in _fully_shard_implementations():
        model = _shard_llama(EnergyLlama(_config(), seed=0), fs)
        register = register_fsdp_forward_method
        if impl == "torch":
            import torch.distributed.fsdp as torch_fsdp
            register = getattr(torch_fsdp, "register_fsdp_forward_method", None)
            if register is None:  # an older torch
                continue
        register(model, "hidden_energy")
        _train_two_entry_points(model, dist.get_rank(), dist.get_world_size())
        out[f"forward_method_{impl}"] = {"local": _local_state(model),
                                         "full": _full_params(model) if impl == "ours" else None}
        alive = weakref.ref(model)
        del model
        out[f"forward_method_{impl}_freed_without_collector"] = alive() is None
    return out


class _ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


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

    def string_gradient_sync():  # "no" is truthy: it would have left syncing on
        fully_shard(nn.Linear(4, 4)).set_requires_gradient_sync("no")

    def int_reshard_after_backward():
        fully_shard(nn.Linear(4, 4)).set_reshard_after_backward(0)

    def two_dtypes(freeze_double=False, separately=False):
        m = nn.Sequential(nn.Linear(4, 4), _ToDouble(), nn.Linear(4, 4).double())
        m[2].requires_grad_(not freeze_double)
        if separately:
            fully_shard(m[2])
        fully_shard(m)  # the check runs at the first forward, as PyTorch's: requires_grad may change until then
        m(torch.ones(2, 4)).sum().backward()

    def mixed_trainable_dtypes():
        two_dtypes()

    def no_such_forward_method():
        from fsdp_lab.fsdp2 import register_fsdp_forward_method
        register_fsdp_forward_method(fully_shard(nn.Linear(4, 4)), "generate")

    def other_dtype_frozen():  # fine: only gradients share a buffer
        two_dtypes(freeze_double=True)

    def other_dtype_sharded_apart():  # fine: the error's own fix
        two_dtypes(separately=True)

    out["errors"] = {}
    for fn in (tied_separately, twice, mixed_devices, mesh_mismatch, integer_param, int_reshard,
               string_gradient_sync, int_reshard_after_backward, mixed_trainable_dtypes,
               other_dtype_frozen, other_dtype_sharded_apart, no_such_forward_method):
        try:
            fn()
            out["errors"][fn.__name__] = None
        except Exception as exc:  # noqa: BLE001 - the test looks at type and message
            out["errors"][fn.__name__] = (type(exc).__name__, str(exc))
    return out


def _backward(model, batch):
    model(batch.input_ids, batch.labels).loss.backward()
    return True
