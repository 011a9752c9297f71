"""fsdp_lab.fsdp1 against plain single-process training of the same Llama (CPU, gloo).

One launch per world size runs every configuration and returns a dict; module-scoped
fixtures cache it and the test functions below only compare. The reference trains the
unwrapped model on the whole global batch in this process.
"""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import launch
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, TransformerBlock
from test_fsdp1_rank_checks import _WithUnusedLayer

STEPS, BATCH, SEQ, VOCAB = 5, 8, 32, 512
LR, EPS = 1e-3, 1e-5  # eps well above float32 round-off of the gradients: AdamW does not amplify it
FROZEN = ("layers.1.", "layers.2.attention.wq.")  # a whole frozen unit and a mixed unit
TOL = 1e-6


def _make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def _freeze(model, names=FROZEN):
    for name, param in model.named_parameters():
        if name.startswith(names):
            param.requires_grad_(False)


def _microbatches(step: int, accumulate: int):
    """The step's global batch, split into ``accumulate`` global microbatches."""
    batch = global_batch(VOCAB, BATCH, SEQ, step=step)
    return batch.chunk(accumulate) if accumulate > 1 else [batch]


# --- the reference: one process, the whole global batch -------------------------------------------
@functools.lru_cache(maxsize=None)
def reference(config: str = "cpu", frozen: bool = False, accumulate: int = 1, clip: float | None = None,
              backward_twice: bool = False):
    model = Llama(config, seed=0)
    if frozen:
        _freeze(model)
    opt = _make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in _microbatches(step, accumulate):
            loss = model(micro).loss / accumulate
            loss.backward(retain_graph=backward_twice)
            if backward_twice:  # the same graph again: every gradient twice
                loss.backward()
            total += loss.item()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


# --- what each rank runs ----------------------------------------------------------------------------
def _train(config="cpu", frozen=False, accumulate=1, clip=None, checkpointing=False, two_forwards=False,
           backward_twice=False, **fsdp_kwargs):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy
    from fsdp_lab.models.llama import apply_activation_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    base = Llama(config, seed=0)
    if frozen:
        _freeze(base)
    if checkpointing:
        apply_activation_checkpointing(base)
    model = FSDP(base, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **fsdp_kwargs)
    opt = _make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for step in range(STEPS):
        micros = _microbatches(step, accumulate)
        total = torch.zeros(())
        for i, micro in enumerate(micros):
            local = shard_batch(micro, rank, world)
            last = i == len(micros) - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                if two_forwards:  # each unit runs forward twice before one backward: the same mean
                    loss = sum(model(half).loss for half in local.chunk(2)) / 2 / accumulate
                else:
                    loss = model(local).loss / accumulate
                loss.backward(retain_graph=backward_twice)
                if backward_twice:  # a second backward through the kept graph, after the first ended
                    loss.backward()
            total += loss.detach()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    shards = {f"{h.unit_name}/{h.requires_grad}": (h.numel, h.padded_numel, h.shard_numel, h.flat_shard.numel(),
                                                   sum(b - a for a, b in h.local_slices()))
              for u in model.modules() if isinstance(u, FSDP) for h in u._handles}
    return {"losses": losses, "state": model.state_dict(), "norms": norms, "shards": shards}


