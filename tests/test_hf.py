"""Hugging Face transformers models under fsdp_lab's FSDP2, FSDP1 and QLoRA, and PEFT interop.

Models are built from small configs with random weights (no download). References:
single-process training of the same model on the same global batch (plain and QLoRA),
PEFT's own ``PeftModel.from_pretrained`` for exported adapters, transformers' own
``from_pretrained`` for a merged model. One launch (2 gloo ranks) runs every distributed case.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fsdp_lab  # noqa: E402
from fsdp_lab import hf  # noqa: E402
from fsdp_lab.precision import MixedPrecisionPolicy, cast_floating  # noqa: E402
from fsdp_lab.qlora import apply_lora, merge_lora  # noqa: E402
from fsdp_lab.qlora.nf4_tensor import INNER_TENSORS, NF4Tensor  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 8, 128
LR = 1e-2
FAMILIES = ("llama", "qwen2")
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(family: str, seed: int = 0, tie_word_embeddings: bool = False):
    """A 2-layer, hidden-64 causal LM of ``family`` with seeded random weights (float32, eager attention)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tie_word_embeddings)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(config).float().eval()


def qlora(model, target_modules=None):
    torch.manual_seed(1)  # adapter init draws from the global generator
    apply_lora(model, **({"target_modules": target_modules} if target_modules else {}), rank=4, alpha=8)
    with torch.no_grad():  # non-zero B so the adapters change the output from step 0
        for m in hf.lora_modules(model).values():
            m.lora_b.normal_(0, 0.02)
    return model


PROMPT = torch.tensor([[1, 5, 9, 3, 77, 12]])


def greedy(model):
    """Six new tokens by greedy search (``generate`` runs under ``torch.no_grad``)."""
    return model.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)


def batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // world
    return ids[rank * per:(rank + 1) * per]


def train(model, rank=0, world=1):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    if world > 1:  # each rank's loss is over its half of the batch: the mean is the global loss
        import torch.distributed as dist
        dist.all_reduce(losses)
        losses /= world
    return losses


# -- what every rank runs -------------------------------------------------------------------------
def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _rank_suite():
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
    from fsdp_lab.fsdp2 import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for family in FAMILIES:
        # FSDP2 with PyTorch's own policy class; the root's float64 output keeps ModelOutput's class
        model = tiny_model(family)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=TorchPolicy())
        fully_shard(model, mp_policy=TorchPolicy(output_dtype=torch.float64))
        with torch.no_grad():  # a forward left without backward changes the next step, here as in PyTorch's FSDP2
            probe = model(input_ids=batch(0, rank, world), labels=batch(0, rank, world))
        out[(family, "output")] = (type(probe).__name__, probe.loss.dtype, probe.logits.dtype)
        del probe
        losses = train(model, rank, world)
        out[(family, "fsdp2")] = (losses, {n: _full(p) for n, p in model.named_parameters()})
        out[(family, "fsdp2", "generate")] = greedy(model)

        # FSDP1 FULL_SHARD, one unit per decoder layer
        model = tiny_model(family)
        layer_cls = type(model.model.layers[0])
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                         sharding_strategy=ShardingStrategy.FULL_SHARD)
        losses = train(model, rank, world)
        with FullyShardedDataParallel.summon_full_params(model):
            params = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
        out[(family, "fsdp1")] = (losses, params)
        # generate() is not the root's forward: its own parameters must be whole around it
        # (without that it is refused, and the model is left as it was: the next lines generate);
        # with recurse=True the nested units run on the summoned parameters as they are
        try:
            out[(family, "fsdp1", "generate unsummoned")] = greedy(model)
        except RuntimeError as e:
            out[(family, "fsdp1", "generate unsummoned")] = str(e)
        for recurse in (False, True):
            with FullyShardedDataParallel.summon_full_params(model, recurse=recurse, writeback=False):
                out[(family, "fsdp1", "generate", recurse)] = greedy(model.module)
        if family == FAMILIES[0]:
            out["fsdp1 summon refusals"] = _summon_refusals(model, rank)
            out["fsdp1 bf16"] = _generate_under_mixed_precision(family, layer_cls, rank, world)
            model = FullyShardedDataParallel(qlora(tiny_model(family)), auto_wrap_policy=ModuleWrapPolicy({layer_cls}))
            with FullyShardedDataParallel.summon_full_params(model, writeback=False):  # whole NF4 weights
                out[(family, "qlora-fsdp1", "generate")] = greedy(model.module)
                out[(family, "qlora-fsdp1", "adapters")] = hf.peft_adapter_state_dict(model.module)
            try:  # outside summon_full_params each rank holds 1-D slices
                hf.peft_adapter_state_dict(model)
                out[(family, "qlora-fsdp1", "adapters unsummoned")] = "exported"
            except ValueError as e:
                out[(family, "qlora-fsdp1", "adapters unsummoned")] = str(e)

        # QLoRA under FSDP2
        model = qlora(tiny_model(family))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        losses = train(model, rank, world)
        out[(family, "qlora")] = (losses, {n: _full(p) for n, p in model.named_parameters() if p.requires_grad})
        out[(family, "qlora", "generate")] = greedy(model)
    return out if rank == 0 else None


