"""fsdp_lab.fsdp2.fully_shard against plain single-process training and against PyTorch's fully_shard.

One launch per world size (1, 2, 4) runs every configuration and returns a dict; the
references (single-process training of the same model on the same global batch) run once in
this process. Tests then only compare numbers. What the ranks run is in tests/_fsdp2_parts.py;
the models and the training loop both sides share are in tests/_fsdp2_models.py.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.models.data import global_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

from _fsdp2_models import CONFIG, GLOBAL_BATCH, SEQ, STEPS, EnergyLlama, Uneven, _config, _freeze, _plain_quantized_model, _train, _train_quantized
from _fsdp2_parts import CLIP_MAX_NORM, _rank_suite
from _torch_reference import needs_torch_fsdp2_on_cpu

WORLD_SIZES = (1, 2, 4)
TOL = 1e-6  # parameters: max abs difference
LOSS_REL = 1e-6  # losses (~5): float32 round-off of a mean over ranks


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


@pytest.mark.parametrize("policy", ["fp32", "bf16", "bf16_default", "reduce_bf16_accum"])
def test_matches_torch_fully_shard(suite, policy, torch_fsdp2_reference):
    world, results = suite
    if policy in ("bf16_default", "reduce_bf16_accum") and world > 2:
        pytest.skip("a bf16 sum of more than two ranks' gradients depends on the order of the additions "
                    "(ours: gloo's reduce onto each chunk's owner; PyTorch's: gloo's reduce-scatter), so it "
                    "matches to bf16's precision only")
    ours, theirs = results[0][f"vs_torch_{policy}_ours"], results[0][f"vs_torch_{policy}_torch"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=TOL)
    assert _max_diff(ours["local"], theirs["local"]) <= TOL
    for other in results[1:]:
        mine = other["losses_by_config"][f"vs_torch_{policy}_ours"]
        assert mine == pytest.approx(other["losses_by_config"][f"vs_torch_{policy}_torch"], abs=TOL)


@needs_torch_fsdp2_on_cpu
def test_bf16_differs_from_fp32(suite):
    """The bf16 comparison is not vacuous: bf16 compute changes the losses."""
    _, results = suite
    assert results[0]["vs_torch_bf16_ours"]["losses"] != results[0]["vs_torch_fp32_ours"]["losses"]


def test_checkpoint_round_trip_bit_exact(suite):
    _, results = suite
    assert results[0]["dcp_max_diff"] == 0.0
    assert not results[0]["dcp_checkpoint_left"]  # the run leaves nothing in the temporary directory


def test_clip_grad_norm_on_dtensors(suite):
    # the ranks: one step of training, the DCP round trip, a backward on step 99's batch, then
    # clip_grad_norm_ of the DTensor parameters; here: the same on one process, whole batch
    _, results = suite
    model = Llama(_config(), seed=0)
    _train(model, 0, 1, steps=1)
    batch = global_batch(512, GLOBAL_BATCH, SEQ, step=99)
    model(batch.input_ids, batch.labels).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM).item()
    assert norm > 2 * CLIP_MAX_NORM  # so the gradients were really scaled down
    clip = results[0]["clip"]
    assert clip["norm"] == pytest.approx(norm, rel=1e-5)
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert clip["grads"].keys() == expected.keys()
    assert _max_diff(clip["grads"], expected) <= TOL


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
    root_bytes, layer_bytes = _group_bytes(LlamaConfig.from_name("cpu"), 2)
    assert extras["tracker_max"]["unsharded_params"] == root_bytes + layer_bytes


def test_an_all_gather_in_flight_holds_its_output_only(extras):
    # as PyTorch's FSDP2, the rank's input is its own rows of the output buffer: one buffer of
    # the gathered group's bytes, not that plus a shard-sized copy-in buffer
    _, layer_bytes = _group_bytes(LlamaConfig.from_name("cpu"), 2)
    assert extras["gather_comm_buffers"] == {"in_flight": layer_bytes, "waited": 0}


def test_step_peak_is_not_above_pytorch_s(extras, torch_fsdp2_reference):
    peaks = extras["step_peaks"]
    # the same model, batch and AdamW step, tracked alike: ours holds no buffer PyTorch's does not
    assert peaks["ours"] <= peaks["torch"], peaks


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
    assert ("layers.1", True) not in without[:without.index(("backward", None))]


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
    ("string_gradient_sync", "TypeError", "requires_gradient_sync must be True or False, got 'no'"),
    ("int_reshard_after_backward", "TypeError", "reshard_after_backward must be True or False, got 0"),
    ("mixed_trainable_dtypes", "ValueError",
     "groups trainable parameters of different dtypes (0.weight float32, 0.bias float32, 2.weight float64"),
    ("no_such_forward_method", "ValueError", "FSDPLinear has no method 'generate'"),
])
def test_bad_input_errors(extras, case, error, words):
    raised = extras["errors"][case]
    assert raised is not None, f"{case} did not raise"
    assert raised[0] == error and words in raised[1], raised


def test_a_block_frozen_after_sharding_gets_no_gradient(extras):
    frozen = extras["requires_grad_freeze_ours"]
    assert frozen["grads_of_block"] == [0, 0, 0] and frozen["block_unchanged"]
    unfrozen = extras["requires_grad_unfreeze_ours"]
    blocks_params = len(list(Llama(_config(), seed=0).layers[0].parameters()))
    assert unfrozen["grads_of_block"] == [0, blocks_params, blocks_params] and not unfrozen["block_unchanged"]


def test_a_bf16_block_frozen_when_sharded_and_trained_later_is_said_once(extras):
    unfrozen = extras["unfrozen_bf16"]
    assert unfrozen["dtypes"] == (torch.bfloat16, torch.float32)  # frozen rule kept; the others fp32 masters
    assert len(unfrozen["warnings"]) == 1 and "layers.0" in unfrozen["warnings"][0]
    assert "Unfreeze them before fully_shard" in unfrozen["warnings"][0]


@pytest.mark.parametrize("case", ["freeze", "unfreeze"])
def test_requires_grad_changed_after_sharding_matches_torch(extras, case, torch_fsdp2_reference):
    ours, theirs = extras[f"requires_grad_{case}_ours"], extras[f"requires_grad_{case}_torch"]
    assert ours["grads_of_block"] == theirs["grads_of_block"]
    assert _max_diff(ours["local"], theirs["local"]) <= TOL


def test_registered_forward_method_trains_like_one_process(extras):
    from _fsdp2_models import _train_two_entry_points

    model = EnergyLlama(_config(), seed=0)
    _train_two_entry_points(model, 0, 1)
    assert _max_diff(extras["forward_method_ours"]["full"], model.state_dict()) <= TOL


def test_registered_forward_method_matches_torch(extras, torch_fsdp2_reference):
    if "forward_method_torch" not in extras:
        pytest.skip(f"torch {torch.__version__} has no register_fsdp_forward_method")
    assert _max_diff(extras["forward_method_ours"]["local"], extras["forward_method_torch"]["local"]) <= TOL


def test_registered_forward_method_keeps_no_cycle(extras):
    # PyTorch's stores a method bound to the module on the module itself: a cycle the collector frees
    assert extras["forward_method_ours_freed_without_collector"]


def test_register_forward_method_leaves_a_plain_module_alone():
    from fsdp_lab.fsdp2 import register_fsdp_forward_method

    model = EnergyLlama(_config(), seed=0)
    register_fsdp_forward_method(model, "hidden_energy")  # no process group needed: nothing to do
    assert "hidden_energy" not in model.__dict__


def test_two_forwards_then_one_backward_matches_single_process(extras):
    from _fsdp2_models import two_forwards_one_backward

    model = Llama(_config(), seed=0)
    two_forwards_one_backward(model, 0, 1)  # both batches whole, in one process
    assert _max_diff(extras["two_forwards_ours"]["full"], model.state_dict()) <= TOL


def test_two_forwards_then_one_backward_matches_torch(extras, torch_fsdp2_reference):
    ours, theirs = extras["two_forwards_ours"], extras["two_forwards_torch"]
    assert _max_diff(ours["local"], theirs["local"]) <= TOL


@pytest.mark.parametrize("case", ["other_dtype_frozen", "other_dtype_sharded_apart"])
def test_parameters_of_another_dtype_frozen_or_sharded_apart_are_accepted(extras, case):
    assert extras["errors"][case] is None


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


@pytest.mark.parametrize("case,words", [
    # the root sharded before its blocks: the blocks' parameters are the root's DTensors by then
    ("root_first", "parameter Linear.weight is a DTensor already: fully_shard of a module above it ran first"),
    # built on meta, sharded, never given memory: torch's "Cannot copy out of meta tensor" otherwise
    ("meta_forward", "0.weight is still on the meta device at the first forward: after fully_shard, call "
                     "model.to_empty(device=...)"),
    # a container is never called: PyTorch's refuses it too (its forward would fail on mixed tensors)
    ("module_list", "fully_shard cannot shard an nn.ModuleList: a container without forward is never called"),
])
def test_misuse_is_named_with_the_fix(case, words):
    from fsdp_lab.fsdp2 import fully_shard

    with fsdp_lab.simulated_world(2):
        if case == "root_first":
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            fully_shard(model)
            call = functools.partial(fully_shard, model[0])
        elif case == "module_list":
            call = functools.partial(fully_shard, nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
        else:
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(4, 4))
            call = functools.partial(fully_shard(model), torch.ones(1, 4))
        with pytest.raises((ValueError, RuntimeError), match=re.escape(words)):
            call()


def _inference_mode_forwards():
    from fsdp_lab.fsdp2 import fully_shard

    out = {}
    for first in ("inference", "training"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        fully_shard(model[0])
        fully_shard(model)
        x = torch.ones(4, 8)
        if first == "training":
            model(x).sum().backward()
        with torch.inference_mode():
            seen = model(x)
        with torch.no_grad():
            expected = model(x)
        model(x).sum().backward()  # trains on after it, whichever came first
        out[first] = (seen.clone(), expected, model[2].weight.grad.full_tensor())
    return out


def test_a_forward_under_inference_mode_matches_no_grad_and_training_goes_on():
    # it failed inside FSDP2's copy-out ("Inference tensors do not track version counter") and
    # left the model unusable; PyTorch's fully_shard runs it after a training step
    for seen, expected, grad in fsdp_lab.launch(_inference_mode_forwards, world_size=2)[0].values():
        torch.manual_seed(0)
        reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        assert torch.equal(seen, expected)
        torch.testing.assert_close(seen, reference(torch.ones(4, 8)).detach(), rtol=1e-6, atol=1e-6)
        assert grad.abs().sum() > 0


def test_pytorch_s_placement_keywords_are_taken_at_their_default_and_refused_otherwise():
    from fsdp_lab.fsdp2 import fully_shard

    with fsdp_lab.simulated_world(2):
        sharded = fully_shard(nn.Linear(4, 4), shard_placement_fn=None, dp_mesh_dims=None)  # as torchtitan passes them
        assert sharded.weight.placements[0].is_shard(0)
        with pytest.raises(NotImplementedError, match=r"fully_shard\(shard_placement_fn=...\) is not supported"):
            fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: None)


class _WithExtraState(nn.Linear):
    """A module with extra state, as nn.Module saves it (``<module>._extra_state``)."""

    def get_extra_state(self):
        return {"step": int(self.weight.numel())}

    def set_extra_state(self, state):
        self.loaded = state


def _extra_state_round_trip():
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict, load_full_state_dict

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_WithExtraState(4, 4), nn.Linear(4, 2))
        fully_shard(model[0])
        return fully_shard(model)

    saved = get_full_state_dict(build(0), rank0_only=False)
    out = {"saved": saved}
    for broadcast in (False, True):
        model = build(1)
        given = saved if dist.get_rank() == 0 or not broadcast else None
        out[broadcast] = (load_full_state_dict(model, given, broadcast_from_rank0=broadcast),
                          model[0].loaded, get_full_state_dict(model, rank0_only=False))
    return out


def test_a_module_s_extra_state_round_trips_through_full_state_dicts():
    reference = nn.Sequential(_WithExtraState(4, 4), nn.Linear(4, 2))  # what nn.Module saves
    for rank in fsdp_lab.launch(_extra_state_round_trip, world_size=2):
        assert list(rank["saved"]) == list(reference.state_dict())
        assert rank["saved"]["0._extra_state"] == {"step": 16}
        for broadcast in (False, True):
            result, loaded, after = rank[broadcast]
            assert (result.missing_keys, result.unexpected_keys) == ([], []) and loaded == {"step": 16}
            assert all(torch.equal(after[k], v) for k, v in rank["saved"].items() if isinstance(v, torch.Tensor))
