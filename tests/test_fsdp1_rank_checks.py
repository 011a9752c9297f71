"""Rank-side checks for test_fsdp1.py (run inside its one launch per world size), and
single-process tests of the pure pieces (shard boundaries worked by hand, wrap policies).

``rank_checks()`` returns plain data; test_fsdp1.py asserts on it.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_lab
from fsdp_lab.states import ShardedState
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock


def _fsdp(model, **kwargs):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **kwargs)


def _units(model):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    return {h.unit_name: u for u in model.modules() if isinstance(u, FSDP) for h in u._handles}


def _local_batch(step=0, batch=8, seq=32):
    return shard_batch(global_batch(512, batch, seq, step=step), dist.get_rank(), dist.get_world_size())


def _step(model, opt, step=0, **batch_kwargs):
    loss = model(_local_batch(step, **batch_kwargs)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def state_dict_checks() -> dict:
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ShardedParam, StateDictType

    a = _fsdp(Llama("cpu", seed=0))
    _step(a, torch.optim.AdamW(a.parameters(), lr=1e-2))
    full = a.state_dict()
    b = _fsdp(Llama("cpu", seed=1))
    b.load_state_dict(full)
    full_ok = all(torch.equal(full[k], v) for k, v in b.state_dict().items())
    with FSDP.state_dict_type(a, StateDictType.SHARDED_STATE_DICT):
        sharded = a.state_dict()
    c = _fsdp(Llama("cpu", seed=2))
    with FSDP.state_dict_type(c, StateDictType.SHARDED_STATE_DICT):
        c.load_state_dict(sharded)
    sharded_ok = all(torch.equal(full[k], v) for k, v in c.state_dict().items())
    owned = sum(b - a for u in set(_units(a).values()) for h in u._handles for a, b in h.local_slices())
    local = sum(v.local.numel() for v in sharded.values() if isinstance(v, ShardedParam))
    is_local = all(isinstance(v, ShardedParam) and v.local.numel() == v.end - v.start for v in sharded.values())
    name = next(k for k, v in sharded.items() if isinstance(v, ShardedParam))
    v = sharded[name]
    bad_cases = {
        "wrong shape": lambda: c.load_state_dict({**full, name: torch.zeros(3)}),
        "missing name": lambda: c.load_state_dict({k: t for k, t in full.items() if k != name}),
        "another rank's slice": lambda: _load_sharded(
            c, {**sharded, name: ShardedParam(v.local, v.start + 1, v.end + 1, v.shape)}),
        # what torch.distributed.checkpoint keeps of ShardedParams: rank 0's, on every rank (rank 0's
        # own load succeeds; it must stop too, or it waits for the others in its next collective)
        "rank 0's slices": lambda: _load_sharded(c, _from_rank0(sharded)),
    }
    errors = {}
    for case, load in bad_cases.items():
        try:
            load()
            errors[case] = "no error"
        except (KeyError, ValueError) as exc:
            errors[case] = f"{type(exc).__name__}: {exc}"
    return {"full_state_dict_round_trip": full_ok, "sharded_state_dict_round_trip": sharded_ok,
            "sharded_state_dict_is_local": is_local and local == owned, "state_dict_errors": errors}


def _from_rank0(state):
    shared = [state if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _load_sharded(model, state) -> None:
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state)


def sync_module_states_checks() -> dict:
    """Ranks start from different weights; sync_module_states=True makes them rank 0's."""
    model = _fsdp(Llama("cpu", seed=dist.get_rank()), sync_module_states=True)
    expected = Llama("cpu", seed=0).state_dict()
    return {"sync_module_states": all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())}


def summon_checks() -> dict:
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    model = _fsdp(Llama("cpu", seed=0))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False):
        inside = {k: tuple(p.shape) for k, p in model.named_parameters()}
    after_equal = all(torch.equal(before[k], p) for k, p in model.named_parameters())
    with FSDP.summon_full_params(model):
        dict(model.named_parameters())["layers.0.attention_norm.weight"].data.add_(1.0)
    changed = model.state_dict()["layers.0.attention_norm.weight"]
    return {"summon_shapes": {"inside": inside, "after_equals_before": after_equal},
            "summon_writeback": bool(torch.all(changed == 2.0)), "summon_options": summon_option_checks()}


