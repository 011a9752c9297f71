"""Mixed precision: master / accumulation / wire dtypes, the double-counted-gradient trap.

One 2-rank launch runs every configuration and returns a dict; the references (single-process
gradients and training of the same model on the same data) run in this process. Tests only
compare numbers.

* Accumulating bf16 gradients over K microbatches in float32 (``main_grads_dtype``) stays
  within float32 round-off of the exact (float64) sum of the same bf16 microbatch gradients;
  accumulating in bf16 drifts by bf16 round-off. Both errors are measured; the test asserts
  the ordering and a tolerance for float32.
* The trap: reduce-scatter the accumulated gradient and then add the reduced shard back into
  the same, un-zeroed accumulation buffer gives g1 + (g1 + g2). Ranks see different data, so
  the doubled local share is visible. Every FSDP2 strategy (reshard after forward True/False,
  sync every microbatch, no-sync accumulation) and every FSDP1 ``ShardingStrategy`` (with and
  without ``no_sync``) must give the single-process gradient, read back through one SGD step
  with lr=1 (new = old - grad) on the full state dict.
* Loss curves of four policies over 50 steps on the CPU Llama, memory by category
  (MemoryTracker) and bytes on the wire (Timeline).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock
from fsdp_lab.precision import MixedPrecision, MixedPrecisionPolicy

WORLD = 2
BF16, FP32 = torch.bfloat16, torch.float32
# accumulation experiment: a small MLP, K microbatches of MICRO rows per rank
K, MICRO, D_IN, D_HID = 16, 4, 32, 64
# trap experiment: the Llama, 2 microbatches, different rows on each rank
TRAP_MICRO, TRAP_BATCH, TRAP_SEQ = 2, 4, 16
# loss curves
CURVE_STEPS, CURVE_BATCH, CURVE_SEQ, CURVE_LR = 50, 8, 16, 3e-3
# Adam's eps well above float32 round-off of the gradients, so summing per-rank gradients
# (instead of one batch) is not amplified into visibly different curves
CURVE_EPS = 1e-4
CURVE_MICRO = 4  # microbatches per step, accumulated without sync (with 2, bf16 and fp32 sums round alike)
CURVE_POLICIES = {
    "fp32": dict(),
    "bf16 params + fp32 reduce": dict(param_dtype=BF16, reduce_dtype=FP32),
    # PyTorch's FSDP2 with bf16 everywhere: gradients also accumulate in the reduce dtype
    "bf16 params + bf16 reduce": dict(param_dtype=BF16, reduce_dtype=BF16, main_grads_dtype=None),
    "bf16 comm + fp32 accumulation": dict(param_dtype=BF16, grad_comm_dtype=BF16, main_grads_dtype=FP32),
}


def _llama_config():
    return LlamaConfig.from_name("cpu", n_layers=1)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_IN))


def _mlp_data(rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(MICRO, D_IN, generator=g), torch.randn(MICRO, D_IN, generator=g)


def _trap_batches(rank: int):
    batch = global_batch(_llama_config().vocab_size, TRAP_BATCH * TRAP_MICRO, TRAP_SEQ, seed=3)
    return [shard_batch(m, rank, WORLD) for m in batch.chunk(TRAP_MICRO)]


def _shard_llama(model, fully_shard, **kwargs):
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


# -- what every rank runs ------------------------------------------------------------------------
def _rank_suite():
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import fully_shard, get_full_state_dict
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.timeline import Timeline

    rank = dist.get_rank()
    out = {}

    # 1. accumulation dtype: K microbatches without sync, then one reduce-scatter in fp32
    for name, main_grads, sync_every in [("fp32_nosync", FP32, False), ("bf16_nosync", BF16, False),
                                         ("fp32_sync", FP32, True), ("bf16_sync", BF16, True)]:
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, main_grads_dtype=main_grads)
        model = _mlp()
        for layer in (model[0], model[2]):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for micro in range(K):
            model.set_requires_gradient_sync(sync_every or micro == K - 1)
            x, y = _mlp_data(rank, micro)
            nn.functional.mse_loss(model(x), y.to(BF16)).backward()
        out[f"accum_{name}"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    # 1b. the same with FSDP1 (one unit, no_sync on all but the last microbatch); the full
    # gradient is read back through one SGD step with lr=1 on the full state dict
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ModuleWrapPolicy, ShardingStrategy

    for name, main_grads in [("fp32", FP32), ("bf16", BF16)]:
        model = FSDP(_mlp(), mixed_precision=MixedPrecision(param_dtype=BF16, reduce_dtype=FP32,
                                                             main_grads_dtype=main_grads))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for micro in range(K):
            x, y = _mlp_data(rank, micro)
            with model.no_sync() if micro < K - 1 else contextlib.nullcontext():
                nn.functional.mse_loss(model(x), y.to(BF16)).backward()
        opt.step()
        after = model.state_dict()
        out[f"accum_fsdp1_{name}"] = {k: before[k].double() - after[k].double() for k in before}
    # FSDP1 on a bf16 model: float32 master weights by default, bf16 with main_params_dtype=None;
    # and a bf16 wire with float32 accumulation
    fsdp1_dtypes = {}
    for name, fields in [("fp32_masters", {}), ("native_masters", dict(main_params_dtype=None)),
                         ("bf16_comm", dict(grad_comm_dtype=BF16))]:
        model = FSDP(_mlp().to(BF16) if name != "bf16_comm" else _mlp(), mixed_precision=MixedPrecision(**fields))
        with Timeline() as tl:
            x, y = _mlp_data(rank, 0)
            nn.functional.mse_loss(model(x.to(BF16) if name != "bf16_comm" else x).float(), y).backward()
        fsdp1_dtypes[name] = {"params": sorted({str(p.dtype) for p in model.parameters()}),
                              "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
                              "wire": sorted({e.args.get("dtype") for e in tl.comm_events(rank, "reduce_scatter")})}
    out["fsdp1_dtypes"] = fsdp1_dtypes

    # 2. the trap, FSDP2: one SGD step with lr=1 after TRAP_MICRO microbatches
    def fsdp2_trap(reshard_after_forward=True, sync_every=True):
        model = _shard_llama(Llama(_llama_config(), seed=0), fully_shard,
                             reshard_after_forward=reshard_after_forward)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for i, batch in enumerate(_trap_batches(rank)):
            model.set_requires_gradient_sync(sync_every or i == TRAP_MICRO - 1)
            model(batch.input_ids, batch.labels).loss.backward()
        opt.step()
        return get_full_state_dict(model, rank0_only=False)

    out["trap_fsdp2"] = {
        "reshard_true_sync": fsdp2_trap(True, True),
        "reshard_false_sync": fsdp2_trap(False, True),
        "reshard_true_nosync": fsdp2_trap(True, False),
        "reshard_false_nosync": fsdp2_trap(False, False),
    }

    # 2b. the trap, FSDP1: every ShardingStrategy this world supports, with and without no_sync

    trap1 = {}
    for strategy in ShardingStrategy:
        for use_no_sync in (False, True):
            try:
                model = FSDP(Llama(_llama_config(), seed=0), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                             sharding_strategy=strategy)
            except ValueError as error:  # HYBRID_SHARD needs a world that factors into groups
                trap1[f"{strategy.name}"] = f"skipped: {error}"
                break
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            batches = _trap_batches(rank)
            for i, batch in enumerate(batches):
                last = i == len(batches) - 1
                with model.no_sync() if (use_no_sync and not last) else contextlib.nullcontext():
                    model(batch.input_ids, batch.labels).loss.backward()
            opt.step()
            trap1[f"{strategy.name}{'+no_sync' if use_no_sync else ''}"] = {
                k: v.detach().clone() for k, v in model.state_dict().items()}
    out["trap_fsdp1"] = trap1
    del model, opt, layer  # nothing of these runs may be alive when memory is measured

    # 3. loss curves, memory by category and bytes on the wire, one model per policy
    def run_policy(fields):
        """CURVE_STEPS steps; memory and comm events measured at step 1 (optimizer state exists)."""
        model = _shard_llama(Llama(_llama_config(), seed=0), fully_shard, mp_policy=MixedPrecisionPolicy(**fields))
        opt = torch.optim.AdamW(model.parameters(), lr=CURVE_LR, eps=CURVE_EPS)
        losses, memory, wire = [], None, None
        for step in range(CURVE_STEPS):
            batch = shard_batch(global_batch(_llama_config().vocab_size, CURVE_BATCH, CURVE_SEQ, step=step),
                                rank, WORLD)
            measured = step == 1
            with (MemoryTracker(model, opt) if measured else contextlib.nullcontext()) as mt, \
                    (Timeline() if measured else contextlib.nullcontext()) as tl:
                loss = 0.0
                for i, micro in enumerate(batch.chunk(CURVE_MICRO)):
                    model.set_requires_gradient_sync(i == CURVE_MICRO - 1)
                    micro_loss = model(micro.input_ids, micro.labels).loss / CURVE_MICRO
                    micro_loss.backward()
                    loss = loss + micro_loss.detach()
                opt.step()
                opt.zero_grad()
            if measured:
                memory = mt.max_by_category()
                wire = [(e.name, e.bytes, e.args.get("dtype")) for e in tl.comm_events(rank)]
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / WORLD)
        return losses, memory, wire

    curves, memory, wire = {}, {}, {}
    for name, fields in CURVE_POLICIES.items():
        curves[name], memory[name], wire[name] = run_policy(fields)
    out.update(curves=curves, memory=memory, wire=wire)

    # 4. a bf16 model: master weights in float32 (default) or in the model's own dtype (None)
    def run_masters(main):
        model = _shard_llama(Llama(_llama_config(), seed=0).to(BF16), fully_shard,
                             mp_policy=MixedPrecisionPolicy(main_params_dtype=main))
        opt = torch.optim.AdamW(model.parameters(), lr=CURVE_LR, eps=CURVE_EPS)
        batch = shard_batch(global_batch(_llama_config().vocab_size, CURVE_BATCH, CURVE_SEQ), rank, WORLD)
        seen = []
        model.layers[0].attention.wq.register_forward_pre_hook(lambda m, args: seen.append(str(m.weight.dtype)))
        with MemoryTracker(model, opt) as mt:
            model(batch.input_ids, batch.labels).loss.backward()
            opt.step()
        return {"memory": mt.max_by_category(),
                "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
                "compute": seen[0]}

    masters = {}
    for name, main in [("fp32_masters", FP32), ("native_masters", None)]:
        masters[name] = run_masters(main)
    out["masters"] = masters

    # 5. a wire dtype the backend cannot reduce: pretend this gloo cannot sum bf16 (checked once
    # per (backend, dtype) and cached), then reduce bf16 gradients. Last: it fails a backward.
    from fsdp_lab import process_group

    process_group._reducible_checked[("gloo", BF16)] = False
    try:
        model = _mlp()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(grad_comm_dtype=BF16))
        x, y = _mlp_data(rank, 0)
        nn.functional.mse_loss(model(x), y).backward()
        out["unreducible"] = "no error"
    except TypeError as error:
        out["unreducible"] = str(error)
    finally:
        process_group._reducible_checked.pop(("gloo", BF16), None)
    return out


@pytest.fixture(scope="module")
def results():
    return fsdp_lab.launch(_rank_suite, world_size=WORLD, timeout=600)


# -- references (this process) ---------------------------------------------------------------------
def _reference_accumulated_grads():
    """Mean over ranks of the sum over microbatches of each bf16 microbatch gradient, in float64."""
    model = _mlp().to(BF16)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        for micro in range(K):
            x, y = _mlp_data(rank, micro)
            model.zero_grad()
            nn.functional.mse_loss(model(x.to(BF16)), y.to(BF16)).backward()
            for n, p in model.named_parameters():
                total[n] += p.grad.double()
    return {n: t / WORLD for n, t in total.items()}


def _reference_trap_grads():
    """Single-process gradients of the data-parallel objective, and what the trap would give."""
    model = Llama(_llama_config(), seed=0)
    per_rank_first = {}
    for rank in range(WORLD):
        for i, batch in enumerate(_trap_batches(rank)):
            (model(batch.input_ids, batch.labels).loss / WORLD).backward()
            if i == 0:  # the rank's own first-microbatch gradient, which the trap counts twice
                per_rank_first[rank] = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    # rank 0's doubled share (rank 0 runs first, so per_rank_first[0] is its contribution alone)
    doubled = {n: grads[n] + per_rank_first[0][n] for n in grads}
    return params, grads, doubled


def _rel_error(got: dict, want: dict) -> float:
    num = sum((got[n].double() - want[n].double()).norm() ** 2 for n in want) ** 0.5
    den = sum(want[n].double().norm() ** 2 for n in want) ** 0.5
    return float(num / den)


# -- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["nosync", "sync"])
def test_fp32_accumulation_beats_bf16_accumulation(results, path):
    reference = _reference_accumulated_grads()
    fp32 = _rel_error(results[0][f"accum_fp32_{path}"], reference)
    bf16 = _rel_error(results[0][f"accum_bf16_{path}"], reference)
    # float32 accumulation: K additions of float32 round-off (~6e-8 each) plus the fp32 average
    assert fp32 < 1e-5, f"{path}: fp32 accumulation relative error {fp32:.2e}"
    # bf16 accumulation: each of K additions rounds to 8 mantissa bits (~4e-3)
    assert bf16 > 1e-3, f"{path}: bf16 accumulation relative error {bf16:.2e} (expected bf16 round-off)"
    assert fp32 < bf16 / 100
    for name in ("fp32", "bf16"):
        assert results[0][f"accum_{name}_{path}"]["0.weight"].dtype == FP32  # .grad matches the fp32 master


def test_fsdp1_fp32_accumulation_beats_bf16_accumulation(results):
    reference = _reference_accumulated_grads()
    fp32 = _rel_error(results[0]["accum_fsdp1_fp32"], reference)
    bf16 = _rel_error(results[0]["accum_fsdp1_bf16"], reference)
    # read back as (old - new) of float32 weights: adds ~1e-7 relative to the float32 round-off
    assert fp32 < 1e-5, f"FSDP1 fp32 accumulation relative error {fp32:.2e}"
    assert bf16 > 1e-3 and fp32 < bf16 / 100, (fp32, bf16)


def test_fsdp1_master_and_wire_dtypes(results):
    dtypes = results[0]["fsdp1_dtypes"]
    assert dtypes["fp32_masters"]["params"] == dtypes["fp32_masters"]["grads"] == ["torch.float32"]
    assert dtypes["native_masters"]["params"] == dtypes["native_masters"]["grads"] == ["torch.bfloat16"]
    assert dtypes["fp32_masters"]["wire"] == ["bfloat16"]  # PyTorch's rule: the model's own dtype
    assert dtypes["bf16_comm"]["wire"] == ["bfloat16"] and dtypes["bf16_comm"]["grads"] == ["torch.float32"]


def _check_against_reference(state: dict, reference, label: str):
    params, grads, doubled = reference
    recovered = {n: params[n] - state[n] for n in grads}  # SGD, lr=1: new = old - grad
    for n in grads:
        err = (recovered[n] - grads[n]).abs().max().item()
        trap_gap = (doubled[n] - grads[n]).abs().max().item()
        scale = grads[n].abs().max().item()
        assert err <= 1e-4 * scale + 1e-6, f"{label}: {n} gradient off by {err:.2e} (max |g| {scale:.2e})"
        assert err < trap_gap / 100, f"{label}: {n} looks double-counted"


@pytest.fixture(scope="module")
def trap_reference():
    return _reference_trap_grads()


@pytest.mark.parametrize("config", ["reshard_true_sync", "reshard_false_sync", "reshard_true_nosync",
                                    "reshard_false_nosync"])
def test_fsdp2_never_double_counts(results, trap_reference, config):
    for rank in range(WORLD):
        _check_against_reference(results[rank]["trap_fsdp2"][config], trap_reference, f"FSDP2 {config} rank {rank}")


def test_fsdp1_never_double_counts(results, trap_reference):
    ran = []
    for name, state in results[0]["trap_fsdp1"].items():
        if isinstance(state, str):
            continue
        for rank in range(WORLD):
            _check_against_reference(results[rank]["trap_fsdp1"][name], trap_reference, f"FSDP1 {name} rank {rank}")
        ran.append(name)
    for must in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD+no_sync", "SHARD_GRAD_OP+no_sync",
                 "NO_SHARD+no_sync"):
        assert must in ran


def test_the_trap_is_detectable(trap_reference):
    """The reference trap differs from the right answer by far more than the tolerance."""
    params, grads, doubled = trap_reference
    gaps = [(doubled[n] - grads[n]).abs().max().item() / grads[n].abs().max().item() for n in grads]
    assert min(gaps) > 0.05


def _reference_curve():
    model = Llama(_llama_config(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=CURVE_LR, eps=CURVE_EPS)
    losses = []
    for step in range(CURVE_STEPS):
        batch = global_batch(_llama_config().vocab_size, CURVE_BATCH, CURVE_SEQ, step=step)
        loss = 0.0
        for micro in batch.chunk(CURVE_MICRO):
            micro_loss = model(micro.input_ids, micro.labels).loss / CURVE_MICRO
            micro_loss.backward()
            loss += micro_loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def test_loss_curves(results):
    curves = results[0]["curves"]
    reference = _reference_curve()
    assert curves["fp32"][0] == pytest.approx(reference[0], rel=1e-6)
    assert curves["fp32"][-1] == pytest.approx(reference[-1], rel=1e-3)
    tail = sum(reference[-10:]) / 10
    for name, losses in curves.items():
        assert len(losses) == CURVE_STEPS
        assert losses[-1] < 0.6 * losses[0], f"{name} does not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
        # bf16 compute changes the numbers, not the course of training: the mean of the last
        # 10 losses stays within 3% of the float32 reference's
        assert sum(losses[-10:]) / 10 == pytest.approx(tail, rel=0.03), name
    # each dtype choice changes the numbers: no two policies give the same curve
    finals = [losses[-1] for losses in curves.values()]
    assert len(set(finals)) == len(finals)


def _wire_bytes(wire, name):
    return sum(b for n, b, _ in wire if n == name)


def test_bytes_on_the_wire_follow_the_dtypes(results):
    wire = results[0]["wire"]
    fp32, mixed = wire["fp32"], wire["bf16 params + fp32 reduce"]
    bf16_reduce, bf16_comm = wire["bf16 params + bf16 reduce"], wire["bf16 comm + fp32 accumulation"]
    assert {d for n, _, d in fp32} == {"float32"}
    assert {d for n, _, d in mixed if n == "all_gather"} == {"bfloat16"}
    assert {d for n, _, d in mixed if n == "reduce_scatter"} == {"float32"}
    assert {d for n, _, d in bf16_comm if n == "reduce_scatter"} == {"bfloat16"}
    # same collectives, half the bytes where the dtype halves
    assert _wire_bytes(mixed, "all_gather") * 2 == _wire_bytes(fp32, "all_gather")
    assert _wire_bytes(mixed, "reduce_scatter") == _wire_bytes(fp32, "reduce_scatter")
    assert _wire_bytes(bf16_reduce, "reduce_scatter") * 2 == _wire_bytes(fp32, "reduce_scatter")
    assert _wire_bytes(bf16_comm, "reduce_scatter") * 2 == _wire_bytes(fp32, "reduce_scatter")
    # by hand: each reduce-scatter carries every padded gradient of its group once per step
    model = Llama(_llama_config(), seed=0)
    padded = sum(-(-p.shape[0] // WORLD) * WORLD * p[0].numel() for p in model.parameters())
    assert _wire_bytes(fp32, "reduce_scatter") == 4 * padded


def test_memory_by_category(results):
    memory = results[0]["memory"]
    # float32 master weights in every policy: same sharded bytes
    sharded = {m.get("sharded_params", 0) for m in memory.values()}
    assert len(sharded) == 1 and sharded.pop() > 0
    # unsharded (gathered) parameters halve with bf16 compute
    assert memory["bf16 params + fp32 reduce"]["unsharded_params"] * 2 == memory["fp32"]["unsharded_params"]
    for name, cats in memory.items():
        assert cats.get("comm_buffers", 0) > 0, name


def test_main_params_dtype_of_a_bf16_model(results):
    masters = results[0]["masters"]
    assert masters["fp32_masters"]["dtypes"] == ["torch.float32"]
    assert masters["fp32_masters"]["grad_dtypes"] == ["torch.float32"]
    assert masters["native_masters"]["dtypes"] == ["torch.bfloat16"]
    # compute stays in the model's own dtype (param_dtype=None): bf16 either way
    assert masters["fp32_masters"]["compute"] == masters["native_masters"]["compute"] == "torch.bfloat16"
    fp32_bytes = masters["fp32_masters"]["memory"]["sharded_params"]
    assert fp32_bytes == 2 * masters["native_masters"]["memory"]["sharded_params"]


@pytest.mark.parametrize("cls", [MixedPrecisionPolicy, MixedPrecision])
@pytest.mark.parametrize("field", ["main_params_dtype", "main_grads_dtype", "grad_comm_dtype"])
@pytest.mark.parametrize("bad", [torch.int32, torch.bool, "float32"])
def test_validation_names_the_field(cls, field, bad):
    with pytest.raises(TypeError, match=field):
        cls(**{field: bad})


@pytest.mark.parametrize("cls, field", [(MixedPrecisionPolicy, "cast_forward_inputs"),
                                        (MixedPrecision, "cast_forward_inputs"),
                                        (MixedPrecision, "cast_root_forward_inputs"),
                                        (MixedPrecision, "keep_low_precision_grads")])
def test_flags_must_be_bools(cls, field):
    # "no" is truthy: accepted, it would have switched the cast on
    with pytest.raises(TypeError, match=f"{field} must be True or False, got 'no'"):
        cls(**{field: "no"})


def test_offload_flags_must_be_bools():
    from fsdp_lab.fsdp1 import CPUOffload
    from fsdp_lab.fsdp2 import CPUOffloadPolicy

    with pytest.raises(TypeError, match="offload_params must be True or False, got 'no'"):
        CPUOffload(offload_params="no")
    with pytest.raises(TypeError, match="pin_memory must be True or False, got 'no'"):
        CPUOffloadPolicy(pin_memory="no")


def test_a_wire_dtype_the_backend_cannot_reduce_is_a_clear_error(results):
    message = results[0]["unreducible"]
    assert "cannot reduce torch.bfloat16" in message and "float32" in message, message


def test_defaults_are_pytorch_compatible():
    for cls in (MixedPrecisionPolicy, MixedPrecision):
        policy = cls()
        assert policy.main_params_dtype == FP32 and policy.main_grads_dtype == FP32
        assert policy.grad_comm_dtype is None and policy.param_dtype is None and policy.reduce_dtype is None


def test_dtype_helpers():
    from fsdp_lab.precision import accumulation_dtype, grad_comm_dtype, main_params_dtype

    policy = MixedPrecisionPolicy(param_dtype=BF16)
    assert main_params_dtype(policy, BF16) == FP32
    assert main_params_dtype(policy, torch.float64) == torch.float64  # never narrows
    assert main_params_dtype(policy, BF16, trainable=False) == BF16
    assert main_params_dtype(MixedPrecisionPolicy(main_params_dtype=None), BF16) == BF16
    assert grad_comm_dtype(policy, FP32) == BF16
    assert grad_comm_dtype(MixedPrecisionPolicy(param_dtype=BF16, grad_comm_dtype=torch.float16), FP32) == torch.float16
    assert accumulation_dtype(FP32, BF16, BF16) == FP32
    assert accumulation_dtype(None, BF16, BF16) == BF16
