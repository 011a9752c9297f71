"""Dropping a sharded model and its optimizer frees every storage FSDP made, at once.

No reference cycle may keep FSDP memory alive until Python's garbage collector runs: a
tracker started after another model was dropped would otherwise count that model's bytes.
Each case runs with the collector disabled (``gc.collect(); gc.disable()``): build, train
one step, take weak references to every storage of the parameters, gradients, optimizer
state and every storage tagged through ``fsdp_lab.memory.tags`` since the case began, drop
the model, the optimizer and everything else the case made, and check that every weak
reference is dead. The reference is plain reference counting: nothing but ``del``.

One launch per world size runs every case (2 ranks: both FSDPs, every FSDP1 strategy but
HYBRID_SHARD, CPU offload, QLoRA, AutoMicrobatch with and without an injected OOM, a step under
a MemoryTracker or a Timeline; 4 ranks: HYBRID_SHARD); each case reports what stayed alive, and
then, run again, what it left in reference cycles. Apart from those, the first model and
optimizer of a fresh interpreter (where torch's one-time lazy imports run) are checked the same
way in a process of their own: a plain step, a tracked step, a QLoRA step.
"""

from __future__ import annotations

import collections
import gc
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock


RELEASE_WAIT = 5.0  # seconds a background communication thread may take to let go of a tensor


def _model():
    return Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)


def _qlora_model():
    from fsdp_lab.qlora import apply_lora

    model = _model()
    torch.manual_seed(0)
    return apply_lora(model, rank=4, alpha=8, quantize_base=True)


def _batch(step=0):
    import torch.distributed as dist

    return shard_batch(global_batch(512, 4, 16, step=step), dist.get_rank(), dist.get_world_size())


def _fsdp1(model, **kwargs):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), **kwargs)


def _fsdp2(model, **kwargs):
    from fsdp_lab.fsdp2 import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _one_step(model, optimizer):
    batch = _batch()
    loss = model(batch.input_ids, batch.labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeroed gradients stay allocated: they must die too


def _trained(wrap, make_model=_model):
    """A case: a model wrapped by ``wrap`` after one training step, and its optimizer."""
    def case():
        model = wrap(make_model())
        optimizer = _optimizer(model)
        _one_step(model, optimizer)
        return {"model": model, "optimizer": optimizer}
    return case


def _instrumented(wrap, instrument):
    """A case: like ``_trained``, the step run inside ``instrument(model, optimizer)``."""
    def case():
        model = wrap(_model())
        optimizer = _optimizer(model)
        with instrument(model, optimizer) as watching:
            _one_step(model, optimizer)
        return {"model": model, "optimizer": optimizer, "instrument": watching}
    return case


def _auto_microbatch(wrap, oom_point=None):
    """A case: two AutoMicrobatch steps; with ``oom_point`` rank 1 runs out of memory there once."""
    def case():
        from fsdp_lab.automicrobatch import AutoMicrobatch
        from fsdp_lab.oom import inject_oom

        model = wrap(_model())
        optimizer = _optimizer(model)
        amb = AutoMicrobatch(model, optimizer, global_batch_size=2)
        handle = inject_oom(oom_point, rank=1, skip=1) if oom_point else None
        retries = [amb.train_step(_batch(step)).retries for step in range(2)]
        if handle is not None:
            handle.remove()
        amb.close()
        assert retries == ([1, 0] if oom_point else [0, 0]), retries
        return {"model": model, "optimizer": optimizer, "amb": amb}
    return case


# -- the weak references ---------------------------------------------------------------------------
def _storages(tensor: torch.Tensor) -> list:
    """The storages behind a tensor, through wrapper subclasses (DTensor, NF4Tensor)."""
    if not isinstance(tensor, torch.Tensor):
        return []
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(tensor, name))]
    return [tensor.untyped_storage()]


def _tagged() -> dict:
    from fsdp_lab.memory import tags

    return {id(storage): weakref.ref(storage) for storage in list(tags._tags.keys())}


