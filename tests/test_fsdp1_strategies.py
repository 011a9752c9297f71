"""fsdp_lab.fsdp1: what each sharding strategy gathers, ``clip_grad_norm_`` for every norm type,
and ``ignored_modules``, against references worked in this process.

One 2-rank launch (module-scoped fixture) runs every case on a 2-layer "cpu" Llama and returns
plain values; a 6-rank launch runs the sharding strategies again where a flat parameter needs
padding (no unit's size divides by 6 or by 3) and HYBRID_SHARD splits the world into shard groups
of 3 replicated twice. The tests below only compare them with

* counts and bytes of all-gathers and reductions worked by hand from the model's structure
  (units: the root and one per ``TransformerBlock``) and from the groups each strategy uses,
  following docs/fsdp1.md's table of hooks and PyTorch's FSDP1 (``_post_forward_reshard``: the
  root is not freed after forward, other FULL_SHARD and HYBRID_SHARD units are);
* the same model trained in one process (``torch.nn.utils.clip_grad_norm_``, SGD), on the whole
  global batch or, for an ignored module's gradient, on one rank's half of it.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import launch
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock

WORLD, LAYERS = 2, 2
PADDED_WORLD = 6  # neither unit's numel divides by 6 or by HYBRID_SHARD's shard group of 3
VOCAB, SEQ = 512, 16
BATCH = {WORLD: 4, PADDED_WORLD: 6}  # global batch rows, a multiple of the world
CONFIG = LlamaConfig.from_name("cpu", n_layers=LAYERS)
FP32 = 4
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PADDED_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
CASES = [(WORLD, s) for s in STRATEGIES] + [(PADDED_WORLD, s) for s in PADDED_STRATEGIES]
STEPS = 2
INF = float("inf")
# norm type -> max_norm: about half the step's gradient norm (2: 4.86, inf: 0.289, 1: 1223),
# so clipping scales by about 0.5 (test_clip_grad_norm_* checks that it does clip)
MAX_NORM = {2.0: 2.5, INF: 0.15, 1.0: 600.0}
CLIP_LR = 1.0
IGNORED = "output.weight"  # the LM head, an ignored module
IGNORED_MAX_NORM = 1.0


def _model() -> Llama:
    return Llama(CONFIG, seed=0)


def _batch(step: int = 0, world: int = WORLD):
    return global_batch(VOCAB, BATCH[world], SEQ, step=step)


def _key(norm_type: float) -> str:
    return "inf" if norm_type == INF else str(int(norm_type))


# --- what each rank runs ---------------------------------------------------------------------------
def _wrap(base, **kwargs):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy

    return FSDP(base, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **kwargs)


def _strategy_run(strategy_name: str) -> dict:
    """Two SGD steps; each step's all-gathers (name, bytes) in forward and in backward+step, and,
    after the first forward, what became of the full-shape parameters each module computed with."""
    from fsdp_lab.fsdp1 import ShardingStrategy
    from fsdp_lab.timeline import Timeline

    rank, world = dist.get_rank(), dist.get_world_size()
    base = _model()
    seen = {}  # module name -> {parameter name: the tensor the module held during its forward}

    def keep(name):
        def hook(module, _args, _output):
            seen[name] = dict(module.named_parameters())
        return hook

    hooks = [block.register_forward_hook(keep(f"layers.{i}")) for i, block in enumerate(base.layers)]
    hooks.append(base.register_forward_hook(keep("root")))
    model = _wrap(base, sharding_strategy=getattr(ShardingStrategy, strategy_name))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, after_forward = [], {}
    for step in range(STEPS):
        with Timeline() as forward:
            loss = model(shard_batch(_batch(step, world), rank, world)).loss
        if step == 0:
            for h in hooks:
                h.remove()
            # the module's full-shape tensors, observed once forward has returned: their bytes
            # and, where they still hold any, their values
            for module, params in seen.items():
                for name, t in params.items():
                    if module == "root" and name.startswith("layers."):
                        continue
                    full = f"{module}.{name}" if module != "root" else name
                    alive = t.untyped_storage().nbytes() > 0
                    after_forward[full] = (tuple(t.shape), t.detach().clone() if alive else None)
        with Timeline() as backward:
            loss.backward()
            opt.step()
            opt.zero_grad()
        steps.append({phase: [(e.name, e.bytes, e.args.get("group_size")) for e in tl.comm_events()]
                      for phase, tl in (("forward", forward), ("backward", backward))})
    return {"steps": steps, "after_forward": after_forward, "state": model.state_dict()}


def _clip_run(norm_type: float) -> dict:
    """One FULL_SHARD step: backward, ``model.clip_grad_norm_``, SGD."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap(_model())
    opt = torch.optim.SGD(model.parameters(), lr=CLIP_LR)
    model(shard_batch(_batch(), rank, world)).loss.backward()
    norm = model.clip_grad_norm_(MAX_NORM[norm_type], norm_type)
    opt.step()
    return {"norm": norm.item(), "state": model.state_dict()}