def _generate_under_mixed_precision(family, layer_cls, rank, world) -> dict:
    """FSDP1 trained in bf16: generation with every unit summoned (and on rank 0 alone under
    rank0_only), the trained weights, and what summoning the root alone says."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
    from fsdp_lab.precision import MixedPrecision

    model = FullyShardedDataParallel(tiny_model(family), auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    train(model, rank, world)
    out = {"weights": model.state_dict()}
    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        out["all summoned"] = greedy(model.module)
    with FullyShardedDataParallel.summon_full_params(model, writeback=False, rank0_only=True):
        out["rank 0 alone"] = greedy(model.module) if rank == 0 else None
    try:
        with FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
            greedy(model.module)
        out["root summoned"] = "ran"
    except RuntimeError as e:
        out["root summoned"] = str(e)
    ids = batch(0, rank, world)
    model(input_ids=ids, labels=ids).loss.backward()  # the refusal left every unit ready to train
    out["trains after"] = True
    # a bf16 model (and a bf16 QLoRA one): float32 masters by default, its own dtype with main_params_dtype=None
    for name, build in (("bf16", lambda: tiny_model(family).to(torch.bfloat16)),
                        ("bf16 qlora", lambda: qlora(tiny_model(family).to(torch.bfloat16)))):
        for masters in ("float32", "own"):
            policy = MixedPrecision(main_params_dtype=None) if masters == "own" else None
            wrapped = FullyShardedDataParallel(build(), auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                               mixed_precision=policy)
            for recurse in (False, True):
                try:
                    with FullyShardedDataParallel.summon_full_params(wrapped, recurse=recurse, writeback=False):
                        out[(name, masters, recurse)] = greedy(wrapped.module)
                except RuntimeError as e:
                    out[(name, masters, recurse)] = str(e)
    return out


def _summon_refusals(model, rank: int) -> list[str]:
    """What a forward inside summon_full_params refuses: a forward with gradients (nothing would
    reach the shards) and, under rank0_only, any rank but 0 (its parameters stay sharded)."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel

    messages = []
    for kwargs, grad in (({}, True), ({"rank0_only": True, "writeback": False}, False)):
        with FullyShardedDataParallel.summon_full_params(model, **kwargs), torch.set_grad_enabled(grad):
            try:
                model(input_ids=PROMPT)
                messages.append("ran")
            except RuntimeError as e:
                messages.append(str(e))
    import torch.distributed as dist
    gathered = [None, None]
    dist.all_gather_object(gathered, messages)
    return gathered


@pytest.fixture(scope="module")
def suite():
    return fsdp_lab.launch(_rank_suite, world_size=2, timeout=240)[0]