def _configs(world: int) -> dict[str, dict]:
    from fsdp_lab.fsdp1 import CPUOffload, ShardingStrategy

    configs = {s.name: dict(sharding_strategy=s) for s in ShardingStrategy if s.name != "HYBRID_SHARD"}
    if world == 4:
        configs["HYBRID_SHARD"] = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    for s in list(configs):
        configs[f"{s}+no_sync"] = dict(configs[s], accumulate=2)
    configs["FULL_SHARD+frozen"] = dict(frozen=True)
    configs["SHARD_GRAD_OP+frozen"] = dict(frozen=True, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    configs["FULL_SHARD+cpu_offload"] = dict(cpu_offload=CPUOffload(offload_params=True))
    configs["FULL_SHARD+tied"] = dict(config="cpu-tied")
    if world == 1:
        # one rank: gathers and reductions are copies (spec.size == 1), run above for every
        # strategy, no_sync, frozen, offload and tied; the hook-order cases below (clip, two
        # forwards, two backwards, checkpointing, concat) run at 2 and 4 ranks
        return configs
    configs["FULL_SHARD+clip"] = dict(clip=0.5)
    configs["FULL_SHARD+checkpointing+frozen"] = dict(checkpointing=True, frozen=True)
    configs["FULL_SHARD+two_forwards"] = dict(two_forwards=True)
    configs["SHARD_GRAD_OP+two_forwards+frozen"] = dict(two_forwards=True, frozen=True,
                                                         sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    configs["FULL_SHARD+two_forwards+checkpointing+frozen"] = dict(two_forwards=True, checkpointing=True, frozen=True)
    configs["FULL_SHARD+backward_twice"] = dict(backward_twice=True)
    configs["FULL_SHARD+backward_twice+checkpointing+frozen"] = dict(backward_twice=True, checkpointing=True,
                                                                     frozen=True)
    configs["FULL_SHARD+concat+no_prefetch"] = dict(grad_accumulation="concat", backward_prefetch=None,
                                                    forward_prefetch=True)
    return configs


def run_rank(world: int) -> dict:
    from test_fsdp1_rank_checks import rank_checks

    results = {name: _train(**kwargs) for name, kwargs in _configs(world).items()}
    results.update(rank_checks(STEPS, LR, EPS))
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"world{n}")
def world_results(request):
    world = request.param
    return world, launch(run_rank, world, world_size=world, timeout=600)


# --- parity with the reference ------------------------------------------------------------------------
def _reference_for(name: str, kwargs: dict):
    return reference(kwargs.get("config", "cpu"), kwargs.get("frozen", False), kwargs.get("accumulate", 1),
                     kwargs.get("clip"), kwargs.get("backward_twice", False))


def _round_off_floor(name: str, kwargs: dict, world: int) -> float:
    """Largest parameter change (absolute) in the single process when each step's batch is summed
    in ``world`` times as many microbatches: the round-off that a different summation order makes."""
    _, whole, _ = _reference_for(name, kwargs)
    _, pieces, _ = reference(kwargs.get("config", "cpu"), kwargs.get("frozen", False),
                             kwargs.get("accumulate", 1) * world, kwargs.get("clip"), kwargs.get("backward_twice", False))
    return max((pieces[k] - v).abs().max().item() for k, v in whole.items())


def test_losses_and_params_match_single_process(world_results):
    world, results = world_results
    for name, kwargs in _configs(world).items():
        ref_losses, ref_state, ref_norms = _reference_for(name, kwargs)
        got = results[0][name]
        for step, (a, b) in enumerate(zip(ref_losses, got["losses"])):
            assert abs(a - b) <= TOL * max(1.0, abs(a)), f"{name} step {step}: loss {b} vs reference {a}"
        assert set(got["state"]) == set(ref_state), name
        for key, ref in ref_state.items():
            diff = (got["state"][key] - ref).abs().max().item()
            if diff > TOL and world > 1:
                # N ranks sum the batch's gradient in N pieces; the single process changes by as
                # much when it sums the same batch in N microbatches (about 1e-6 with frozen units;
                # AdamW's normalised steps amplify it by an amount that depends on the CPU's kernels)
                floor = _round_off_floor(name, kwargs, world)
                assert diff <= max(2 * floor, 2 * TOL), (f"{name}: {key} differs by {diff:.2e} after {STEPS} AdamW steps; "
                                           f"the batch summed in {world} pieces moves one process by {floor:.2e}")
                continue
            assert diff <= TOL, f"{name}: {key} differs by {diff:.2e} after {STEPS} AdamW steps"
        for a, b in zip(ref_norms, got["norms"]):
            assert abs(a - b) <= 1e-5 * a, f"{name}: clip_grad_norm_ {b} vs reference {a}"


def test_same_numbers_as_fsdp2(world_results):
    _, results = world_results
    ours, fsdp2 = results[0]["FULL_SHARD"], results[0]["fsdp2"]
    for a, b in zip(ours["losses"], fsdp2["losses"]):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), (ours["losses"], fsdp2["losses"])
    for key, value in fsdp2["state"].items():
        assert (ours["state"][key] - value).abs().max().item() <= TOL, key