def summon_option_checks() -> dict:
    """rank0_only, offload_to_cpu and with_grads as PyTorch defines them, against a plain model
    trained on the same global batch (its gradient is the average of the ranks')."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    model = _fsdp(Llama("cpu", seed=0))
    model(_local_batch()).loss.backward()
    plain = Llama("cpu", seed=0)
    plain(global_batch(512, 8, 32, step=0)).loss.backward()
    expected = {n: (p.detach(), p.grad) for n, p in plain.named_parameters()}
    sharded_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out = {}
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        out["rank0_only_full_here"] = all(tuple(p.shape) == tuple(expected[n][0].shape)
                                          for n, p in model.named_parameters())
        out["rank0_only_sharded_here"] = {n: tuple(p.shape) for n, p in model.named_parameters()} == sharded_shapes
    with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
        out["offload_on_cpu_and_equal"] = all(p.device.type == "cpu" and torch.equal(p, expected[n][0])
                                              for n, p in model.named_parameters())
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        out["with_grads_max_diff"] = max((p.grad - expected[n][1]).abs().max().item()
                                         for n, p in model.named_parameters())
    out["grads_back_to_shards"] = all(torch.equal(p.grad, grads_before[n]) for n, p in model.named_parameters())
    for name, kwargs in (("writeback+rank0_only", dict(rank0_only=True)),
                         ("with_grads+offload_to_cpu", dict(writeback=False, with_grads=True, offload_to_cpu=True))):
        try:
            with FSDP.summon_full_params(model, **kwargs):
                pass
            out[name] = "no error"
        except NotImplementedError as error:
            out[name] = str(error)
    return out


class _CheckpointedCall(nn.Module):
    """Calls a unit through non-reentrant checkpointing: backward runs the unit's forward again."""

    def __init__(self, unit):
        super().__init__()
        self.unit = unit

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.unit, *args, use_reentrant=False)


def frozen_reshard_checks() -> dict:
    """Gathered bytes of the frozen unit layers.1 during backward: plain; after an evaluation
    forward with grad on and no backward ("eval_first"); with checkpointing around the unit
    ("checkpointed_around", whose recomputed graph is never backpropagated)."""
    out = {"frozen_reshard": _frozen_reshard_sample("plain")}
    for case in ("eval_first", "checkpointed_around"):
        out[f"frozen_reshard_{case}"] = _frozen_reshard_sample(case)
    return out


def _frozen_reshard_sample(case: str) -> dict:
    from fsdp_lab.memory.tracker import MemoryTracker

    base = Llama("cpu", seed=0)
    for p in base.layers[1].parameters():
        p.requires_grad_(False)
    model = _fsdp(base)
    units = _units(model)
    if case == "checkpointed_around":
        model.layers[1] = _CheckpointedCall(model.layers[1])
    sample = {}

    def unsharded(name):
        return sum(h.unsharded_bytes() for h in units[name]._handles)

    def at_layer1(*_):
        sample["layers.1 gathered in its backward"] = unsharded("layers.1")

    def at_layer0(*_):
        sample["layers.1 at layers.0 backward start"] = unsharded("layers.1")
        sample["tracker unsharded at layers.0 backward start"] = tracker.current()["unsharded_params"]
        sample["tracker unsharded bound"] = sum(unsharded(n) for n in units)

    units["layers.1"].module.register_full_backward_pre_hook(at_layer1)
    units["layers.0"].module.register_full_backward_pre_hook(at_layer0)
    if case == "eval_first":
        model(_local_batch(step=1)).loss.item()  # its graph is dropped at once
    with MemoryTracker(model) as tracker:
        model(_local_batch()).loss.backward()
    return sample