@pytest.fixture(scope="module")
def references():
    out = {}
    for family in FAMILIES:
        model = tiny_model(family)
        losses = train(model)
        out[(family, "plain")] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
        out[(family, "plain", "generate")] = greedy(model)
        model = qlora(tiny_model(family))
        losses = train(model)
        out[(family, "qlora")] = (losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        out[(family, "qlora", "generate")] = greedy(model)
    out[(FAMILIES[0], "qlora-untrained", "generate")] = greedy(qlora(tiny_model(FAMILIES[0])))
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ("fsdp2", "fsdp1", "qlora"))
def test_training_matches_one_process(suite, references, family, kind):
    losses, params = suite[(family, kind)]
    ref_losses, ref_params = references[(family, "qlora" if kind == "qlora" else "plain")]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", (("fsdp2",), ("fsdp1", False), ("fsdp1", True), ("qlora",)),
                         ids=("fsdp2", "fsdp1-root-summoned", "fsdp1-all-summoned", "qlora"))
def test_generate_after_training_matches_one_process(suite, references, family, kind):
    reference = references[(family, "qlora" if kind == ("qlora",) else "plain", "generate")]
    got = suite[(family, kind[0], "generate", *kind[1:])]
    assert got.shape == (1, PROMPT.shape[1] + 6)
    assert got.tolist() == reference.tolist()


def test_forward_inside_summon_full_params_refuses_what_cannot_be_right(suite):
    on_rank0, on_rank1 = suite["fsdp1 summon refusals"]
    assert "forward with gradients inside summon_full_params" in on_rank0[0] and "torch.no_grad()" in on_rank0[0]
    assert on_rank0[0] == on_rank1[0]
    assert on_rank0[1] == "ran"  # rank0_only: rank 0 holds the whole parameters
    assert "rank0_only=True" in on_rank1[1] and "sharded" in on_rank1[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_on_an_fsdp1_model_outside_summon_says_how(suite, family):
    """The wrapper hands generate() to the inner model, whose forward then runs past the root
    unit on 1-D shards (torch said "'weight' must be 2-D")."""
    message = suite[(family, "fsdp1", "generate unsummoned")]
    assert isinstance(message, str) and "ran without going through its FSDP1 unit" in message, message
    assert "summon_full_params(model, recurse=False, writeback=False)" in message


def test_generate_under_bf16_needs_every_unit_summoned(suite):
    mixed = suite["fsdp1 bf16"]
    plain = tiny_model(FAMILIES[0])
    plain.load_state_dict(mixed["weights"])  # the trained full-precision weights, in a plain model
    reference = greedy(plain).tolist()
    assert mixed["all summoned"].tolist() == reference and mixed["rank 0 alone"].tolist() == reference
    assert "computes in torch.bfloat16 but runs inside summon_full_params(recurse=False)" in mixed["root summoned"]
    assert "recurse=True" in mixed["root summoned"] and mixed["trains after"]


def test_generate_from_a_bf16_model_keeps_its_masters_in_bf16(suite):
    mixed = suite["fsdp1 bf16"]
    family = FAMILIES[0]
    for name, build in (("bf16", lambda: tiny_model(family).to(torch.bfloat16)),
                        ("bf16 qlora", lambda: qlora(tiny_model(family).to(torch.bfloat16)))):
        reference = greedy(build()).tolist()
        for recurse in (False, True):  # masters in the model's own dtype: one dtype throughout
            assert mixed[(name, "own", recurse)].tolist() == reference, (name, recurse)
        # float32 masters (the default) cannot meet the bf16 compute: named errors, not a dtype clash
        assert "computes in torch.bfloat16 but runs inside summon_full_params(recurse=False)" in \
            mixed[(name, "float32", False)]
    assert isinstance(mixed[("bf16", "float32", True)], torch.Tensor)  # all float32 inside: it runs
    assert "MixedPrecision(main_params_dtype=None)" in mixed[("bf16 qlora", "float32", True)]


def test_peft_adapters_of_an_fsdp1_model_take_the_plain_names_inside_summon_and_are_refused_outside(suite):
    family = FAMILIES[0]
    one_process = hf.peft_adapter_state_dict(qlora(tiny_model(family)))  # the same untrained adapters
    inside = suite[(family, "qlora-fsdp1", "adapters")]
    assert inside.keys() == one_process.keys()  # PEFT matches these names; a wrapper's it would drop
    assert all(torch.equal(inside[k], one_process[k]) for k in inside)
    refused = suite[(family, "qlora-fsdp1", "adapters unsummoned")]
    assert "is sharded by FSDP1 (this rank holds a 1-D slice of it)" in refused
    assert "inside FSDP.summon_full_params(model)" in refused and "lora_state_dict" in refused


def test_generate_with_qlora_under_fsdp1_matches_one_process(suite, references):
    family = FAMILIES[0]
    got = suite[(family, "qlora-fsdp1", "generate")]
    assert got.tolist() == references[(family, "qlora-untrained", "generate")].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_output_dtype_keeps_model_output(suite, family):
    # PyTorch's FSDP2 returns the module's own output class with floats cast to output_dtype
    assert suite[(family, "output")] == ("CausalLMOutputWithPast", torch.float64, torch.float64)


# -- one process ---------------------------------------------------------------------------------
def test_cast_floating_keeps_container_classes():
    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Out:
        x: torch.Tensor
        n: int = 3

    x = torch.ones(2)
    dd = collections.defaultdict(list, {"x": x})
    tree = {"od": collections.OrderedDict(x=x), "dd": dd, "pair": Pair(x, 1), "dc": Out(x),
            "mo": transformers.modeling_outputs.CausalLMOutputWithPast(loss=x.sum(), logits=x)}
    cast = cast_floating(tree, torch.float64)
    assert type(cast) is dict
    for key in tree:
        assert type(cast[key]) is type(tree[key]), key
    assert cast["dd"].default_factory is list and cast["dd"]["x"].dtype == torch.float64
    assert cast["pair"].a.dtype == torch.float64 and cast["pair"].b == 1
    assert cast["dc"].x.dtype == torch.float64 and cast["dc"].n == 3
    assert cast["mo"].loss.dtype == torch.float64 and cast["mo"]["logits"].dtype == torch.float64
    assert x.dtype == torch.float32 and tree["mo"].loss.dtype == torch.float32  # inputs untouched


def test_torch_policy_is_converted_and_others_refused():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    ours = MixedPrecisionPolicy.coerce(TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   output_dtype=torch.float16, cast_forward_inputs=False))
    assert (ours.param_dtype, ours.reduce_dtype, ours.output_dtype, ours.cast_forward_inputs) == (
        torch.bfloat16, torch.float32, torch.float16, False)
    assert ours.main_params_dtype is None and ours.main_grads_dtype is None  # PyTorch keeps the model's dtype
    with pytest.raises(TypeError, match="torch.distributed.fsdp.MixedPrecisionPolicy"):
        MixedPrecisionPolicy.coerce(fsdp_lab.precision.MixedPrecision())


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_lora_default_targets_hugging_face_names(family):
    model = apply_lora(tiny_model(family), quantize_base=False)
    adapted = {name.rpartition(".")[2] for name in hf.lora_modules(model)}
    assert adapted == set(HF_LINEARS)
    assert len(hf.lora_modules(model)) == 2 * len(HF_LINEARS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["all-linear", r".*\.(q_proj|down_proj)", r"model\.layers\.1\..*_proj"])
