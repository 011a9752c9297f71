"""Meta-device initialisation under both FSDPs, against one process initialised the same way.

PyTorch's recipe: build under ``torch.device("meta")``, shard (FSDP2: ``fully_shard`` each
block, then the root, then ``to_empty(device=...)`` and initialise; FSDP1: ``param_init_fn``
per module as each unit is built, ``sync_module_states`` to take rank 0's values). One launch
on 4 ranks runs every case; the reference is the same model built on one process and
initialised by the same function, compared bit for bit. Memory: ``MemoryTracker`` around the
whole construction of a model whose unsharded size is several times a rank's peak; the
bound is this rank's shards (read from the live shards) plus one unit's whole parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, RMSNorm, TransformerBlock, rope_tables

WORLD = 4
SEED = 3
MEMORY_LAYERS = 16


def _config(n_layers=2):
    return LlamaConfig.from_name("cpu", n_layers=n_layers)


def _meta_model(n_layers=2):
    with torch.device("meta"):
        model = Llama(_config(n_layers))
    for index, module in enumerate(model.modules()):
        module.init_index = index  # each module's generator seed: the same on every rank and process
    return model


@torch.no_grad()
def init_module(module: nn.Module, base_seed: int = SEED) -> None:
    """Initialise one module's own parameters and buffers (what reset_parameters does)."""
    generator = torch.Generator().manual_seed(base_seed * 1000 + module.init_index)
    for _, param in module.named_parameters(recurse=False):
        if isinstance(module, RMSNorm):
            param.fill_(1.0)
        else:
            param.copy_(torch.empty(param.shape).normal_(0.0, 0.02, generator=generator))
    if isinstance(module, Llama):
        cfg = module.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)


def _param_init_fn(base_seed=SEED):
    def init(module):
        module.to_empty(device="cpu", recurse=False)
        init_module(module, base_seed)
    return init


def _fsdp2(model):
    from fsdp_lab.fsdp2 import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def _fsdp1(model, **kwargs):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **kwargs)


def _full(model):
    from fsdp_lab.fsdp2 import FSDPModule, get_full_state_dict

    if isinstance(model, FSDPModule):
        return get_full_state_dict(model, rank0_only=False)
    return model.state_dict()  # FSDP1: a full state dict by default


@torch.no_grad()
def _loss(model, rank, world):
    if not isinstance(getattr(model, "module", model), Llama):
        return 0.0
    batch = shard_batch(global_batch(512, 4, 16, step=0), rank, world)
    return model(batch.input_ids, batch.labels).loss.item()


def _shard_bytes(model) -> int:
    """Bytes of this rank's shards, read from the live FSDP objects."""
    from fsdp_lab.fsdp1.runtime import units_in

    total = 0
    for unit in units_in(model):
        total += sum(h.flat_shard.numel() * h.flat_shard.element_size() for h in unit._handles)
    groups = {id(m._fsdp_state.group): m._fsdp_state.group for m in model.modules()
              if getattr(m, "_fsdp_state", None) is not None and m._fsdp_state.group is not None}
    for group in groups.values():
        total += sum(p._sharded_data.numel() * p._sharded_data.element_size() for p in group.fsdp_params)
    return total


def _measure(build):
    """Peak bytes while ``build()`` constructs, shards and initialises a model, and its shards."""
    from fsdp_lab.memory import MemoryTracker

    with MemoryTracker(device="cpu") as tracker:
        model = build()
    return {"peak": tracker.peak_total(), "shards": _shard_bytes(model)}


def _rank():
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import init_sharded

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # memory first, while nothing else is alive
    out["memory"] = {
        "fsdp2 init_weights": _measure(lambda: _fsdp2(_meta_model(MEMORY_LAYERS)).init_weights(SEED)),
        "fsdp2 init_sharded": _measure(lambda: init_sharded(_fsdp2(_meta_model(MEMORY_LAYERS)), init_module)),
        "fsdp1 param_init_fn": _measure(lambda: _fsdp1(_meta_model(MEMORY_LAYERS), param_init_fn=_param_init_fn())),
    }
    cases = {
        "fsdp2 init_weights": lambda: _fsdp2(_meta_model()).init_weights(SEED),
        "fsdp2 init_sharded": lambda: init_sharded(_fsdp2(_meta_model()), init_module),
        "fsdp1 param_init_fn": lambda: _fsdp1(_meta_model(), param_init_fn=_param_init_fn()),
        "fsdp1 reset_parameters": lambda: _fsdp1_reset_parameters(),
        # every rank draws other values; sync_module_states makes them rank 0's
        "fsdp1 sync_module_states": lambda: _fsdp1(_meta_model(), param_init_fn=_param_init_fn(SEED + rank),
                                                   sync_module_states=True),
        "fsdp1 no sync": lambda: _fsdp1(_meta_model(), param_init_fn=_param_init_fn(SEED + rank)),
    }
    for name, build in cases.items():
        try:
            model = build()
            out[name] = {"full": _full(model), "loss": _loss(model, rank, world)}
        except Exception as error:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(error).__name__}: {error}"
    # a param_init_fn that leaves tensors on meta, and a module without reset_parameters, are named
    for name, kwargs in (("lazy init_fn", dict(param_init_fn=lambda m: None)), ("no reset_parameters", {})):
        try:
            _fsdp1(_meta_model(), **kwargs)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out