def prefetch_checks() -> dict:
    from fsdp_lab.fsdp1 import BackwardPrefetch
    from fsdp_lab.timeline import Timeline

    configs = {"None": dict(backward_prefetch=None),
               "BACKWARD_PRE": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
               "BACKWARD_POST": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST),
               "forward_prefetch": dict(backward_prefetch=None, forward_prefetch=True),
               "forward_prefetch+no_limit": dict(backward_prefetch=None, forward_prefetch=True,
                                                 limit_all_gathers=False)}
    out = {}
    if dist.get_world_size() == 1:
        return {"prefetch_orders": out}  # one rank: nothing to gather
    for name, kwargs in configs.items():
        model = _fsdp(Llama("cpu", seed=0), **kwargs)
        units = _units(model)
        gathered_ahead = []

        def count(current):
            def hook(*_):
                gathered_ahead.append(sum(1 for n, u in units.items() if n not in ("root", current)
                                          and any(h.state != ShardedState.SHARDED for h in u._handles)))
            return hook

        for n, u in units.items():
            if n != "root":
                u.module.register_forward_pre_hook(count(n))
        model(_local_batch()).loss.backward()  # the first step records the execution order
        gathered_ahead.clear()
        with Timeline() as tl:
            tl.attach(model, [(n, u.module) for n, u in units.items() if n != "root"])
            loss = model(_local_batch(step=1)).loss
            t_backward = time.perf_counter()
            loss.backward()
        tl.detach()
        comms = sorted(tl.comm_events(), key=lambda e: e.t_start)
        label = {"all_gather": "AG", "reduce_scatter": "RS"}
        backward = [f"{label[e.name]} {e.args.get('module')}" for e in comms
                    if e.t_start > t_backward and e.name in label]
        compute = {e.name: e for e in tl.compute_events()}
        ag = {e.args.get("module"): e for e in comms if e.name == "all_gather" and e.t_start > t_backward}
        fwd_ag = {e.args.get("module"): e for e in comms if e.name == "all_gather" and e.t_start < t_backward}
        out[name] = {
            "backward": backward,
            "layers.2 AG before layers.3 backward starts":
                "layers.2" in ag and ag["layers.2"].t_start < compute["layers.3 backward"].t_start,
            "AG layers.1 before layers.0 forward ends": fwd_ag["layers.1"].t_start < compute["layers.0 forward"].t_end,
            "max gathered beyond current": max(gathered_ahead),
            "limiter waits": model._shared.limiter.waits,
        }
    return {"prefetch_orders": out}


