"""QLoRA (NF4 base weights + LoRA adapters) under fsdp_lab's FSDP2, against single-process QLoRA.

One launch per world size (2, 4) runs every configuration and returns a dict; the reference
(single-process QLoRA of the same model on the same global batch) runs once in this process.
Byte counts of all-gathers are checked against the NF4 storage formula worked out here by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig
from fsdp_lab.qlora import NF4Tensor, apply_lora, to_nf4
from fsdp_lab.states import ShardedState

WORLD_SIZES = (2, 4)
STEPS = 5
GLOBAL_BATCH, SEQ = 4, 16
LR, EPS = 5e-3, 1e-4
RANK, ALPHA = 8, 16
TOL = 1e-5
PEAK_TOLERANCE = 0.07  # estimate vs measured peak, as in test_memory_estimate.py
# FSDP2: adapters grouped with their block / each LoRALinear its own group; FSDP1: one unit per block
VARIANTS = ("per_block", "per_linear", "fsdp1")


def _qlora_model():
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    torch.manual_seed(0)  # the adapters' Kaiming init draws from the global generator
    return apply_lora(model, rank=RANK, alpha=ALPHA, quantize_base=True)


def _train(model, rank, world, on_first_step=None):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=step), rank, world)
        loss = model(batch.input_ids, batch.labels).loss
        loss.backward()
        if on_first_step is not None and step == 0:
            on_first_step()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- what every rank runs ------------------------------------------------------------------------
def _rank_suite():
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard
    from fsdp_lab.qlora.lora import LoRALinear
    from fsdp_lab.timeline import Timeline

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # first, while no other model is alive: the estimator's QLoRA numbers against the tracker
    if world == 2:
        from fsdp_lab.memory.measure import measure_step
        out["memory"] = {ac: measure_step("cpu", strategy="fsdp2", batch_size=2, seq_len=64, qlora=True,
                                          activation_checkpointing=ac) for ac in (False, True)}
    out["fsdp1"] = _fsdp1_run(rank, world)
    out["fsdp1_checkpoint"] = _fsdp1_checkpoint(rank, world)
    out["fsdp1_bf16"] = _fsdp1_bf16_run(rank, world)
    for variant in VARIANTS[:2]:
        model = _qlora_model()
        if variant == "per_linear":
            for m in model.modules():
                if isinstance(m, LoRALinear):
                    fully_shard(m)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        flags = {n: (type(p.to_local()).__name__, p.requires_grad) for n, p in model.named_parameters()}
        resharded = []

        def after_backward():
            resharded.append(all(s._fsdp_state.group.sharded_state == ShardedState.SHARDED for s in model.modules()
                                 if hasattr(s, "_fsdp_state") and s._fsdp_state.group is not None))

        with Timeline() as tl:
            losses = _train(model, rank, world, on_first_step=after_backward)
        gathers = [(e.args.get("module"), e.bytes) for e in tl.comm_events(rank, "all_gather")]
        local = {}
        for name, p in model.named_parameters():
            t = p.to_local()
            if isinstance(t, NF4Tensor):
                local[name] = {k: getattr(t, k).clone() for k in ("packed", "scales", "scale_factors")}
            else:
                local[name] = t.detach().clone()
        out[variant] = {"losses": losses, "local": local, "flags": flags, "gathers": gathers,
                        "resharded": resharded[0]}

    # the all-gather of one NF4 weight alone, and of the same weight in bf16
    torch.manual_seed(1)
    for kind in ("nf4", "bf16"):
        layer = nn.Linear(128, 352, bias=False)
        weight = layer.weight.detach()
        layer.weight = nn.Parameter(to_nf4(weight) if kind == "nf4" else weight.bfloat16(), requires_grad=False)
        fully_shard(layer)
        with Timeline() as tl:
            layer(torch.randn(2, 128, dtype=torch.float32 if kind == "nf4" else torch.bfloat16))
        out[kind] = [e.bytes for e in tl.comm_events(rank, "all_gather")]
    return out


def _fsdp1_run(rank, world):
    """QLoRA under fsdp_lab's FSDP1 (one unit per block): NF4 bytes in their own flat parameters."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
    from fsdp_lab.models.llama import TransformerBlock
    from fsdp_lab.timeline import Timeline

    model = _qlora_model()
    names = {id(p): n for n, p in model.named_parameters()}
    block1 = model.layers[1]
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    nf4_handles = [h for u in units for h in u._handles if type(h).__name__ == "NF4FlatParamHandle"]
    unit1 = next(u for u in units if u.module is block1)
    seen = []
    # when block 0's backward starts, block 1's frozen NF4 bytes must already be freed
    model.module.layers[0].register_full_backward_pre_hook(
        lambda *_: seen.append(sum(h.unsharded_bytes() for h in unit1._handles if not h.requires_grad)))
    with Timeline() as tl:
        losses = _train(model, rank, world)
    local = {}
    for h in (h for u in units for h in u._handles):
        if h.requires_grad:
            for info, (a, b) in zip(h.infos, h.bounds):
                local[names[id(info.param)]] = (a, b, info.param.detach().clone())
    for h in nf4_handles:
        inner = h.handles[torch.uint8]
        for weight, packed, (a, b) in zip(h.infos, inner.infos, inner.bounds):  # the only uint8 inner tensor
            local[names[id(weight.param)] + ".packed"] = (a, b, packed.param.detach().clone())
    flags = {n: (type(p).__name__, p.requires_grad) for n, p in model.named_parameters()}
    gathers = [(e.args.get("module"), e.bytes) for e in tl.comm_events(rank, "all_gather")]
    return {"losses": losses, "local": local, "flags": flags, "gathers": gathers,
            "resharded": bool(seen) and all(b == 0 for b in seen)}