def test_every_rank_ends_with_the_same_full_state(world_results):
    world, results = world_results
    for name in _configs(world):
        for rank in range(1, world):
            for key, value in results[0][name]["state"].items():
                assert torch.equal(value, results[rank][name]["state"][key]), (name, rank, key)


def test_a_parameter_without_gradient_gets_zeros_as_in_pytorch_s_fsdp1(world_results):
    _, results = world_results
    reference = _WithUnusedLayer()
    reference(torch.ones(2, 4)).backward()
    assert reference.unused.weight.grad is None  # one process: no gradient at all
    assert torch.equal(results[0]["unused_grad"], torch.zeros(4, 4))  # FSDP1: zeros (docs/fsdp1.md)


def test_frozen_parameters_do_not_change(world_results):
    _, results = world_results
    start = Llama("cpu", seed=0).state_dict()
    state = results[0]["FULL_SHARD+frozen"]["state"]
    for key in start:
        if key.startswith(FROZEN):
            assert torch.equal(state[key], start[key]), key
    assert not torch.equal(state["layers.2.attention.wk.weight"], start["layers.2.attention.wk.weight"])


def test_shard_sizes_are_ceil_total_over_world_with_padding(world_results):
    world, results = world_results
    for rank, result in enumerate(results):
        shards = result["FULL_SHARD"]["shards"]
        assert len(shards) == 5  # root + 4 blocks
        for unit, (numel, padded, shard, stored, owned) in shards.items():
            assert shard == math.ceil(numel / world) == stored, unit
            assert padded == shard * world and padded - numel < world, unit
            padding_here = max(0, min(shard, (rank + 1) * shard - numel))
            assert owned + padding_here == shard, (unit, rank)
        hybrid = result.get("HYBRID_SHARD")
        if hybrid:
            for unit, (numel, _, shard, _, _) in hybrid["shards"].items():
                assert shard == math.ceil(numel / 2), unit  # 4 ranks = 2 replicas x shard groups of 2
        no_shard = result["NO_SHARD"]["shards"]
        assert all(shard == numel for numel, _, shard, _, _ in no_shard.values())


def test_frozen_and_trainable_params_get_separate_flat_params(world_results):
    _, results = world_results
    shards = results[0]["FULL_SHARD+frozen"]["shards"]
    assert set(k for k in shards if k.startswith("layers.")) == {
        "layers.0/True", "layers.1/False", "layers.2/True", "layers.2/False", "layers.3/True"}
    wq = 128 * 128
    assert shards["layers.2/False"][0] == wq  # only attention.wq is frozen in layers.2


# --- checks that ran on the ranks (see test_fsdp1_rank_checks.py) -------------------------------------------
def test_state_dicts_round_trip_bit_exact(world_results):
    _, results = world_results
    for result in results:
        assert result["full_state_dict_round_trip"] is True
        assert result["sharded_state_dict_round_trip"] is True
        assert result["sharded_state_dict_is_local"] is True


def test_state_dict_loading_errors_name_the_problem(world_results):
    world, results = world_results
    for result in results:
        errors = result["state_dict_errors"]
        assert errors["wrong shape"].startswith("ValueError") and "state dict has shape (3,)" in errors["wrong shape"]
        assert errors["missing name"].startswith("StateDictMismatch: Error(s) in loading state_dict for "
                                                 "FullyShardedDataParallel: state dict mismatch: missing [")
        message = errors["another rank's slice"]
        assert message.startswith("ValueError") and "is not this rank's slice" in message
        assert "same world size and wrapping" in message
    if world > 1:  # rank 0's slices on every rank: the others refuse, and rank 0 stops with them
        first, *others = [result["state_dict_errors"]["rank 0's slices"] for result in results]
        assert first.startswith("ValueError: loading the state dict failed on rank ")
        assert all(o.startswith("ValueError") and "torch.distributed.checkpoint keeps one rank's copy" in o
                   for o in others)


def test_sync_module_states_broadcasts_rank0(world_results):
    _, results = world_results
    assert all(result["sync_module_states"] is True for result in results)


def test_summon_full_params(world_results):
    _, results = world_results
    for result in results:
        shapes = result["summon_shapes"]
        assert shapes["inside"]["layers.0.feed_forward.w1.weight"] == (352, 128)
        assert shapes["after_equals_before"] is True
        assert result["summon_writeback"] is True