def grad_accumulation_checks() -> dict:
    """bf16 compute, fp32 reduce, one unit: flat buffer vs concat, same numbers, lower peak."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, MixedPrecision
    from fsdp_lab.memory.buffer_peak import GradBufferPeak
    from fsdp_lab.memory.tracker import MemoryTracker

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out, grads = {}, {}
    for mode in ("flat", "concat"):
        model = FSDP(Llama("cpu", seed=0), mixed_precision=policy, grad_accumulation=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = [_step(model, opt, step=s, batch=4, seq=8) for s in range(2)]
        with MemoryTracker(model, opt) as mt, GradBufferPeak() as gp:
            loss = model(_local_batch(2, batch=4, seq=8)).loss
            loss.backward()
        losses.append(loss.item())
        grads[mode] = [p.grad.clone() for p in model.parameters()]
        out[mode] = {"losses": losses, "peak": gp.peak, "tracker_peak": mt.peak_total()}
        del model, opt, mt, loss
    out["flat"]["grads_equal"] = all(torch.equal(a, b) for a, b in zip(grads["flat"], grads["concat"]))
    return {"grad_accumulation": out}


def error_checks() -> dict:
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy

    world, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    cases = {
        "wrap twice": lambda: FSDP(FSDP(nn.Linear(4, 4))),
        "wrap the same module twice": lambda: [FSDP(m) for m in [nn.Linear(4, 4)] * 2],
        "device_id on CPU": lambda: FSDP(nn.Linear(4, 4), device_id=0),
        "device_id cpu, as PyTorch's FSDP1 needs": lambda: FSDP(nn.Linear(4, 4), device_id=torch.device("cpu")),
        "group not matching the world": lambda: FSDP(nn.Linear(4, 4), process_group=singles[rank]),
        "HYBRID_SHARD on a prime world": lambda: FSDP(nn.Linear(4, 4),
                                                      sharding_strategy=ShardingStrategy.HYBRID_SHARD),
    }
    errors = {}
    for name, make in cases.items():
        if name == "group not matching the world" and world == 1:
            continue
        if name == "HYBRID_SHARD on a prime world" and world == 4:
            continue
        try:
            make()
            errors[name] = "no error"
        except (RuntimeError, ValueError) as exc:
            errors[name] = str(exc)
    return {"errors": errors}


def fsdp2_run(steps: int, lr: float, eps: float) -> dict:
    """The same training under fsdp_lab.fsdp2 (one group per block + root), for parity."""
    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict

    model = Llama("cpu", seed=0)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses = []
    for step in range(steps):
        loss = model(_local_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return {"fsdp2": {"losses": losses, "state": get_full_state_dict(model, rank0_only=False)}}


class _WithUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).pow(2).mean()


def unused_parameter_checks() -> dict:
    """A layer the forward never uses: its gradient after one backward (FSDP1 gives a zero one,
    as PyTorch's FSDP1 does; one process leaves it None)."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    model = FSDP(_WithUnusedLayer())
    model(torch.ones(2, 4)).backward()
    with FSDP.summon_full_params(model, with_grads=True):
        return {"unused_grad": model.unused.weight.grad.clone() if model.unused.weight.grad is not None else None}


def rank_checks(steps: int, lr: float, eps: float) -> dict:
    results = fsdp2_run(steps, lr, eps)
    for check in (state_dict_checks, sync_module_states_checks, summon_checks, frozen_reshard_checks, prefetch_checks,
                  grad_accumulation_checks, error_checks, unused_parameter_checks):
        results.update(check())
    return results


# --- single process: the arithmetic of flatten -> pad -> shard -----------------------------------------
def test_shard_boundaries_worked_by_hand():
    from fsdp_lab.fsdp1 import padded_numel, shard_boundaries

    # params of 5, 3 and 6 elements = 14, padded to 16 over 4 ranks: shards of 4
    # flat: a a a a | a b b b | c c c c | c c - -
    numels = [5, 3, 6]
    assert padded_numel(14, 4) == 16
    assert shard_boundaries(numels, 4, 0) == [(0, 4), (0, 0), (0, 0)]
    assert shard_boundaries(numels, 4, 1) == [(4, 5), (0, 3), (0, 0)]
    assert shard_boundaries(numels, 4, 2) == [(5, 5), (3, 3), (0, 4)]
    assert shard_boundaries(numels, 4, 3) == [(5, 5), (3, 3), (4, 6)]
    with pytest.raises(ValueError, match="outside a group"):
        shard_boundaries(numels, 4, 4)


def test_wrap_policies_select_units():
    from fsdp_lab.fsdp1 import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy
    from fsdp_lab.fsdp1.wrap import recursive_wrap

    def wrapped_names(policy):
        model = Llama("cpu", seed=0)
        marker = []

        def wrap(module):
            marker.append(module)
            return module

        recursive_wrap(model, policy, wrap, set(), lambda m: False)
        names = {id(m): n for n, m in model.named_modules()}
        return sorted(names[id(m)] for m in marker)

    blocks = [f"layers.{i}" for i in range(4)]
    assert wrapped_names(ModuleWrapPolicy({TransformerBlock})) == blocks
    assert wrapped_names(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})) == blocks
    # 150k parameters: each block (184,576) qualifies, its feed-forward (135,168) does not
    assert wrapped_names(functools.partial(size_based_auto_wrap_policy, min_num_params=150_000)) == blocks
    small = wrapped_names(functools.partial(size_based_auto_wrap_policy, min_num_params=40_000))
    assert "layers.0.feed_forward.w1" in small and "layers.0" not in small
    with pytest.raises(TypeError, match="ModuleWrapPolicy"):
        ModuleWrapPolicy([])


@pytest.mark.parametrize("kwargs, message", [
    (dict(sharding_strategy="SHARD_GRAD_OP"), "sharding_strategy must be a ShardingStrategy member .* got "
                                              "'SHARD_GRAD_OP'; pass e.g. sharding_strategy=ShardingStrategy.SHARD_GRAD_OP"),
    (dict(sharding_strategy="full"), "pass e.g. sharding_strategy=ShardingStrategy.FULL_SHARD"),
    (dict(backward_prefetch="post"), "backward_prefetch must be a BackwardPrefetch member"),
    (dict(cpu_offload=True), r"cpu_offload must be a CPUOffload or None, got True; pass e.g. "
                             r"cpu_offload=CPUOffload\(offload_params=True\)"),
    (dict(mixed_precision=torch.bfloat16), "mixed_precision must be a MixedPrecision or None"),
    (dict(auto_wrap_policy={TransformerBlock}), "auto_wrap_policy must be callable"),
    (dict(ignored_modules=["output"]), "ignored_modules must be nn.Modules .* got str"),
    (dict(sync_module_states="no"), "sync_module_states must be True or False, got 'no'"),
    (dict(limit_all_gathers=1), "limit_all_gathers must be True or False, got 1"),
])
def test_fsdp1_options_of_the_wrong_type_are_refused_before_anything_runs(kwargs, message):
    # a string strategy used to be accepted and compared by identity, so it acted as FULL_SHARD
    from fsdp_lab import simulated_world
    from fsdp_lab.fsdp1 import FullyShardedDataParallel

    with simulated_world(2), pytest.raises(TypeError, match=message):
        FullyShardedDataParallel(nn.Linear(4, 4), **kwargs)