def _watch(model, optimizer, tagged_before: dict) -> list[tuple[str, weakref.ref]]:
    """(what, weak reference) for every storage of the model, its optimizer and new tags."""
    from fsdp_lab.memory import tags

    watched = []
    for name, param in model.named_parameters():
        watched += [(f"param {name}", weakref.ref(s)) for s in _storages(param)]
        if param.grad is not None:
            watched += [(f"grad {name}", weakref.ref(s)) for s in _storages(param.grad)]
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                watched += [(f"optimizer {key}", weakref.ref(s)) for s in _storages(value)]
    for storage, category in list(tags._tags.items()):
        old = tagged_before.get(id(storage))
        if old is None or old() is not storage:
            watched.append((f"tagged {category}", weakref.ref(storage)))
    return watched


def _released(case) -> dict:
    """Run ``case`` with the collector off; what of its storages is alive after ``del``."""
    gc.collect()
    gc.disable()
    try:
        before = _tagged()
        made = case()
        watched = _watch(made["model"], made["optimizer"], before)
        del made
        # gloo's worker thread drops its reference to a finished collective's tensors a moment
        # after the collective completes (the rank may not have been scheduled yet): wait for
        # that thread, still without the collector, instead of mistaking it for a cycle
        deadline = time.monotonic() + RELEASE_WAIT
        while any(ref() is not None for _, ref in watched) and time.monotonic() < deadline:
            time.sleep(0.001)
        alive = sorted({what for what, ref in watched if ref() is not None})
        return {"watched": len(watched), "alive": alive}
    finally:
        gc.enable()


CASES = {
    2: ["fsdp1 FULL_SHARD", "fsdp1 SHARD_GRAD_OP", "fsdp1 NO_SHARD", "fsdp1 cpu offload", "fsdp1 qlora",
        "fsdp1 automicrobatch", "fsdp1 automicrobatch oom", "fsdp2", "fsdp2 reshard_after_forward=False",
        "fsdp2 cpu offload", "fsdp2 qlora", "fsdp2 automicrobatch", "fsdp2 automicrobatch oom",
        "fsdp1 memory tracker", "fsdp2 memory tracker", "fsdp2 timeline"],
    4: ["fsdp1 HYBRID_SHARD"],
}


def _cases(world: int) -> dict:
    from fsdp_lab.fsdp1 import CPUOffload, ShardingStrategy
    from fsdp_lab.fsdp2 import CPUOffloadPolicy

    strategy = lambda s: _trained(lambda m: _fsdp1(m, sharding_strategy=s))  # noqa: E731
    cases = {
        "fsdp1 FULL_SHARD": strategy(ShardingStrategy.FULL_SHARD),
        "fsdp1 SHARD_GRAD_OP": strategy(ShardingStrategy.SHARD_GRAD_OP),
        "fsdp1 NO_SHARD": strategy(ShardingStrategy.NO_SHARD),
        "fsdp1 HYBRID_SHARD": strategy(ShardingStrategy.HYBRID_SHARD),
        "fsdp1 cpu offload": _trained(lambda m: _fsdp1(m, cpu_offload=CPUOffload(offload_params=True))),
        "fsdp1 qlora": _trained(_fsdp1, _qlora_model),
        "fsdp1 automicrobatch": _auto_microbatch(_fsdp1),
        "fsdp1 automicrobatch oom": _auto_microbatch(_fsdp1, "pre_backward"),
        "fsdp2": _trained(_fsdp2),
        "fsdp2 reshard_after_forward=False": _trained(lambda m: _fsdp2(m, reshard_after_forward=False)),
        "fsdp2 cpu offload": _trained(lambda m: _fsdp2(m, offload_policy=CPUOffloadPolicy())),
        "fsdp2 qlora": _trained(_fsdp2, _qlora_model),
        "fsdp2 automicrobatch": _auto_microbatch(_fsdp2),
        "fsdp2 automicrobatch oom": _auto_microbatch(_fsdp2, "post_backward"),
        "fsdp1 memory tracker": _instrumented(_fsdp1, fsdp_lab.MemoryTracker),
        "fsdp2 memory tracker": _instrumented(_fsdp2, fsdp_lab.MemoryTracker),
        "fsdp2 timeline": _instrumented(_fsdp2, lambda model, optimizer: fsdp_lab.Timeline()),
    }
    return {name: cases[name] for name in CASES[world]}