def _sequential():
    return nn.Sequential(nn.Linear(16, 24), nn.LayerNorm(24), nn.Linear(24, 8))


def _fsdp1_reset_parameters():
    """No param_init_fn: each module to_empty + reset_parameters (the global RNG, seeded alike)."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy

    with torch.device("meta"):
        model = _sequential()
    torch.manual_seed(SEED)
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_rank, world_size=WORLD, timeout=600)


def _reference(init):
    model = _meta_model()
    model.to_empty(device="cpu")
    init(model)
    return model


def _assert_equal(full, model, what):
    expected = model.state_dict()
    assert full.keys() == expected.keys(), what
    for key, value in expected.items():
        assert torch.equal(full[key], value), (what, key)


@pytest.mark.parametrize("case, reference", [
    ("fsdp2 init_weights", lambda m: m.init_weights(SEED)),
    ("fsdp2 init_sharded", lambda m: m.apply(init_module)),
    ("fsdp1 param_init_fn", lambda m: m.apply(init_module)),
    ("fsdp1 sync_module_states", lambda m: m.apply(init_module)),  # rank 0's seed is SEED
])
def test_meta_init_equals_one_process(ranks, case, reference):
    model = _reference(reference)
    for rank, result in enumerate(ranks):
        assert isinstance(result[case], dict), result[case]
        _assert_equal(result[case]["full"], model, f"{case} rank {rank}")
    with torch.no_grad():
        batch = global_batch(512, 4, 16, step=0)
        expected = model(batch.input_ids, batch.labels).loss.item()
    assert abs(sum(r[case]["loss"] for r in ranks) / len(ranks) - expected) < 1e-5


def test_init_weights_on_meta_equals_the_seeded_model(ranks):
    _assert_equal(ranks[0]["fsdp2 init_weights"]["full"], Llama(_config(), seed=SEED), "init_weights")


def test_without_sync_module_states_ranks_keep_their_own_values(ranks):
    """The check above is not vacuous: without the broadcast each rank's shard holds its own draw."""
    model = _reference(lambda m: m.apply(init_module))
    with pytest.raises(AssertionError):
        _assert_equal(ranks[0]["fsdp1 no sync"]["full"], model, "no sync")


def test_fsdp1_default_materialisation_is_to_empty_and_reset_parameters(ranks):
    """Units are built inner first (the two Linears in order, then the root's LayerNorm): on one
    process the same reset_parameters calls in that order give the same values."""
    torch.manual_seed(SEED)
    model = _sequential()
    torch.manual_seed(SEED)
    for layer in (model[0], model[2], model[1]):
        layer.reset_parameters()
    for result in ranks:
        _assert_equal(result["fsdp1 reset_parameters"]["full"], model, "reset_parameters")


def test_meta_modules_fsdp1_cannot_initialise_are_named(ranks):
    lazy, missing = ranks[0]["lazy init_fn"], ranks[0]["no reset_parameters"]
    assert "meta device" in lazy and "param_init_fn" in lazy and "to_empty" in lazy
    assert "RMSNorm" in missing and "reset_parameters" in missing and "param_init_fn" in missing


def _unit_bytes(n_layers) -> int:
    """The largest unit's whole parameters: one block, or the root's own (embeddings, norm, output)."""
    model = Llama(_config(n_layers))
    block = sum(p.numel() for p in model.layers[0].parameters()) * 4
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers.")) * 4
    return max(block, root)


@pytest.mark.parametrize("case", ["fsdp2 init_weights", "fsdp2 init_sharded", "fsdp1 param_init_fn"])
def test_each_rank_holds_its_shards_plus_one_unit(ranks, case):
    whole = sum(p.numel() for p in Llama(_config(MEMORY_LAYERS)).parameters()) * 4
    unit = _unit_bytes(MEMORY_LAYERS)
    for rank, result in enumerate(ranks):
        measured = result["memory"][case]
        assert measured["shards"] <= whole / WORLD * 1.02  # shards are a quarter (plus padding)
        assert measured["peak"] <= measured["shards"] + unit, (rank, measured, unit)
        assert whole >= 3 * measured["peak"], (rank, measured, whole)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight


@pytest.mark.parametrize("init", ["param_init_fn", "reset_parameters"])
def test_fsdp1_meta_init_keeps_tied_weights_tied(init):
    # param_init_fn's to_empty(recurse=False) makes a tensor per module: the output layer then
    # trained a weight of its own (one parameter more than the model built off meta)
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    def fill(module):
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for param in module.parameters(recurse=False):
                param.fill_(0.1)

    with torch.device("meta"):
        model = _Tied()
    with fsdp_lab.simulated_world(2):
        wrapped = FSDP(model, **({"param_init_fn": fill} if init == "param_init_fn" else {}))
        assert model.emb.weight is model.out.weight
        assert len(list(wrapped.parameters())) == len(list(_Tied().parameters())) == 1
