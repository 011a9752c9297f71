"""QLoRA checkpoints under both FSDPs: full, sharded, DCP and adapters-only, across world sizes.

One launch on 2 ranks trains a QLoRA model under each FSDP and saves every kind of checkpoint
into a temporary folder; one launch on 4 ranks loads them into models built from other
weights, under both FSDPs; this process loads them on 1 (a plain model). The references are
independent of the code under test: the one-process QLoRA model (``to_nf4`` of the same
weights: NF4 bytes must be equal bit for bit) trained on the same global batches.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig
from fsdp_lab.qlora import NF4Tensor, apply_lora, load_lora_state_dict, lora_state_dict, to_nf4

STEPS, GLOBAL_BATCH, SEQ, LR = 2, 4, 16, 5e-3
INNER = ("packed", "scales", "scale_factors", "scale_mean")
KINDS = ("fsdp2", "fsdp1")


def _build(seed):
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=seed)
    torch.manual_seed(seed)  # the adapters' init draws from the global generator
    return apply_lora(model, rank=8, alpha=16, quantize_base=True)


def _wrap(kind, seed):
    model = _build(seed)
    if kind == "fsdp2":
        from fsdp_lab.fsdp2 import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
    from fsdp_lab.models.llama import TransformerBlock

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))


def _train(model, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=step), rank, world)
        model(batch.input_ids, batch.labels).loss.backward()
        opt.step()
        opt.zero_grad()


@torch.no_grad()
def _loss(model, rank, world):
    batch = shard_batch(global_batch(512, GLOBAL_BATCH, SEQ, step=9), rank, world)
    return model(batch.input_ids, batch.labels).loss.item()


def _full(kind, model):
    if kind == "fsdp2":
        from fsdp_lab.fsdp2 import get_full_state_dict

        return get_full_state_dict(model, rank0_only=False)
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def _load_full(kind, model, state):
    if kind == "fsdp2":
        from fsdp_lab.fsdp2 import load_full_state_dict

        load_full_state_dict(model, state)
        return
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(state)


# -- on 2 ranks: train and save ---------------------------------------------------------------
def _save(directory):
    import io

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in KINDS:
        model = _wrap(kind, 0)
        _train(model, rank, world)
        full, adapters = _full(kind, model), lora_state_dict(model)
        if rank == 0:
            torch.save(full, f"{directory}/{kind}_full.pt")
            torch.save(adapters, f"{directory}/{kind}_lora.pt")
        out[kind] = {"full": full, "lora": adapters, "loss": _loss(model, rank, world)}
        if kind == "fsdp1":  # DCP through 1-D ShardedTensors of each flat range, into a seed-1 model
            from fsdp_lab.fsdp1 import dcp_state_dict, load_dcp_state_dict

            dcp.save(dcp_state_dict(model), checkpoint_id=f"{directory}/fsdp1_dcp")
            other = _wrap(kind, 1)
            before = _full(kind, other)
            state = dcp_state_dict(other)
            dcp.load(state, checkpoint_id=f"{directory}/fsdp1_dcp")
            load_dcp_state_dict(other, state)
            out["fsdp1_dcp"] = {"before": before, "after": _full(kind, other), "loss": _loss(other, rank, world)}
            continue
        # DTensor.full_tensor() gathers rows, which an NF4 shard does not have: the error names the call that works
        try:
            model.layers[0].attention.wq.weight.full_tensor()
            out["dtensor_full_tensor"] = "no error"
        except NotImplementedError as error:
            out["dtensor_full_tensor"] = str(error)
        # sharded (one file per rank, torch.load(weights_only=True)) and DCP, into a seed-1 model
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        dcp.save(model.state_dict(), checkpoint_id=f"{directory}/fsdp2_dcp")
        for how in ("sharded", "dcp"):
            other = _wrap(kind, 1)
            before = _full(kind, other)
            if how == "sharded":
                buffer.seek(0)
                other.load_state_dict(torch.load(buffer, weights_only=True))
            else:
                state = other.state_dict()
                dcp.load(state, checkpoint_id=f"{directory}/fsdp2_dcp")
                other.load_state_dict(state)
            out[f"fsdp2_{how}"] = {"before": before, "after": _full(kind, other), "loss": _loss(other, rank, world)}
    return out


# -- on 4 ranks: load into models built from other weights --------------------------------------
def _load(directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for saved in KINDS:
        state = torch.load(f"{directory}/{saved}_full.pt", weights_only=True)
        adapters = torch.load(f"{directory}/{saved}_lora.pt", weights_only=True)
        for kind in KINDS:
            model = _wrap(kind, 1)
            _load_full(kind, model, state)
            full = _full(kind, model)  # every rank gathers; rank 0 reports
            out[f"full {saved}->{kind}"] = {"full": full if rank == 0 else None, "loss": _loss(model, rank, world)}
            model = _wrap(kind, 0)  # the same base, adapters untrained
            load_lora_state_dict(model, adapters)
            out[f"lora {saved}->{kind}"] = {"lora": lora_state_dict(model, rank0_only=True),
                                            "loss": _loss(model, rank, world)}
    # a full state dict read by rank 0 only and broadcast (NF4 bytes included)
    from fsdp_lab.fsdp2 import load_full_state_dict

    model = _wrap("fsdp2", 1)
    state = torch.load(f"{directory}/fsdp1_full.pt", weights_only=True) if rank == 0 else None
    load_full_state_dict(model, state, broadcast_from_rank0=True)
    full = _full("fsdp2", model)
    out["full broadcast"] = {"full": full if rank == 0 else None, "loss": _loss(model, rank, world)}
    # DCP checkpoints saved on 2 ranks, read on 4
    from fsdp_lab.fsdp1 import dcp_state_dict, load_dcp_state_dict

    model = _wrap("fsdp1", 1)
    state = dcp_state_dict(model)
    dcp.load(state, checkpoint_id=f"{directory}/fsdp1_dcp")
    load_dcp_state_dict(model, state)
    full = _full("fsdp1", model)
    out["fsdp1 dcp 2->4"] = {"full": full if rank == 0 else None, "loss": _loss(model, rank, world)}
    model = _wrap("fsdp2", 1)
    try:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=f"{directory}/fsdp2_dcp")
        model.load_state_dict(state)
        out["dcp 2->4"] = {"full": _full("fsdp2", model), "loss": _loss(model, rank, world)}
    except (Exception, dcp.api.CheckpointException) as error:  # noqa: BLE001 - reported to the test
        out["dcp 2->4"] = f"{type(error).__name__}: {error}"
    out["mismatch"] = _load_mismatched(directory, rank)
    return out


def _load_mismatched(directory, rank):
    """A full state dict whose names or shapes do not match the model, read on every rank and read
    by rank 0 alone: each refusal on every rank (none left waiting in a broadcast), nothing copied."""
    from fsdp_lab.fsdp2 import fully_shard, load_full_state_dict

    state = torch.load(f"{directory}/fsdp2_full.pt", weights_only=True)
    out = {}

    def attempt(model, what, given, **kwargs):
        try:
            out[what] = load_full_state_dict(model, given if rank == 0 or not kwargs.get("broadcast_from_rank0")
                                             else None, **kwargs)
        except (KeyError, ValueError) as error:
            out[what] = f"{type(error).__name__}: {error}"

    without_lora = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=1)  # apply_lora forgotten
    for layer in without_lora.layers:
        fully_shard(layer)
    fully_shard(without_lora)
    before = {k: v.to_local().clone() for k, v in without_lora.state_dict().items()}
    attempt(without_lora, "no lora", state)
    attempt(without_lora, "no lora, broadcast", state, broadcast_from_rank0=True)
    out["no lora, unchanged"] = all(torch.equal(v.to_local(), before[k]) for k, v in without_lora.state_dict().items())
    one_layer = _build(1)
    one_layer.layers = one_layer.layers[:1]
    fully_shard(one_layer.layers[0])
    fully_shard(one_layer)
    attempt(one_layer, "one layer, not strict", state, strict=False)
    out["one layer, loaded"] = _full("fsdp2", one_layer)
    reshaped = dict(state, **{"output.weight": state["output.weight"][:-1]})
    attempt(one_layer, "reshaped, broadcast", reshaped, broadcast_from_rank0=True, strict=False)
    return out


# -- references in this process -----------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qlora_checkpoints"))
    saved = fsdp_lab.launch(_save, directory, world_size=2, timeout=600)
    loaded = fsdp_lab.launch(_load, directory, world_size=4, timeout=600)
    return {"dir": directory, "saved": saved, "loaded": loaded}


@pytest.fixture(scope="module")
def reference():
    model = _build(0)
    _train(model, 0, 1)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "loss": _loss(model, 0, 1)}


def _assert_same(a: dict, b: dict, what: str):
    """Equal bit for bit: the same keys, NF4 entries with equal bytes and layout, equal tensors."""
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, NF4Tensor) or isinstance(y, NF4Tensor):
            assert isinstance(x, NF4Tensor) and isinstance(y, NF4Tensor), (what, key)
            assert x.nf4_layout == y.nf4_layout, (what, key)
            for inner in INNER:
                assert torch.equal(getattr(x, inner), getattr(y, inner)), (what, key, inner)
        else:
            assert torch.equal(x, y), (what, key)


def _mean_loss(ranks, key):
    return sum(r[key]["loss"] for r in ranks) / len(ranks)


@pytest.mark.parametrize("kind", KINDS)
def test_full_state_dict_holds_the_one_process_nf4_bytes(runs, reference, kind):
    ref = reference["state"]
    for r in runs["saved"]:
        full = r[kind]["full"]
        assert full.keys() == ref.keys()
        nf4 = [k for k, v in ref.items() if isinstance(v, NF4Tensor)]
        assert len(nf4) == 14
        # frozen weights: the one-process bytes exactly; adapters: trained like one process
        _assert_same({k: full[k] for k in ref if "lora" not in k}, {k: ref[k] for k in ref if "lora" not in k}, kind)
        for key in (k for k in ref if "lora" in k):
            assert torch.allclose(full[key], ref[key], atol=1e-5, rtol=0), key
        assert abs(r[kind]["loss"] - reference["loss"]) < 1e-1  # a rank's half of the batch


def test_dtensor_full_tensor_of_an_nf4_shard_names_the_working_call(runs):
    message = runs["saved"][0]["dtensor_full_tensor"]
    assert "fsdp_lab.fsdp2.fully_shard" in message and "fsdp_lab.fsdp2.full_tensor(param)" in message


def test_both_fsdps_save_the_same_nf4_full_state_dict(runs):
    a, b = runs["saved"][0]["fsdp2"]["full"], runs["saved"][0]["fsdp1"]["full"]
    _assert_same({k: v for k, v in a.items() if isinstance(v, NF4Tensor)},
                 {k: v for k, v in b.items() if isinstance(v, NF4Tensor)}, "fsdp2 vs fsdp1")


@pytest.mark.parametrize("saved", KINDS)
@pytest.mark.parametrize("kind", KINDS)
def test_full_state_dict_saved_on_2_loads_on_4(runs, saved, kind):
    """Saved under one FSDP on 2 ranks, loaded under either on 4 into a model built from other
    weights: gathered again, it is the saved state dict bit for bit, and the loss matches."""
    saved_state = torch.load(f"{runs['dir']}/{saved}_full.pt", weights_only=True)
    key = f"full {saved}->{kind}"
    _assert_same(runs["loaded"][0][key]["full"], saved_state, key)
    model = _build(1)
    model.load_state_dict(saved_state)  # the same state on 1 process
    assert abs(_mean_loss(runs["loaded"], key) - _loss(model, 0, 1)) < 1e-5


@pytest.mark.parametrize("saved", KINDS)
def test_full_state_dict_saved_on_2_loads_on_1(runs, reference, saved):
    state = torch.load(f"{runs['dir']}/{saved}_full.pt", weights_only=True)
    model = _build(1)
    name = "layers.0.attention.wq.weight"
    assert not torch.equal(model.state_dict()[name].packed, state[name].packed)  # other weights before
    model.load_state_dict(state)
    _assert_same(model.state_dict(), state, saved)
    assert abs(_loss(model, 0, 1) - reference["loss"]) < 1e-5


@pytest.mark.parametrize("kind, how", [("fsdp2", "sharded"), ("fsdp2", "dcp"), ("fsdp1", "dcp")])
def test_sharded_and_dcp_round_trip_on_the_same_world_size(runs, kind, how):
    for r in runs["saved"]:
        run = r[f"{kind}_{how}"]
        with pytest.raises(AssertionError):
            _assert_same(run["before"], r[kind]["full"], "before")  # the round trip is not vacuous
        _assert_same(run["after"], r[kind]["full"], how)
        assert run["loss"] == r[kind]["loss"]


def test_full_state_dict_broadcast_from_rank0_on_4(runs):
    saved = torch.load(f"{runs['dir']}/fsdp1_full.pt", weights_only=True)
    _assert_same(runs["loaded"][0]["full broadcast"]["full"], saved, "broadcast")
    assert _mean_loss(runs["loaded"], "full broadcast") == _mean_loss(runs["loaded"], "full fsdp1->fsdp2")


def test_fsdp2_full_state_dict_that_does_not_match_is_refused_on_every_rank(runs):
    saved = torch.load(f"{runs['dir']}/fsdp2_full.pt", weights_only=True)
    adapters = sorted(k for k in saved if ".lora_" in k)
    rows, cols = saved["output.weight"].shape
    for rank, ranks in enumerate(runs["loaded"]):
        seen = ranks["mismatch"]
        # a LoRA checkpoint into a model without adapters: the adapters named, nothing copied
        assert seen["no lora"].startswith("StateDictMismatch: the full state dict does not match the model (not in "
                                          f"the model: {', '.join(adapters[:4])} and {len(adapters) - 4} more)")
        assert "apply_lora before loading" in seen["no lora"] and seen["no lora, unchanged"]
        # read by rank 0 alone: every rank names them as rank 0 sees them
        assert seen["no lora, broadcast"] == seen["no lora"]
        # strict=False: the names both have load; the other block's are returned, as nn.Module does
        assert seen["one layer, not strict"] == ([], sorted(k for k in saved if k.startswith("layers.1.")))
        assert seen["reshaped, broadcast"].startswith("ValueError: output.weight: the full state dict has shape "
                                                      + (f"({rows - 1}, {cols})" if rank == 0 else "another (on rank 0)"))
    loaded = runs["loaded"][0]["mismatch"]["one layer, loaded"]
    _assert_same(loaded, {k: v for k, v in saved.items() if not k.startswith("layers.1.")}, "one layer")


def test_fsdp1_dcp_checkpoint_saved_on_2_loads_on_4(runs):
    saved = torch.load(f"{runs['dir']}/fsdp1_full.pt", weights_only=True)
    _assert_same(runs["loaded"][0]["fsdp1 dcp 2->4"]["full"], saved, "fsdp1 dcp 2->4")
    model = _build(1)
    model.load_state_dict(saved)
    assert abs(_mean_loss(runs["loaded"], "fsdp1 dcp 2->4") - _loss(model, 0, 1)) < 1e-5


def test_fsdp2_dcp_checkpoint_saved_on_2_loads_on_4(runs):
    """DCP reshards by rows; an NF4 shard whose blocks start at its nominal first row gives row
    pieces of whole blocks (every weight of this model on 2 and 4 ranks), written block by block."""
    result = runs["loaded"][0]["dcp 2->4"]
    assert isinstance(result, dict), result
    _assert_same(result["full"], runs["saved"][0]["fsdp2"]["full"], "dcp 2->4")
    model = _build(1)
    model.load_state_dict(torch.load(f"{runs['dir']}/fsdp2_full.pt", weights_only=True))
    assert abs(_mean_loss(runs["loaded"], "dcp 2->4") - _loss(model, 0, 1)) < 1e-5


def test_nf4_row_pieces_only_where_rows_hold_whole_blocks():
    from fsdp_lab.qlora.nf4_fsdp import shard

    torch.manual_seed(0)
    weight = to_nf4(torch.randn(128, 352))
    two = [shard(weight, r, 2) for r in range(2)]
    four = [shard(to_nf4(torch.randn(128, 352)), r, 4) for r in range(4)]  # other values, cut for 4
    for r, target in enumerate(four):  # 2 -> 4: each target takes rows of one saved shard
        target.copy_(two[r // 2][(r % 2) * 32:(r % 2 + 1) * 32])
        expected = shard(weight, r, 4)
        assert all(torch.equal(getattr(target, n), getattr(expected, n)) for n in INNER)
    back = [shard(to_nf4(torch.randn(128, 352)), r, 2) for r in range(2)]
    for r, target in enumerate(back):  # 4 -> 2: each target's rows come from two saved shards
        for half in range(2):
            target[half * 32:(half + 1) * 32].copy_(four[2 * r + half])
        assert all(torch.equal(getattr(target, n), getattr(two[r], n)) for n in INNER)
    odd = shard(to_nf4(torch.randn(100, 96)), 1, 4)  # blocks start inside a row
    with pytest.raises(NotImplementedError, match=r"fsdp_lab\.fsdp2\.dcp_state_dict\(model\) loads at any world size"):
        odd[0:10]


@pytest.mark.parametrize("saved", KINDS)
@pytest.mark.parametrize("kind", KINDS)
def test_adapters_alone_save_under_peft_names_and_load_anywhere(runs, reference, saved, kind):
    adapters = torch.load(f"{runs['dir']}/{saved}_lora.pt", weights_only=True)
    lora_keys = sorted(k for k in reference["state"] if "lora" in k)
    assert sorted(adapters) == sorted(k.replace("lora_a", "lora_A.weight").replace("lora_b", "lora_B.weight")
                                      for k in lora_keys)
    assert "layers.0.attention.wq.lora_A.weight" in adapters
    full = runs["saved"][0][saved]["full"]
    for key in lora_keys:  # the adapters file holds exactly the full state dict's adapters
        peft = key.replace("lora_a", "lora_A.weight").replace("lora_b", "lora_B.weight")
        assert torch.equal(adapters[peft], full[key])
    loaded = runs["loaded"]
    key = f"lora {saved}->{kind}"
    back = loaded[0][key]["lora"]
    assert back.keys() == adapters.keys() and all(torch.equal(back[k], adapters[k]) for k in adapters)
    assert all(r[key]["lora"] == {} for r in loaded[1:])  # rank0_only
    model = _build(0)  # the same on 1 process, no FSDP
    load_lora_state_dict(model, adapters)
    assert all(torch.equal(v, adapters[k]) for k, v in lora_state_dict(model).items())
    assert abs(_mean_loss(loaded, key) - _loss(model, 0, 1)) < 1e-5
    assert abs(_loss(model, 0, 1) - reference["loss"]) < 1e-5


def test_load_lora_state_dict_names_what_does_not_match():
    model = _build(0)
    adapters = lora_state_dict(model)
    with pytest.raises(KeyError, match="missing"):
        load_lora_state_dict(model, {k: v for k, v in adapters.items() if "layers.1" not in k})
    missing, _ = load_lora_state_dict(model, {k: v for k, v in adapters.items() if "layers.1" not in k}, strict=False)
    assert missing and all("layers.1" in k for k in missing)
    wrong = dict(adapters)
    wrong["layers.0.attention.wq.lora_A.weight"] = torch.zeros(4, 128)
    with pytest.raises(ValueError, match="layers.0.attention.wq.lora_A.weight"):
        load_lora_state_dict(model, wrong)
    peft_style = {f"base_model.model.{k}": v for k, v in adapters.items()}
    assert load_lora_state_dict(model, peft_style) == ([], [])
    with pytest.raises(ValueError, match="apply_lora"):
        lora_state_dict(Llama(LlamaConfig.from_name("cpu", n_layers=1), seed=0))


# -- NF4 shards on one process ------------------------------------------------------------------
def test_dequantize_of_a_shard_gives_its_rows_or_names_the_working_call():
    from fsdp_lab.qlora.nf4_fsdp import shard

    torch.manual_seed(0)
    weight = torch.randn(128, 128)
    nf4 = to_nf4(weight)
    whole = nf4.dequantize()
    for world in (2, 4):
        for rank in range(world):
            rows = shard(nf4, rank, world).dequantize()
            step = 128 // world
            assert torch.equal(rows, whole[rank * step:(rank + 1) * step])
    odd = to_nf4(torch.randn(100, 96))  # 150 blocks over 4 ranks: 38 blocks, 25.33 rows each
    with pytest.raises(RuntimeError, match=r"dequantize_flat\(\).*fsdp_lab.fsdp2.full_tensor"):
        shard(odd, 1, 4).dequantize()
    flat = torch.cat([shard(odd, r, 4).dequantize_flat() for r in range(4)])
    assert torch.equal(flat, odd.dequantize().reshape(-1))


def test_a_whole_nf4_copied_into_a_shard_takes_its_blocks():
    from fsdp_lab.qlora.nf4_fsdp import shard

    torch.manual_seed(0)
    a, b = to_nf4(torch.randn(100, 96)), to_nf4(torch.randn(100, 96))
    for rank in range(3):
        target = shard(b, rank, 3)
        target.copy_(a)
        expected = shard(a, rank, 3)
        assert all(torch.equal(getattr(target, n), getattr(expected, n)) for n in INNER)
    target = shard(b, 0, 3)
    target.copy_(a.dequantize())  # floats are quantized with the shard's own block sizes first
    assert torch.equal(target.packed, shard(a, 0, 3).packed)
    with pytest.raises(ValueError, match="re-quantize"):
        shard(b, 0, 3).copy_(to_nf4(a.dequantize(), block_size=32))
