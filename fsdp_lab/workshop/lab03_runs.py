"""Lab 03's training runs: a ZeRO stage on this rank (``train_on_rank``, launched by
``lab03.measure``), the same model trained on the whole batch in one process (``reference``),
and the ZeRO arithmetic the checkers hold the measurements to (``expected``, ``summary``).

``lab03`` re-exports every name here; its checkers compare a learner's stage with these.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig
from fsdp_lab.workshop.checking import answer_timeline
from fsdp_lab.workshop.measure import bytes_by_collective, wire_bytes
from fsdp_lab.workshop.zero import EPS, LR

# A Llama small enough for 2 CPU ranks, with every size divisible by 2 and 4.
CONFIG = LlamaConfig(name="lab03", vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     ffn_hidden=176, max_seq_len=64)
GLOBAL_BATCH, SEQ_LEN = 8, 32   # rows of the global batch, tokens per row
STEPS, MEASURED_STEP = 3, 1     # AdamW steps; the one measured (its optimizer state exists)
TOL = 1e-5                      # largest parameter difference from single-process training
TOL_TEXT = "1e-5"
STAGE_NAMES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
WORLD = 2


@dataclasses.dataclass
class StageRun:
    """What one rank of ``lab03.measure`` returns. Bytes in bytes; ``grads[s][i]``: the
    gradient of optimizer tensor i at step s (s = 0, 1), as the optimizer saw it."""

    rank: int
    world_size: int
    losses: list[float]
    grads: list[list[torch.Tensor | None]]
    after_first: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    memory: object     # fsdp_lab.memory.MemoryResult of step MEASURED_STEP
    timeline: object   # fsdp_lab.timeline.Timeline of step MEASURED_STEP
    numels: list[int] = dataclasses.field(default_factory=list)  # of each optimizer tensor, first step
    kept_after_setup: int = 0  # bytes the model's parameters still held right after construction


def batch_for(step: int, rank: int = 0, world_size: int = 1):
    """Rank ``rank``'s slice of step ``step``'s global batch (the whole batch for 1 rank)."""
    batch = global_batch(CONFIG.vocab_size, GLOBAL_BATCH, SEQ_LEN, step=step)
    return shard_batch(batch, rank, world_size)


def train_on_rank(stage_class, params_from_shards: bool = False) -> StageRun:
    """Run on every rank: build the model, wrap it in ``stage_class``, train ``STEPS`` steps,
    measure step ``MEASURED_STEP``. The parameters returned are the model's own, or with
    ``params_from_shards`` (ZeRO-3) the all-gather of the stage's shards, which is what the
    next forward would use. Raises whatever the stage raises."""
    import torch.distributed as dist

    from fsdp_lab.memory.tracker import MemoryTracker

    # the timeline's backward hooks on the embedding warn that its input needs no gradient
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Llama(CONFIG, seed=0)
    stage = stage_class(model)
    kept_after_setup = sum(p.untyped_storage().nbytes() for p in model.parameters())
    optimizer = stage.optimizer
    seen: list[list] = []
    numels: list[int] = []

    def record(opt, args, kwargs):
        if not seen:
            numels.extend(t.numel() for group in opt.param_groups for t in group["params"])
        if len(seen) < 2:
            seen.append([t.grad.detach().clone() if t.grad is not None else None
                         for group in opt.param_groups for t in group["params"]])

    optimizer.register_step_pre_hook(record)
    losses, after_first, memory, timeline = [], {}, None, None
    for step in range(STEPS):
        batch = batch_for(step, rank, world)
        if step == MEASURED_STEP:
            # the answer's collectives, those never waited on in timeline.unwaited
            with answer_timeline() as timeline, MemoryTracker(model, optimizer) as tracker:
                timeline.attach(model)
                loss = stage.step(batch)
            memory = tracker.result()
        else:
            loss = stage.step(batch)
        losses.append(float(loss))
        if step == 0:
            after_first = stage.full_parameters(params_from_shards)
    return StageRun(rank, world, losses, seen, after_first, stage.full_parameters(params_from_shards),
                    memory, timeline, numels, kept_after_setup)


@dataclasses.dataclass
class Reference:
    """Single-process training of the same model on the whole batch (this process)."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]   # steps 0 and 1, whole
    initial: dict[str, torch.Tensor]
    after_first: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    local_grads: list[dict[str, torch.Tensor]]  # step 0, rank r's slice of the batch only