def test_summon_full_params_options_as_pytorch_defines_them(world_results):
    _, results = world_results
    for rank, result in enumerate(results):
        options = result["summon_options"]
        assert options["rank0_only_full_here"] is (rank == 0)
        assert options["rank0_only_sharded_here"] is (rank != 0)
        assert options["offload_on_cpu_and_equal"] is True
        assert options["with_grads_max_diff"] <= 1e-6
        assert options["grads_back_to_shards"] is True
        assert "writeback=False" in options["writeback+rank0_only"]
        assert "same device" in options["with_grads+offload_to_cpu"]


@pytest.mark.parametrize("case", ["frozen_reshard", "frozen_reshard_eval_first", "frozen_reshard_checkpointed_around"])
def test_frozen_unit_is_freed_before_the_next_unit_backward(world_results, case):
    world, results = world_results
    for result in results:
        sample = result[case]
        # layers.1 is frozen: re-gathered in its backward, freed as soon as grads w.r.t. its
        # input exist, i.e. before layers.0's backward starts (not at the end of backward).
        assert sample["layers.1 gathered in its backward"] > 0 or world == 1
        assert sample["layers.1 at layers.0 backward start"] == 0
        assert sample["tracker unsharded at layers.0 backward start"] <= sample["tracker unsharded bound"]


def test_prefetch_orders_all_gathers(world_results):
    world, results = world_results
    if world == 1:
        pytest.skip("no all-gathers with one rank")
    orders = results[0]["prefetch_orders"]
    # comm sequence in backward, e.g. ["AG layers.3", "AG layers.2", "RS layers.3", ...]
    none = orders["None"]["backward"]
    assert none.index("RS layers.3") < none.index("AG layers.2"), none
    for mode in ("BACKWARD_PRE", "BACKWARD_POST"):
        seq = orders[mode]["backward"]
        assert seq.index("AG layers.2") < seq.index("RS layers.3"), (mode, seq)
    # PRE issues layers.2's all-gather before layers.3's backward compute starts, POST after it
    assert orders["BACKWARD_PRE"]["layers.2 AG before layers.3 backward starts"] is True
    assert orders["BACKWARD_POST"]["layers.2 AG before layers.3 backward starts"] is False
    # forward: without prefetch each unit gathers in its own pre-forward; with it the next unit
    # only (PyTorch's forward_prefetch), whatever limit_all_gathers says
    assert orders["forward_prefetch"]["AG layers.1 before layers.0 forward ends"] is True
    assert orders["None"]["AG layers.1 before layers.0 forward ends"] is False
    assert orders["forward_prefetch"]["max gathered beyond current"] == 1
    assert orders["forward_prefetch+no_limit"]["max gathered beyond current"] == 1
    # limit_all_gathers is PyTorch's rate limiter: with it every all-gather past the second
    # waits for an earlier free (never blocking on CPU, where a free is done when called)
    assert orders["forward_prefetch"]["limiter waits"] > 0
    assert orders["forward_prefetch+no_limit"]["limiter waits"] == 0


def test_flat_fp32_grads_same_loss_lower_peak(world_results):
    _, results = world_results
    for result in results:
        flat, concat = result["grad_accumulation"]["flat"], result["grad_accumulation"]["concat"]
        assert flat["losses"] == concat["losses"]  # identical, not just close
        assert flat["grads_equal"] is True
        # FSDP's gradient buffers (full-size grads and reduce-scatter inputs) at their peak; the
        # whole-step total is reported by benchmarks/fsdp1_flat_grad.py (on gloo the
        # reduce-scatter's receive buffer, equal in both modes, sets it)
        assert flat["peak"] < concat["peak"], (flat["peak"], concat["peak"])


def test_bad_input_errors(world_results):
    world, results = world_results
    errors = results[0]["errors"]
    assert "already a FullyShardedDataParallel unit" in errors["wrap twice"]
    assert "already managed" in errors["wrap the same module twice"]
    assert "device_id" in errors["device_id on CPU"]
    assert errors["device_id cpu, as PyTorch's FSDP1 needs"] == "no error"
    if world > 1:
        assert "process_group has 1 ranks but the world has" in errors["group not matching the world"]
    if world in (1, 2):
        assert "does not factor" in errors["HYBRID_SHARD on a prime world"]