def _cyclic_garbage(case) -> dict[str, int]:
    """Run ``case`` with the collector off, drop what it made, and count by kind what only the
    collector could free (objects in reference cycles, storages or not)."""
    gc.collect()
    gc.disable()
    try:
        made = case()
        del made
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kinds = collections.Counter(_kind(obj) for obj in gc.garbage)
        return dict(kinds.most_common(8))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _kind(obj) -> str:
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _rank(world: int) -> dict:
    """Every case of this world size; a case that raises reports its error, the others still run.
    The first case is the rank's first model and optimizer: nothing is warmed up before it. Each
    case then runs again, its first-time work (torch's lazy imports and caches) done, to count
    the reference cycles a training step leaves."""
    out = {}
    for name, case in _cases(world).items():
        try:
            out[name] = _released(case)
            out[name]["cycles"] = _cyclic_garbage(case)
        except Exception as error:  # noqa: BLE001 - reported per case by the test
            out[name] = {"error": f"{type(error).__name__}: {error}"}
    return out


_LAUNCHED: dict[int, list] = {}


def _results(world: int) -> list[dict]:
    if world not in _LAUNCHED:
        _LAUNCHED[world] = fsdp_lab.launch(_rank, world, world_size=world, timeout=300)
    return _LAUNCHED[world]


def _case_on_every_rank(world: int, case: str):
    """(rank, result) of ``case`` on every rank of its launch; a case that raised fails here."""
    for rank, cases in enumerate(_results(world)):
        result = cases[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        yield rank, result


EVERY_CASE = pytest.mark.parametrize("world,case", [(w, name) for w, names in CASES.items() for name in names],
                                     ids=lambda x: str(x))


@EVERY_CASE
def test_every_fsdp_storage_dies_with_its_model(world, case):
    for rank, result in _case_on_every_rank(world, case):
        assert result["watched"] > 0, f"rank {rank}: nothing watched"
        assert result["alive"] == [], f"rank {rank}: still alive after del: {result['alive']}"


@EVERY_CASE
def test_a_training_step_leaves_no_reference_cycles(world, case):
    # Nothing of a step, FSDP's or the optimizer's, waits for the collector: a cycle of plain
    # objects holds no memory the tracker counts, but it makes the collector run more often
    # and at moments that depend on everything else the process allocates.
    for rank, result in _case_on_every_rank(world, case):
        assert result["cycles"] == {}, f"rank {rank}: objects only the collector frees: {result['cycles']}"


# The first model and optimizer of a fresh interpreter, built inside a function, with the
# collector off from before torch is imported: torch's lazy imports at a first optimizer or a
# first step must not tie the frames that built them (and so the model) into a cycle.
_FIRST_IN_PROCESS = """
import gc, sys, weakref
gc.disable()
import torch
import fsdp_lab
from fsdp_lab.models.data import global_batch
from fsdp_lab.models.llama import Llama, LlamaConfig

def first_step(kind):
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    if kind == "qlora":
        model = fsdp_lab.apply_lora(model, rank=4, alpha=8, quantize_base=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = global_batch(512, 2, 16)
    def step():
        model(batch.input_ids, batch.labels).loss.backward()
        optimizer.step()
    if kind == "tracker":
        with fsdp_lab.MemoryTracker(model, optimizer) as tracker:
            step()
        tracker.result()
    else:
        step()
    return [weakref.ref(t.untyped_storage()) for t in list(model.parameters()) + [
        v for state in optimizer.state.values() for v in state.values()]] + [weakref.ref(model)]

refs = first_step(sys.argv[1])
print(sum(ref() is not None for ref in refs), len(refs))
"""


@pytest.mark.parametrize("kind", ["plain", "tracker", "qlora"])
def test_the_first_model_of_a_fresh_process_dies_with_del(kind):
    done = subprocess.run([sys.executable, "-c", _FIRST_IN_PROCESS, kind], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    alive, watched = map(int, done.stdout.split()[-2:])
    assert watched > 20
    assert alive == 0, f"{alive} of {watched} storages of the first model outlived del (a reference cycle)"