def _ignored_run() -> dict:
    """FULL_SHARD with the LM head ignored: gradients after backward, then clip norms."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    base = _model()
    model = _wrap(base, ignored_modules=[base.output])
    model(shard_batch(_batch(), rank, world)).loss.backward()
    out = {"ignored_shape": tuple(base.output.weight.shape), "ignored_grad": base.output.weight.grad.clone()}
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if n != IGNORED}
    # max_norm far above every norm: the gradients are left as they are (scaled by 1)
    out["norm_inf"] = model.clip_grad_norm_(1e9, INF).item()
    out["norm_1"] = model.clip_grad_norm_(1e9, 1.0).item()
    out["norm_2"] = model.clip_grad_norm_(IGNORED_MAX_NORM, 2.0).item()
    out["ignored_grad_clipped"] = base.output.weight.grad.clone()
    return out


def run_rank() -> dict:
    return {"strategies": {s: _strategy_run(s) for s in STRATEGIES},
            "clip": {_key(t): _clip_run(t) for t in MAX_NORM},
            "ignored": _ignored_run()}


def run_padded_rank() -> dict:
    return {"strategies": {s: _strategy_run(s) for s in PADDED_STRATEGIES}}


@pytest.fixture(scope="module")
def results():
    return launch(run_rank, world_size=WORLD, timeout=300)


@pytest.fixture(scope="module")
def padded_results():
    return launch(run_padded_rank, world_size=PADDED_WORLD, timeout=300)


def _strategy_results(request, world: int) -> list[dict]:
    return request.getfixturevalue("results" if world == WORLD else "padded_results")


# --- references worked in this process ----------------------------------------------------------------
def _numels() -> tuple[int, int]:
    """(root, one block): the root unit owns every parameter outside the blocks."""
    model = _model()
    block = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - LAYERS * block
    return root, block


def _shard_group_size(strategy: str, world: int) -> int:
    """Ranks a flat parameter is split over: the world, 1 for NO_SHARD, and for HYBRID_SHARD on CPU
    the world over its largest divisor <= sqrt(world) (6 ranks: 2 replicas of 3), as
    docs/fsdp1.md says."""
    if strategy == "NO_SHARD":
        return 1
    if strategy == "HYBRID_SHARD":
        replicas = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
        return world // replicas
    return world


def _gathered_bytes(numel: int, group: int) -> int:
    """An all-gather's output: the flat parameter padded to a multiple of the group, float32."""
    return math.ceil(numel / group) * group * FP32


def _expected_gathers(strategy: str, world: int) -> dict[str, list[int]]:
    """Bytes of each all-gather of one step, per phase (forward; backward and optimizer step)."""
    root, block = _numels()
    if strategy == "NO_SHARD":  # every rank holds everything: nothing to gather
        return {"forward": [], "backward": []}
    group = _shard_group_size(strategy, world)
    forward = [_gathered_bytes(root, group)] + [_gathered_bytes(block, group)] * LAYERS  # every unit once
    # FULL_SHARD and HYBRID_SHARD free each block after its forward and gather it again for
    # backward; the root is kept (as PyTorch's FSDP1). SHARD_GRAD_OP keeps every unit gathered
    # until its backward.
    backward = [_gathered_bytes(block, group)] * LAYERS if strategy != "SHARD_GRAD_OP" else []
    return {"forward": forward, "backward": backward}