@pytest.mark.gpu
def test_fsdp1_runs_on_cuda_and_matches_single_process():
    from fsdp_lab import launch

    def run():
        from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy

        device = torch.device("cuda", torch.cuda.current_device())
        losses = {}
        for name in ("reference", "fsdp1"):
            model = Llama("cpu", seed=0).to(device)
            if name == "fsdp1":
                model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=device.index)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
            losses[name] = []
            for step in range(3):
                batch = global_batch(512, 8, 32, step=step).to(device)
                loss = model(batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[name].append(loss.item())
        return losses

    losses = launch(run, world_size=1, timeout=300)[0]
    for a, b in zip(losses["reference"], losses["fsdp1"]):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_all_gather_limiter_waits_for_the_free_two_frees_back():
    """limit_all_gathers as PyTorch's _FreeEventQueue: an all-gather waits once two frees are
    pending, on the oldest (worked by hand with events that record being waited on)."""
    from fsdp_lab.fsdp1.runtime import AllGatherLimiter

    waited = []

    class Event:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            waited.append(self.name)

    limiter = AllGatherLimiter(torch.device("cpu"))
    limiter.before_all_gather()               # nothing freed yet: no wait
    limiter._frees.extend([Event("free 1"), Event("free 2")])
    limiter.before_all_gather()               # two pending: wait for the oldest
    limiter._frees.append(Event("free 3"))
    limiter.before_all_gather()
    limiter.before_all_gather()               # one pending: no wait
    assert waited == ["free 1", "free 2"] and limiter.waits == 2


def test_a_full_state_dict_inside_summon_full_params_says_to_call_it_outside():
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy, StateDictType

    with fsdp_lab.simulated_world(2):
        model = FSDP(Llama(LlamaConfig.from_name("cpu", n_layers=1), seed=0),
                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            with FSDP.summon_full_params(model, writeback=False):
                with pytest.raises(RuntimeError, match="inside summon_full_params: its parameters are whole "
                                                       "already, read them there; a full state_dict"):
                    model.state_dict()
            assert len(model.state_dict()) > 0  # outside, as it says; the model was left as it was


def test_load_state_dict_raises_and_returns_what_nn_module_s_does():
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    with fsdp_lab.simulated_world(2):
        model = FSDP(nn.Linear(4, 4))
        weight = model.state_dict()["weight"]
        wrong = {"weight": weight, "bogus": torch.zeros(1)}
        # a RuntimeError, as PyTorch's FSDP1 (an nn.Module) raises: code that catches it still does
        with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict for FullyShardedDataParallel: "
                                               r"state dict mismatch: missing \['bias'\], unexpected \['bogus'\]"):
            model.load_state_dict(wrong)
        result = model.load_state_dict(wrong, strict=False)
        assert (result.missing_keys, result.unexpected_keys) == (["bias"], ["bogus"])
        with pytest.raises(NotImplementedError, match=r"assign=True"):
            model.load_state_dict({"weight": weight, "bias": torch.zeros(4)}, assign=True)


def test_state_dicts_keep_nn_module_s_key_order_and_the_buffers_own_dtype():
    # nn.Module.state_dict walks module by module (parameters, then buffers); PyTorch's FSDP1 keeps
    # that order and gives buffers cast by MixedPrecision.buffer_dtype back in their own dtype
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, MixedPrecision, ModuleWrapPolicy, StateDictType

    def plain():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
        model.register_buffer("scale", torch.full((4,), 1.5))
        return model

    reference = plain().state_dict()
    with fsdp_lab.simulated_world(2):
        model = FSDP(plain(), auto_wrap_policy=ModuleWrapPolicy({nn.BatchNorm1d, nn.LayerNorm}),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
        model(torch.ones(3, 4)).sum().backward()
        assert model.scale.dtype == torch.bfloat16  # the forward ran with bf16 buffers
        for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
            with FSDP.state_dict_type(model, kind):
                state = model.state_dict()
            assert list(state) == list(reference), kind
            buffers = [name for name in reference if "running" in name or name in ("scale", "1.num_batches_tracked")]
            assert [state[name].dtype for name in buffers] == [reference[name].dtype for name in buffers], kind