def _fsdp1_checkpoint(rank, world):
    """FSDP1 QLoRA: a sharded state dict through torch.save / torch.load(weights_only=True) into a
    model built from other weights; a full state dict refused half-way leaves the model trainable."""
    import io

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy, StateDictType
    from fsdp_lab.models.llama import TransformerBlock

    def wrapped(seed):
        model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=seed)
        torch.manual_seed(seed)
        return FSDP(apply_lora(model, rank=RANK, alpha=ALPHA, quantize_base=True),
                    auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))

    def sharded(model):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return model.state_dict()

    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=7), rank, world)
    saved_model = wrapped(0)
    _train(saved_model, rank, world)
    saved = sharded(saved_model)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded_model = wrapped(1)
    before = sharded(loaded_model)
    with FSDP.state_dict_type(loaded_model, StateDictType.SHARDED_STATE_DICT):
        loaded_model.load_state_dict(torch.load(buffer, weights_only=True))
    with torch.no_grad():
        losses = [m(batch.input_ids, batch.labels).loss.item() for m in (saved_model, loaded_model)]
    out = {"saved": saved, "before": before, "loaded": sharded(loaded_model), "losses": losses}

    # a full state dict refused half-way (the last unit's NF4 weights refuse to gather): the
    # error, then every parameter gathered before is a shard again and training goes on
    import contextlib

    @contextlib.contextmanager
    def refusing(**_):
        raise NotImplementedError("this flat parameter refuses to be gathered")
        yield

    last = [u for u in saved_model.modules() if isinstance(u, FSDP)][-1]
    nf4_handle = next(h for h in last._handles if type(h).__name__ == "NF4FlatParamHandle")
    nf4_handle.full_params = refusing
    opt = torch.optim.AdamW([p for p in saved_model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    shapes = {n: tuple(p.shape) for n, p in saved_model.named_parameters()}
    try:
        saved_model.state_dict()
        out["full_refused"] = "no error"
    except NotImplementedError as error:
        out["full_refused"] = str(error)
    del nf4_handle.full_params
    out["shapes_kept"] = shapes == {n: tuple(p.shape) for n, p in saved_model.named_parameters()}
    saved_model(batch.input_ids, batch.labels).loss.backward()
    opt.step()
    out["step_after_refusal"] = saved_model(batch.input_ids, batch.labels).loss.item()
    # the same step on the loaded copy, which holds the same weights and was never refused
    never = torch.optim.AdamW([p for p in loaded_model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    loaded_model(batch.input_ids, batch.labels).loss.backward()
    never.step()
    out["step_never_refused"] = loaded_model(batch.input_ids, batch.labels).loss.item()
    return out


def _fsdp1_bf16_run(rank, world):
    """FSDP1 with MixedPrecision(param_dtype=bf16): what forward sees of one NF4 weight."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy
    from fsdp_lab.models.llama import TransformerBlock

    model = _qlora_model()
    target = model.layers[0].feed_forward.w1
    seen = []
    target.register_forward_pre_hook(lambda m, _: seen.append((m.weight.dtype, m.weight.packed.clone())))
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    losses = _train(model, rank, world)
    return {"losses": losses, "dtype": str(seen[-1][0]), "packed": seen[-1][1]}


def _stitch(ranks, name, numel):
    """FSDP1: each rank holds elements [a, b) of the flattened parameter."""
    full = None
    for r in ranks:
        a, b, piece = r["fsdp1"]["local"][name]
        if full is None:
            full = torch.zeros(numel, dtype=piece.dtype)
        full[a:b] = piece.reshape(-1)
    return full


@pytest.fixture(scope="module")
def reference():
    model = _qlora_model()
    packed = {n: p.packed.clone() for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    scales = {n: p.scales.clone() for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    losses = _train(model, 0, 1)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "lora": lora, "packed": packed, "scales": scales}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request):
    return fsdp_lab.launch(_rank_suite, world_size=request.param, timeout=600)


def _gathered(ranks, variant, name, like):
    """The full tensor from every rank's piece: Shard(0) rows (FSDP2) or flat ranges (FSDP1)."""
    if variant == "fsdp1":
        return _stitch(ranks, name, like.numel()).view(like.shape)
    return torch.cat([r[variant]["local"][name] for r in ranks])[: like.shape[0]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_weights_match_single_process(ranks, reference, variant):
    for name, expected in reference["lora"].items():
        got = _gathered(ranks, variant, name, expected)
        assert got.shape == expected.shape, name
        assert (got - expected).abs().max().item() <= TOL, name
    moved = max((p.abs().max().item() for n, p in reference["lora"].items() if n.endswith("lora_b")))
    assert moved > 1e-3  # the adapters did train


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_decreases_and_matches(ranks, reference, variant):
    world = len(ranks)
    mean = [sum(r[variant]["losses"][s] for r in ranks) / world for s in range(STEPS)]
    assert mean[-1] < mean[0]
    assert max(abs(a - b) for a, b in zip(mean, reference["losses"])) < 1e-5 * mean[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_bytes_unchanged(ranks, reference, variant):
    for name, packed in reference["packed"].items():
        if variant == "fsdp1":
            assert torch.equal(_stitch(ranks, f"{name}.packed", packed.numel()), packed), name
            continue
        got = torch.cat([r[variant]["local"][name]["packed"] for r in ranks])
        assert torch.equal(got[: packed.numel()], packed), name
        assert torch.equal(torch.cat([r[variant]["local"][name]["scales"] for r in ranks])[: packed.numel() // 32],
                           reference["scales"][name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_nf4_frozen_lora_trainable(ranks, variant):
    flags = ranks[0][variant]["flags"]
    nf4 = {n for n, (kind, _) in flags.items() if kind == "NF4Tensor"}
    assert len(nf4) == 2 * 7, sorted(flags)
    assert all(not flags[n][1] for n in nf4)
    trainable = {n for n, (_, grad) in flags.items() if grad}
    assert trainable == {n for n in flags if n.endswith(("lora_a", "lora_b"))} and len(trainable) == 2 * 7 * 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_frozen_units_resharded_after_backward(ranks, variant):
    assert all(r[variant]["resharded"] for r in ranks)


def _nf4_all_gather_bytes(rows, cols, world, block=64, scaler=256):
    """By hand: each rank sends ceil(n_blocks / world) blocks (block/2 code bytes + one int8
    scale each), the float32 factor of every scaler group its blocks touch (the most any
    rank touches) and the float32 mean; the output holds world times that."""
    n_blocks = math.ceil(rows * cols / block)
    per_rank = math.ceil(n_blocks / world)
    groups = max((r * per_rank + per_rank - 1) // scaler - (r * per_rank) // scaler + 1 for r in range(world))
    return world * (per_rank * (block // 2 + 1) + 4 * (groups + 1))


def test_nf4_all_gather_moves_packed_bytes(ranks):
    world = len(ranks)
    expected = _nf4_all_gather_bytes(352, 128, world)
    numel = 352 * 128
    for r in ranks:
        assert r["nf4"] == [expected]
        assert r["bf16"] == [2 * numel]  # 352 rows split evenly over 2 and 4 ranks
    # ~ numel/2 + one byte per 64 values: about 0.27 of the bf16 bytes
    assert numel / 2 + numel / 64 <= expected <= numel / 2 + numel / 64 + 4 * (2 * world + world)
    assert expected / (2 * numel) < 0.27


def test_lora_linear_group_bytes(ranks):
    """Each LoRALinear's own group gathers NF4 bytes plus its float32 adapters (Shard(0) rows)."""
    world = len(ranks)
    cfg = LlamaConfig.from_name("cpu")
    d, f, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
    shapes = {"wq": (cfg.n_heads * hd, d), "wk": (cfg.n_kv_heads * hd, d), "wv": (cfg.n_kv_heads * hd, d),
              "wo": (d, cfg.n_heads * hd), "w1": (f, d), "w3": (f, d), "w2": (d, f)}

    def rows(n):
        return math.ceil(n / world) * world

    expected = sorted(_nf4_all_gather_bytes(o, i, world) + 4 * (rows(RANK) * i + rows(o) * RANK)
                      for o, i in shapes.values())
    # the timeline labels each group by the qualified name of its module, e.g. layers.0.attention.wq
    got = [b for module, b in ranks[0]["per_linear"]["gathers"] if module.rsplit(".", 1)[-1] in shapes]
    assert sorted(set(got)) == sorted(set(expected))
    # forward and backward (resharded after forward) of 2 layers' 7 linears in each step
    assert len(got) == STEPS * 2 * 2 * len(shapes)


# -- memory: the NF4 storage formula and the estimator against the MemoryTracker -----------------
@pytest.mark.parametrize("numel", [64, 100, 4096, 64 * 256 * 3 + 5])
@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_storage_bytes(numel, double_quant):
    from fsdp_lab.qlora.nf4 import nf4_storage_bytes
    t = to_nf4(torch.randn(numel), double_quant=double_quant)
    blocks = math.ceil(numel / 64)
    by_hand = blocks * 32 + (blocks + 4 * math.ceil(blocks / 256) + 4 if double_quant else 4 * blocks)
    stored = sum(getattr(t, k).numel() * getattr(t, k).element_size()
                 for k in ("packed", "scales", "scale_factors", "scale_mean"))
    assert stored == by_hand == nf4_storage_bytes(numel, double_quant=double_quant)


def _check_estimate(measured, est, sharded):
    at_step = est.phases["optimizer_step"]
    params = "sharded_params" if sharded else "params"
    assert measured.current[params] == at_step[params]
    assert measured.current["optimizer_state"] == at_step["optimizer_state"]
    assert measured.current["quantized"] == at_step["quantized"]
    acts = est.phases["forward_end"]["activations"]
    assert abs(measured.max_by_category["activations"] - acts) <= 0.10 * acts
    assert abs(measured.peak_total - est.total) <= PEAK_TOLERANCE * est.total


@pytest.mark.parametrize("config", ["cpu", LlamaConfig(name="cpu-qwen-like", qkv_bias=True, qk_norm=True,
                                                         explicit_head_dim=48)], ids=["cpu", "qwen_like"])
def test_estimate_matches_tracker_single_process(config):
    """Qwen-like shapes: the q/k/v biases and head norms stay frozen in float32 beside the NF4
    weights, and the head norms' outputs are not kept for their frozen weights' gradients."""
    from fsdp_lab.memory.estimate import estimate
    from fsdp_lab.memory.measure import measure_step
    measured = measure_step(config, strategy="ddp", batch_size=2, seq_len=64, qlora=True)
    est = estimate(config, world_size=1, strategy="ddp", batch_size=2, seq_len=64, qlora=True)
    _check_estimate(measured, est, sharded=False)
    if config != "cpu":
        return
    assert measured.current["quantized"] == 4 * sum(  # 4 layers of 7 NF4 linears, by hand
        math.ceil(n / 64) * 33 + 4 * math.ceil(n / 64 / 256) + 4
        for n in (128 * 128, 64 * 128, 64 * 128, 128 * 128, 352 * 128, 352 * 128, 128 * 352))


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_estimate_matches_tracker_fsdp2(ranks, ac):
    from fsdp_lab.memory.estimate import estimate
    if len(ranks) != 2:
        pytest.skip("measured on 2 ranks only")
    est = estimate("cpu", world_size=2, strategy="fsdp2", batch_size=2, seq_len=64, qlora=True,
                   activation_checkpointing=ac)
    for r in ranks:
        _check_estimate(r["memory"][ac], est, sharded=True)


def test_fsdp1_gathers_nf4_bytes_per_dtype(ranks):
    """FSDP1: a block's NF4 weights travel as three frozen flat parameters, uint8 codes, int8
    scales and float32 factors + means, each padded to a multiple of the world size."""
    world = len(ranks)
    cfg = LlamaConfig.from_name("cpu")
    d, f, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
    numels = [cfg.n_heads * hd * d, cfg.n_kv_heads * hd * d, cfg.n_kv_heads * hd * d, d * cfg.n_heads * hd,
              f * d, f * d, d * f]
    blocks = [math.ceil(n / 64) for n in numels]

    def padded(n):
        return math.ceil(n / world) * world

    expected = {padded(sum(b * 32 for b in blocks)), padded(sum(blocks)),
                4 * padded(sum(math.ceil(b / 256) + 1 for b in blocks))}
    got = {b for module, b in ranks[0]["fsdp1"]["gathers"] if module == "layers.0"}
    assert expected <= got
    assert sum(expected) / (2 * sum(numels)) < 0.27  # against the same weights in bf16


def _entry_tensors(entry):
    """The tensors of a sharded state-dict entry: a ShardedParam's local part, a ShardedNF4's parts."""
    from fsdp_lab.fsdp1 import ShardedParam

    if isinstance(entry, ShardedParam):
        return [entry.local]
    if hasattr(entry, "parts"):
        return [part.local for part in entry.parts.values()]
    return [entry]


def test_fsdp1_sharded_state_dict_round_trips_bit_exactly(ranks):
    for r in ranks:
        run = r["fsdp1_checkpoint"]
        saved, before, loaded = run["saved"], run["before"], run["loaded"]
        assert saved.keys() == loaded.keys()
        nf4 = [k for k, v in saved.items() if type(v).__name__ == "ShardedNF4"]
        assert len(nf4) == 2 * 7  # every NF4 weight has its bytes in the checkpoint
        for key in saved:
            assert all(torch.equal(a, b) for a, b in zip(_entry_tensors(saved[key]), _entry_tensors(loaded[key]))), key
        # the loaded model started from other weights: the round trip is not vacuous
        assert any(not torch.equal(a, b) for k in nf4 for a, b in zip(_entry_tensors(saved[k]),
                                                                      _entry_tensors(before[k])))
        assert run["losses"][0] == run["losses"][1]


def test_refused_fsdp1_full_state_dict_leaves_the_model_trainable(ranks):
    for r in ranks:
        run = r["fsdp1_checkpoint"]
        assert "refuses to be gathered" in run["full_refused"]
        assert run["shapes_kept"] is True
        assert math.isfinite(run["step_after_refusal"])
        assert run["step_after_refusal"] == run["step_never_refused"]


def test_fsdp1_mixed_precision_leaves_nf4_bytes_alone(ranks, reference):
    """bf16 MixedPrecision casts floats, never the packed codes: forward sees the original bytes
    as a bf16 NF4 weight, and training stays close to the float32 reference."""
    name = "layers.0.feed_forward.w1.weight"
    for r in ranks:
        run = r["fsdp1_bf16"]
        assert run["dtype"] == "torch.bfloat16"
        assert torch.equal(run["packed"][: reference["packed"][name].numel()], reference["packed"][name])
    mean = [sum(r["fsdp1_bf16"]["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]
    assert mean[-1] < mean[0]
    assert abs(mean[0] - reference["losses"][0]) < 2e-2


def _tiny_qlora(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    apply_lora(model, target_modules=["0", "2"], rank=4, alpha=8)
    return model


def _fsdp1_wrapped_by_hand_then_moved():
    """FSDP1 units made by hand, bottom up (each parent's wrap moves its children), then
    ``model.to("cpu")`` where everything already is; one SGD step. Returns the adapters, whole."""
    import torch.distributed as dist

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_qlora()
    model[0], model[2] = FSDP(model[0]), FSDP(model[2])
    model = FSDP(model).to("cpu")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(x[rank * 4 // world:(rank + 1) * 4 // world]).pow(2).mean().backward()
    opt.step()
    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}


def test_fsdp1_qlora_units_wrapped_by_hand_and_moved_train_like_one_process():
    # torch's Module._apply swapped each NF4 weight with itself, which the weak references FSDP
    # keeps on it refuse ("Couldn't swap LoRALinear.weight")
    model = _tiny_qlora()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(x).pow(2).mean().backward()
    opt.step()
    expected = {n: p.detach() for n, p in model.named_parameters() if "lora" in n}
    for got in fsdp_lab.launch(_fsdp1_wrapped_by_hand_then_moved, world_size=2, timeout=120):
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert (got[name] - value).abs().max().item() <= 1e-6, name