def _expected_reductions(strategy: str, world: int) -> list[tuple[str, int, int]]:
    """(collective, bytes, group size) of every gradient reduction of one step: each unit's whole
    gradient once, reduce-scattered in its shard group; then, where ranks hold the same shard
    (NO_SHARD's whole world, HYBRID_SHARD's replicas), the shard all-reduced across them."""
    group = _shard_group_size(strategy, world)
    replicas = world // group
    root, block = _numels()
    out = []
    for numel in [root] + [block] * LAYERS:
        if group > 1:
            out.append(("reduce_scatter", _gathered_bytes(numel, group), group))
        if replicas > 1:
            out.append(("all_reduce", math.ceil(numel / group) * FP32, replicas))
    return sorted(out)


@functools.lru_cache(maxsize=None)
def _sgd_reference(steps: int, lr: float, world: int = WORLD) -> dict[str, torch.Tensor]:
    """One process trained on the global batch a launch of ``world`` ranks splits."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        model(_batch(step, world)).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@functools.lru_cache(maxsize=None)
def _clip_reference(norm_type: float):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=CLIP_LR)
    model(_batch()).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[norm_type], norm_type).item()
    opt.step()
    return norm, model.state_dict()


def _grads(batch) -> dict[str, torch.Tensor]:
    model = _model()
    model(batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --- sharding strategies --------------------------------------------------------------------------------
def test_block_size_is_the_documented_one():
    # docs/fsdp1.md's worked example: one block of the "cpu" Llama holds 184,576 elements
    assert _numels()[1] == 184_576


def _case_id(case) -> str:
    return f"{case[1]}-world{case[0]}"


def test_padded_world_pads_every_unit():
    root, block = _numels()
    for strategy in PADDED_STRATEGIES:
        group = _shard_group_size(strategy, PADDED_WORLD)
        assert root % group and block % group, (strategy, group)  # else the launch tests no padding
    assert _shard_group_size("HYBRID_SHARD", PADDED_WORLD) == 3


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_all_gathers_per_step_match_the_strategy(request, case):
    world, strategy = case
    expected = _expected_gathers(strategy, world)
    group = _shard_group_size(strategy, world)
    for rank, result in enumerate(_strategy_results(request, world)):
        for step, phases in enumerate(result["strategies"][strategy]["steps"]):
            for phase, events in phases.items():
                gathers = [nbytes for name, nbytes, _ in events if name == "all_gather"]
                # every unit's whole flat parameter once per gather (the order is the prefetch tests')
                assert sorted(gathers) == sorted(expected[phase]), (strategy, rank, step, phase, gathers)
                assert all(size == group for name, _, size in events if name == "all_gather")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_unit_s_gradient_is_reduced_once_per_step(request, case):
    world, strategy = case
    expected = _expected_reductions(strategy, world)
    for result in _strategy_results(request, world):
        for phases in result["strategies"][strategy]["steps"]:
            reduces = sorted(e for e in phases["backward"] if e[0] != "all_gather")
            assert reduces == expected, (strategy, reduces)
            assert not [e for e in phases["forward"] if e[0] != "all_gather"], phases["forward"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_strategies_train_like_one_process(request, case):
    # the counts above mean nothing if a strategy trains wrongly: two SGD steps against one process
    world, strategy = case
    reference = _sgd_reference(STEPS, 0.1, world)
    for result in _strategy_results(request, world):
        state = result["strategies"][strategy]["state"]
        assert set(state) == set(reference)
        for key, value in reference.items():
            assert (state[key] - value).abs().max().item() <= 1e-6, (strategy, key)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_blocks_stay_gathered_after_forward_only_without_reshard(request, case):
    """The full-shape tensors each module computed with, looked at after the model's forward:
    under SHARD_GRAD_OP and NO_SHARD they still hold the block's whole weights (equal to the
    model's initial weights); under FULL_SHARD a block's are freed (no bytes) while the root's
    are kept for backward (HYBRID_SHARD reshards as FULL_SHARD does)."""
    world, strategy = case
    initial = _model().state_dict()
    for rank, result in enumerate(_strategy_results(request, world)):
        after = result["strategies"][strategy]["after_forward"]
        assert set(after) == set(initial)  # every parameter, blocks and root
        for name, (shape, values) in after.items():
            assert shape == tuple(initial[name].shape), (strategy, name, shape)  # full shape, not 1-D shards
            freed = strategy in ("FULL_SHARD", "HYBRID_SHARD") and name.startswith("layers.")
            if freed:
                assert values is None, f"{strategy}: {name} still holds its gathered bytes after forward"
            else:
                assert values is not None, f"{strategy}: {name} was freed after forward (rank {rank})"
                assert torch.equal(values, initial[name]), (strategy, name)


# --- clip_grad_norm_ ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", list(MAX_NORM), ids=_key)
def test_clip_grad_norm_matches_torch_on_one_process(results, norm_type):
    ref_norm, ref_state = _clip_reference(norm_type)
    assert ref_norm > 1.5 * MAX_NORM[norm_type]  # the step is clipped (scaled by < 2/3)
    initial = _model().state_dict()
    for rank, result in enumerate(results):
        got = result["clip"][_key(norm_type)]
        assert abs(got["norm"] - ref_norm) <= 1e-5 * ref_norm, (rank, got["norm"], ref_norm)
        # the SGD update (lr 1: minus the clipped gradient), parameter by parameter
        for key, value in ref_state.items():
            ref_update, update = value - initial[key], got["state"][key] - initial[key]
            scale = ref_update.abs().max().item()
            assert (update - ref_update).abs().max().item() <= 1e-4 * scale + 1e-7, (norm_type, rank, key)


# --- ignored_modules ---------------------------------------------------------------------------------------
def test_ignored_module_is_whole_and_its_gradient_is_the_rank_s_own(results):
    whole = _grads(_batch())
    for rank, result in enumerate(results):
        ignored = result["ignored"]
        assert ignored["ignored_shape"] == (VOCAB, CONFIG.dim)  # neither flattened nor sharded
        half = _grads(shard_batch(_batch(), rank, WORLD))
        # not reduced: the gradient of this rank's half of the batch, not the whole batch's
        assert torch.allclose(ignored["ignored_grad"], half[IGNORED], rtol=1e-5, atol=1e-7), rank
        assert not torch.allclose(ignored["ignored_grad"], whole[IGNORED], rtol=1e-2, atol=0), rank
        # every other gradient is averaged over the ranks: the whole batch's
        assert set(ignored["grads"]) == set(whole) - {IGNORED}
        for name, grad in ignored["grads"].items():
            assert grad.shape == whole[name].shape, name
            assert torch.allclose(grad, whole[name], rtol=1e-4, atol=1e-7), (rank, name)


def test_clip_grad_norm_adds_the_ignored_module_s_local_norm_once(results):
    whole = _grads(_batch())
    managed = [g for n, g in whole.items() if n != IGNORED]
    norms = []
    halves = [_grads(shard_batch(_batch(), rank, WORLD))[IGNORED] for rank in range(WORLD)]
    for rank, result in enumerate(results):
        ignored = result["ignored"]
        local = halves[rank]
        # by hand: the managed part from the whole batch, the ignored part from this rank's half (a
        # finite norm, as PyTorch's FSDP1: summing every rank's would count one parameter per rank);
        # the infinity norm, a maximum, takes every rank's ignored part, so all ranks agree
        expected = {
            "norm_2": math.sqrt(sum(g.double().pow(2).sum().item() for g in managed) + local.double().pow(2).sum().item()),
            "norm_1": sum(g.double().abs().sum().item() for g in managed) + local.double().abs().sum().item(),
            "norm_inf": max(max(g.abs().max().item() for g in managed), *(h.abs().max().item() for h in halves)),
        }
        for key, value in expected.items():
            assert abs(ignored[key] - value) <= 1e-5 * value, (rank, key, ignored[key], value)
        # clipped by this rank's own total norm
        coef = IGNORED_MAX_NORM / (expected["norm_2"] + 1e-6)
        assert coef < 0.5
        assert torch.allclose(ignored["ignored_grad_clipped"], local * coef, rtol=1e-4, atol=1e-8), rank
        norms.append(expected["norm_2"])
    assert norms[0] != norms[1]  # the ranks' halves differ: each rank adds its own local norm