def test_string_target_modules_pick_what_peft_picks(family, targets):
    ours = apply_lora(tiny_model(family), target_modules=targets, quantize_base=False)
    theirs = peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=8, target_modules=targets))
    picked = {name.removeprefix("base_model.model.") for name, m in theirs.named_modules()
              if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert set(hf.lora_modules(ours)) == picked and picked


def test_save_pretrained_qlora_and_peft_adapters_load_in_peft(tmp_path):
    model = qlora(tiny_model("llama"))
    ids = batch(0)
    with torch.no_grad():
        ours = model(input_ids=ids).logits

    # the raw call gets past transformers' tied-weight storage check without a TypedStorage warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.save_pretrained(tmp_path / "raw")
        except Exception as e:  # safetensors itself stores plain dtypes only
            assert "invalid python storage" not in str(e)
    assert not [w for w in caught if "TypedStorage" in str(w.message)]

    hf.save_pretrained(model, tmp_path / "base")
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    for name, lora in hf.lora_modules(model).items():
        torch.testing.assert_close(base.get_submodule(name).weight, lora.weight.dequantize(torch.float32),
                                   rtol=0, atol=0)

    hf.export_peft_adapters(model, tmp_path / "adapters")
    assert {p.name for p in (tmp_path / "adapters").iterdir()} == {hf.ADAPTER_CONFIG, hf.ADAPTER_WEIGHTS}
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    assert set(peft_model.peft_config["default"].target_modules) == set(HF_LINEARS)
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_merged_qlora_model_round_trips_through_from_pretrained(tmp_path):
    model = merge_lora(qlora(tiny_model("qwen2")))
    ids = batch(1)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        after = loaded(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_export_refuses_a_model_without_adapters(tmp_path):
    with pytest.raises(ValueError, match="apply_lora"):
        hf.export_peft_adapters(tiny_model("llama"), tmp_path)


def test_plain_save_pretrained_of_nf4_weights_names_the_way_to_save(tmp_path):
    model = qlora(tiny_model("llama"))
    with pytest.raises(TypeError, match=r"NF4Tensor\(shape=.*fsdp_lab\.hf\.save_pretrained\(model, directory\)"):
        model.save_pretrained(tmp_path / "plain")
    hf.save_pretrained(model, tmp_path / "ours")  # the documented way still works
    assert (tmp_path / "ours" / "model.safetensors").exists()


def _same_tensor(a, b) -> bool:
    if isinstance(a, NF4Tensor) or isinstance(b, NF4Tensor):
        return (type(a) is type(b) and a.nf4_layout == b.nf4_layout
                and all(torch.equal(getattr(a, n), getattr(b, n)) for n in INNER_TENSORS))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_packed_nf4_save_pretrained_round_trips_bit_exactly(tmp_path, family, tied):
    model = qlora(tiny_model(family, tie_word_embeddings=tied))
    ids = batch(2)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hf.save_pretrained(model, tmp_path, nf4="packed")
    # a quarter of the float32 base: the file holds codes, not dequantized floats
    float_bytes = sum(m.weight.numel() * 4 for m in hf.lora_modules(model).values())
    codes_bytes = sum(m.weight.packed.numel() for m in hf.lora_modules(model).values())
    assert codes_bytes * 8 == float_bytes

    loaded = hf.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(loaded) is type(model)
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert [k for k in saved if not _same_tensor(saved[k], back[k])] == []
    assert isinstance(loaded.get_submodule("model.layers.0.mlp.down_proj").weight, NF4Tensor)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        after = loaded(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)

    # transformers' own loader sees codes where floats belong and refuses, loudly
    with pytest.raises(RuntimeError, match="mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_adapters_on_some_layers_round_trip_and_load_in_peft(tmp_path):
    """A regular expression put adapters on layer 1 only: the files name exactly those layers."""
    model = qlora(tiny_model("llama"), target_modules=r"model\.layers\.1\..*_proj")
    adapted = set(hf.lora_modules(model))
    assert adapted and all(name.startswith("model.layers.1.") for name in adapted)
    ids = batch(3)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hf.save_pretrained(model, tmp_path / "packed", nf4="packed")
    loaded = hf.from_pretrained(tmp_path / "packed", attn_implementation="eager")
    assert set(hf.lora_modules(loaded)) == adapted
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, before, rtol=0, atol=0)

    hf.save_pretrained(model, tmp_path / "base")
    hf.export_peft_adapters(model, tmp_path / "adapters")
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    theirs = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules()
              if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert theirs == adapted
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, before, rtol=0, atol=1e-5)


def test_packed_nf4_refusals_say_what_to_do(tmp_path):
    model = qlora(tiny_model("llama"))
    with pytest.raises(ValueError, match="adapters included"):
        hf.save_pretrained(model, tmp_path / "a", nf4="packed", adapters=False)
    with pytest.raises(ValueError, match="'dequantize' or 'packed'"):
        hf.save_pretrained(model, tmp_path / "a", nf4="int4")
    hf.save_pretrained(model, tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="transformers' from_pretrained"):
        hf.from_pretrained(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="no_such_folder is not a directory: pass the folder"):
        hf.from_pretrained(tmp_path / "no_such_folder")