@functools.lru_cache(maxsize=4)
def reference(world_size: int = WORLD) -> Reference:
    """Train the lab's model for ``STEPS`` AdamW steps on each whole batch in this process;
    also each rank's un-reduced step-0 gradient (its slice of the batch alone)."""
    def params(m):
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    model = Llama(CONFIG, seed=0)
    initial = params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads, after_first = [], [], {}
    for step in range(STEPS):
        loss = model(batch_for(step)).loss
        loss.backward()
        if step < 2:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            after_first = params(model)
    local = []
    for rank in range(world_size):
        alone = Llama(CONFIG, seed=0)
        alone(batch_for(0, rank, world_size)).loss.backward()
        local.append({n: p.grad.clone() for n, p in alone.named_parameters()})
    return Reference(losses, grads, initial, after_first, params(model), local)


# ----------------------------------------------------------------------------- arithmetic


def num_params(config: LlamaConfig = CONFIG) -> tuple[int, int]:
    """(elements, tensors) of the lab's model, counted on a model built on the meta device."""
    with torch.device("meta"):
        params = list(Llama(config).parameters())
    return sum(p.numel() for p in params), len(params)


def expected(stage: str, elements: int, tensors: int, world_size: int) -> dict[str, int]:
    """Bytes per rank for fp32 parameters and AdamW (the ZeRO paper's arithmetic), per stage:

    ``params``: parameter bytes kept between steps (4 per element; 1/N from ZeRO-3);
    ``grads``: gradient bytes kept for the optimizer (whole up to ZeRO-1, 1/N from ZeRO-2);
    ``optimizer_state``: AdamW's two moments (8 per element; 1/N from ZeRO-1) plus one
    4-byte step counter per tensor; ``wire``: bytes one rank sends per step in a ring,
    2(N-1)/N of the gradients for DDP, ZeRO-1 and ZeRO-2 (all-reduce, or reduce-scatter +
    all-gather), 3(N-1)/N for ZeRO-3 (parameters gathered twice, gradients reduce-scattered).
    Raises ValueError for an unknown stage.
    """
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown stage {stage!r}; use one of {', '.join(STAGE_NAMES)}")
    whole, n = 4 * elements, world_size
    level = STAGE_NAMES.index(stage)
    return {
        "params": whole // n if level >= 3 else whole,
        "grads": whole // n if level >= 2 else whole,
        "optimizer_state": (2 * whole // n if level >= 1 else 2 * whole) + 4 * tensors,
        "wire": round((3 if level == 3 else 2) * (n - 1) / n * whole),
    }


def summary(runs: list[StageRun]) -> dict:
    """Rank 0's measured step as plain numbers (bytes): parameters kept and the most gathered
    at once, whole gradients most alive at once, gradient slices, optimizer state, bytes on
    the wire, and {collective: (calls, bytes)}."""
    memory, timeline = runs[0].memory, runs[0].timeline
    most, now = memory.max_by_category, memory.current
    events = timeline.comm_events(rank=runs[0].rank)
    return {
        "params": now.get("params", 0) + now.get("sharded_params", 0),
        "gathered": most.get("unsharded_params", 0),
        "whole_grads": most.get("grads", 0),
        "grad_slices": most.get("sharded_grads", 0),
        "optimizer_state": most.get("optimizer_state", 0),
        "wire": wire_bytes(events),
        "collectives": bytes_by_collective(events),
    }


def kib(nbytes: float) -> str:
    """``nbytes`` (bytes) as KiB with one decimal, for the checker's messages."""
    return f"{nbytes / 1024:.1f} KiB"
