"""Apples-to-apples comparison of FSDP configurations: same model, same data, same seed.

    from fsdp_lab.compare import compare
    table = compare([{"implementation": "fsdp2"}, {"implementation": "fsdp1"}], steps=3, world_size=2)
    print(table)                 # step time, peak memory, bytes, #collectives, overlap, loss
    table.timelines["fsdp2"]     # the merged Timeline of the last step (all ranks)

Every configuration runs in ONE ``fsdp_lab.launch`` (one process per rank, all configurations
one after another), each from a freshly built model at the same seed on the same batches.
Before anything runs, ``compare`` checks that every run trains the same number of parameters
on the same data and refuses otherwise (``allow_mismatch=True`` to override): a comparison of
different models says nothing about the implementations.

Per run and step (last step's timeline, rank 0 unless noted):
* step_ms: mean wall time of the untracked steps after the second (the first warms up: AdamW
  creates its state, FSDP1 records the execution order its forward prefetch follows; the second
  is measured by MemoryTracker);
* peak_total_mib: the highest tracked total of the second step, the first that repeats, so the
  optimizer's state is held through forward and backward as in every later step; peak_unsharded_mib /
  peak_comm_mib: the highest "unsharded_params" / "comm_buffers" reached (MemoryTracker;
  a prefetched all-gather sits in comm buffers until it is waited for); peak_by_category: each
  category's own highest bytes; at_peak: the bytes of each category at the moment of the total peak;
  peak_phase: the last phase boundary before the total peak ("backward layers.2 end": in the backward
  of the block before it; "optimizer step start": inside optimizer.step());
* all_gathers / reduce_scatters, gathered_bytes / reduced_bytes: collectives of one step;
* overlap: fraction of comm time hidden under compute (mean over ranks);
* loss: the last step's loss (the mean over ranks).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch

from fsdp_lab.launch import launch
from fsdp_lab.checks import check_bool, check_positive_int

__all__ = ["RunConfig", "CompareResult", "compare", "build_run", "run_on_rank", "profiler_collective_order"]

IMPLEMENTATIONS = ("fsdp1", "fsdp2", "torch_fsdp2")
WRAPPINGS = ("block", "two_blocks", "model")
OPTIMIZERS = ("for_loop", "foreach", "fused")
FSDP1_PREFETCH = ("backward_pre", "backward_post", "none")
FSDP2_PREFETCH = ("implicit", "explicit", "none")
# step 0 warms up (optimizer state, FSDP1's recorded order), step 1 is tracked, steps >= 2 are timed
MEMORY_STEP = 1
MIN_STEPS = MEMORY_STEP + 2


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration to compare.

    implementation: "fsdp1" (flat parameters), "fsdp2" (ours, per parameter) or "torch_fsdp2"
        (PyTorch's fully_shard; its collectives are not recorded by our timeline).
    wrapping: "block" (one unit per TransformerBlock + the root), "two_blocks" (pairs of
        blocks), "model" (one unit for everything).
    prefetch: FSDP2 "implicit" (default: in backward the next unit is gathered early),
        "explicit" (set_modules_to_forward_prefetch / _backward_prefetch with the next unit),
        "none"; FSDP1 "backward_pre" (default), "backward_post", "none".
    forward_prefetch, limit_all_gathers: FSDP1's keywords.
    reshard_after_forward: False keeps parameters gathered from forward to backward
        (FSDP1: SHARD_GRAD_OP).
    cpu_offload: sharded parameters, gradients and the optimizer step on the host.
    optimizer: AdamW as a per-parameter "for_loop", "foreach" (multi-tensor) or "fused".
    synchronous: wait for every collective as soon as it is issued (FSDP2 only; no overlap).
    model, data_seed: override the comparison's model config / data seed for this run only
        (to reproduce an unfair comparison; refused unless ``allow_mismatch``).
    """

    name: str = ""
    implementation: str = "fsdp2"
    wrapping: str = "block"
    prefetch: str | None = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    optimizer: str = "foreach"
    synchronous: bool = False
    model: str | None = None
    data_seed: int | None = None

    def __post_init__(self):
        for flag in ("forward_prefetch", "limit_all_gathers", "reshard_after_forward", "cpu_offload", "synchronous"):
            check_bool(flag, getattr(self, flag))
        _check_choice("implementation", self.implementation, IMPLEMENTATIONS)
        _check_choice("wrapping", self.wrapping, WRAPPINGS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.prefetch is None:
            object.__setattr__(self, "prefetch", "backward_pre" if self.implementation == "fsdp1" else "implicit")
        _check_choice("prefetch", self.prefetch, FSDP1_PREFETCH if self.implementation == "fsdp1" else FSDP2_PREFETCH)
        if self.implementation == "fsdp1" and self.wrapping == "two_blocks":
            raise ValueError("wrapping='two_blocks' needs FSDP2 (fully_shard([block_a, block_b])); FSDP1 wraps "
                             "one module per unit: use 'block' or 'model'")
        if self.synchronous and self.implementation != "fsdp2":
            raise ValueError("synchronous=True is a switch of fsdp_lab's FSDP2 only; use implementation='fsdp2'")
        if not self.name:
            object.__setattr__(self, "name", self.label())

    def label(self) -> str:
        """A short name from the settings that differ from the defaults."""
        parts = [self.implementation, self.wrapping, f"prefetch={self.prefetch}"]
        if self.forward_prefetch:
            parts.append("fwd_prefetch")
        if not self.limit_all_gathers:
            parts.append("no_limit")
        if not self.reshard_after_forward:
            parts.append("no_reshard")
        if self.cpu_offload:
            parts.append("offload")
        if self.optimizer != "foreach":
            parts.append(self.optimizer)
        if self.synchronous:
            parts.append("sync")
        return " ".join(parts)


def _check_choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, choices))}")


def _as_config(run) -> RunConfig:
    if isinstance(run, RunConfig):
        return run
    if isinstance(run, dict):
        unknown = set(run) - {f.name for f in dataclasses.fields(RunConfig)}
        if unknown:
            raise TypeError(f"unknown run settings {sorted(unknown)}; known: "
                            f"{[f.name for f in dataclasses.fields(RunConfig)]}")
        return RunConfig(**run)
    raise TypeError(f"a run is a dict or a RunConfig, got {type(run).__name__}")


# -- building one run on one rank -------------------------------------------------------------------
def build_run(config: RunConfig, model_name: str = "cpu", seed: int = 0, lr: float = 1e-3):
    """Build (model, optimizer, units, num_params) for ``config`` on this rank; needs a process group.

    ``units``: (name, module) pairs of the original Llama modules, for ``Timeline.attach``.
    """
    from fsdp_lab.models.llama import Llama

    model = Llama(config.model or model_name, seed=seed)
    units = _llama_units(model)
    num_params = sum(p.numel() for p in model.parameters())
    if config.implementation == "fsdp1":
        model = _wrap_fsdp1(model, config)
    else:
        _wrap_fsdp2(model, config)
    kwargs = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **kwargs[config.optimizer])
    return model, optimizer, units, num_params


def _llama_units(model) -> list[tuple[str, torch.nn.Module]]:
    units = [("tok_embeddings", model.tok_embeddings)]
    units += [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    return units + [("norm", model.norm), ("output", model.output)]


def _groups_of(model, wrapping: str) -> list:
    """The modules (or lists of modules) sharded below the root, in forward order."""
    layers = list(model.layers)
    if wrapping == "block":
        return layers
    if wrapping == "two_blocks":
        return [layers[i:i + 2] if len(layers[i:i + 2]) > 1 else layers[i] for i in range(0, len(layers), 2)]
    return []


def _wrap_fsdp2(model, config: RunConfig) -> None:
    if config.implementation == "torch_fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
    else:
        from fsdp_lab.fsdp2 import CPUOffloadPolicy, OffloadPolicy, fully_shard
    kwargs = {"reshard_after_forward": config.reshard_after_forward,
              "offload_policy": CPUOffloadPolicy(pin_memory=False) if config.cpu_offload else OffloadPolicy()}
    units = [fully_shard(group, **kwargs) for group in _groups_of(model, config.wrapping)]
    fully_shard(model, **{**kwargs, "reshard_after_forward": None} if config.implementation == "fsdp2" else kwargs)
    if config.prefetch == "none" or config.prefetch == "explicit":
        owners = [model] + [u[0] if isinstance(u, list) else u for u in units]
        for i, owner in enumerate(owners):
            if config.prefetch == "explicit" and i + 1 < len(owners):
                owner.set_modules_to_forward_prefetch([owners[i + 1]])
            if i >= 1:  # backward runs the units in reverse: unit i prefetches unit i-1 (the root holds on)
                owner.set_modules_to_backward_prefetch([owners[i - 1]] if config.prefetch == "explicit" and i > 1
                                                       else [])
        if config.prefetch == "none":
            model.set_modules_to_backward_prefetch([])


def _wrap_fsdp1(model, config: RunConfig):
    from fsdp_lab.fsdp1 import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel, ModuleWrapPolicy,
                                ShardingStrategy)
    from fsdp_lab.models.llama import TransformerBlock

    prefetch = {"backward_pre": BackwardPrefetch.BACKWARD_PRE, "backward_post": BackwardPrefetch.BACKWARD_POST,
                "none": None}[config.prefetch]
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}) if config.wrapping == "block" else None,
        sharding_strategy=ShardingStrategy.FULL_SHARD if config.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=config.cpu_offload), backward_prefetch=prefetch,
        forward_prefetch=config.forward_prefetch, limit_all_gathers=config.limit_all_gathers)


def run_on_rank(configs: list[RunConfig], model_name: str, steps: int, batch_size: int, seq_len: int,
                seed: int, lr: float) -> list[dict]:
    """Train every configuration ``steps`` steps on this rank; one result dict per config.

    Each dict holds the measured numbers and ``timeline`` (this rank's last step).
    """
    import torch.distributed as dist

    from fsdp_lab.fsdp2 import param_group
    from fsdp_lab.memory import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.unit_timing import attach_units

    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = []
    for config in configs:
        torch.manual_seed(seed)
        model, optimizer, units, num_params = build_run(config, model_name, seed, lr)
        vocab = units[0][1].num_embeddings
        data_seed = seed if config.data_seed is None else config.data_seed
        previous = param_group.set_synchronous(config.synchronous)
        try:
            losses, times, peak, at_peak, peak_phase, timeline = [], [], {}, {}, "", None
            for step in range(steps):
                batch = shard_batch(global_batch(vocab, batch_size, seq_len, seed=data_seed, step=step),
                                    rank, world_size)
                dist.barrier()
                start = time.perf_counter()
                if step == MEMORY_STEP:
                    with MemoryTracker(model, optimizer) as tracker:
                        loss = _train_step(model, optimizer, batch, None)
                    peak = tracker.max_by_category()
                    peak["total"] = tracker.peak_total()
                    at_peak, peak_phase = tracker.peak(), tracker.result().peak_label
                elif step == steps - 1:
                    with Timeline() as timeline:
                        handles = attach_units(timeline, model, units)
                        loss = _train_step(model, optimizer, batch, timeline)
                        for handle in handles:
                            handle.remove()
                else:
                    loss = _train_step(model, optimizer, batch, None)
                times.append(time.perf_counter() - start)
                losses.append(loss)
        finally:
            param_group.set_synchronous(previous)
        results.append({"name": config.name, "losses": losses, "step_seconds": times, "peak": peak,
                        "at_peak": at_peak, "peak_phase": peak_phase,
                        "timeline": timeline, "num_params": num_params,
                        "data_seed": data_seed})
        del model, optimizer, units  # nothing of this run may outlive it into the next one
    return results


def _train_step(model, optimizer, batch, timeline) -> float:
    loss = model(batch.input_ids, batch.labels).loss
    loss.backward()
    if timeline is not None:
        with timeline.span("optimizer_step", phase="optimizer"):
            optimizer.step()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


# -- the comparison -----------------------------------------------------------------------------------
_COLUMNS = [("name", "run", "{}"), ("step_ms", "step ms", "{:.1f}"), ("peak_total_mib", "peak MiB", "{:.2f}"),
            ("peak_unsharded_mib", "unsharded MiB", "{:.2f}"), ("peak_comm_mib", "comm buf MiB", "{:.2f}"),
            ("all_gathers", "#AG", "{}"),
            ("reduce_scatters", "#RS", "{}"), ("gathered_mib", "AG MiB", "{:.3f}"),
            ("reduced_mib", "RS MiB", "{:.3f}"), ("overlap", "overlap", "{:.2f}"),
            ("optimizer_ms", "optim ms", "{:.2f}"), ("loss", "loss", "{:.4f}")]


class CompareResult(list):
    """The table ``compare`` returns: a list of row dicts (one per run) plus

    * ``timelines``: run name -> merged ``Timeline`` of the last step (all ranks; None for
      runs whose collectives are not recorded, i.e. torch_fsdp2 has compute events only);
    * ``configs``: run name -> ``RunConfig``; ``raw``: per-rank results;
    * ``format(columns=None, timings=True)`` / ``str()``: a plain-text table.
    """

    def __init__(self, rows, timelines, configs, raw):
        super().__init__(rows)
        self.timelines, self.configs, self.raw = timelines, configs, raw

    def row(self, name: str) -> dict:
        """The row of the run called ``name`` (KeyError naming the runs otherwise)."""
        for row in self:
            if row["name"] == name:
                return row
        raise KeyError(f"no run named {name!r}; runs: {[r['name'] for r in self]}")

    def format(self, columns: Iterable[str] | None = None, timings: bool = True,
               names: Iterable[str] | None = None) -> str:
        """Plain-text table of the runs ``names`` (default all). ``timings=False`` leaves out the
        machine-dependent columns (step_ms, overlap, optimizer_ms) so the rest is deterministic."""
        rows = [self.row(n) for n in names] if names is not None else list(self)
        columns = list(columns) if columns is not None else None
        cols = [c for c in _COLUMNS if (columns is None or c[0] in columns)
                and (timings or c[0] not in ("step_ms", "overlap", "optimizer_ms"))]
        cells = [[head for _, head, _ in cols]]
        cells += [[fmt.format(row[key]) for key, _, fmt in cols] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in cells]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def phase_table(self, names: Iterable[str] | None = None) -> str:
        """Milliseconds per phase (mean over ranks) of the last step, one line per run."""
        names = list(names) if names is not None else [r["name"] for r in self]
        phases = ("forward", "backward", "optimizer", "other_compute", "exposed_comm", "idle", "window")
        head = "run (ms per rank)"
        width = max(len(n) for n in names + [head])
        lines = [head.ljust(width) + "".join(p.rjust(14) for p in phases)]
        for name in names:
            summary = self.row(name)["phases"]
            means = [1e3 * sum(s[p] for s in summary.values()) / len(summary) for p in phases]
            lines.append(name.ljust(width) + "".join(f"{v:14.2f}" for v in means))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return self.format()


def _data_key(config: RunConfig, seed: int, batch_size: int, seq_len: int) -> tuple:
    return (seed if config.data_seed is None else config.data_seed, batch_size, seq_len)


def _param_count(model_name: str) -> int:
    from fsdp_lab.models.llama import LlamaConfig

    cfg = LlamaConfig.from_name(model_name)
    from fsdp_lab.models.llama import Llama
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(cfg, seed=0).parameters())


def check_comparable(configs: list[RunConfig], model: str, seed: int, batch_size: int, seq_len: int) -> list[str]:
    """What differs between the runs' models and data (empty when they are comparable)."""
    problems = []
    counts = {c.name: _param_count(c.model or model) for c in configs}
    if len(set(counts.values())) > 1:
        problems.append("parameter count differs: " + ", ".join(f"{n!r} has {v:,}" for n, v in counts.items()))
    data = {c.name: _data_key(c, seed, batch_size, seq_len) for c in configs}
    if len(set(data.values())) > 1:
        problems.append("data differs: " + ", ".join(f"{n!r} uses seed {k[0]}" for n, k in data.items()))
    return problems


def compare(runs: list, *, model: str = "cpu", steps: int = MIN_STEPS, world_size: int = 2, batch_size: int = 4,
            seq_len: int = 32, seed: int = 0, lr: float = 1e-3, allow_mismatch: bool = False,
            timeout: float = 300.0) -> CompareResult:
    """Run every configuration in ``runs`` on identical model/data/seed and tabulate them.

    ``runs``: dicts of ``RunConfig`` fields or ``RunConfig``s (names must be unique).
    ``model``: a Llama config name; ``steps`` >= 3 training steps of a global batch of
    ``batch_size`` sequences of ``seq_len`` tokens, split over ``world_size`` ranks. All runs
    share one ``fsdp_lab.launch``. The first step warms up, ``MemoryTracker`` measures the
    second (the first that repeats: the optimizer's state is held throughout it), the later
    ones are timed. Returns a ``CompareResult`` (rows in the order given).

    Raises:
        ValueError: runs whose parameter count or data differ (unless ``allow_mismatch``),
            duplicate names, steps < 3, a world size, batch or sequence length below 1, a batch
            not divisible by world_size, a bad setting.
        TypeError: a single run instead of a list, a run that is neither a dict nor a RunConfig,
            or has unknown settings.
    """
    if isinstance(runs, (dict, RunConfig)):
        raise TypeError("compare takes a list of runs and got one run; pass compare([run]) (or several)")
    configs = [_as_config(r) for r in runs]
    if not configs:
        raise ValueError("compare needs at least one run")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}; give runs a 'name'")
    if steps < MIN_STEPS:
        raise ValueError(f"steps must be >= {MIN_STEPS} (the first step warms up, the second is measured by "
                         f"MemoryTracker, the rest are timed), got {steps}")
    for name, value in (("world_size", world_size), ("batch_size", batch_size), ("seq_len", seq_len)):
        check_positive_int(name, value)
    if batch_size % world_size:
        raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
    problems = check_comparable(configs, model, seed, batch_size, seq_len)
    if problems and not allow_mismatch:
        raise ValueError("refusing to compare runs that train different things: " + "; ".join(problems)
                         + ". Make the runs use the same model and data, or pass allow_mismatch=True "
                         "to compare them anyway (the numbers will not mean what they seem to)")
    per_rank = launch(run_on_rank, configs, model, steps, batch_size, seq_len, seed, lr,
                               world_size=world_size, timeout=timeout)
    from fsdp_lab.timeline import Timeline

    rows, timelines = [], {}
    for i, config in enumerate(configs):
        ranks = [r[i] for r in per_rank]
        tl = Timeline.merge([r["timeline"] for r in ranks])
        timelines[config.name] = tl
        rows.append(_row(config, ranks, tl))
    return CompareResult(rows, timelines, {c.name: c for c in configs}, per_rank)


def _row(config: RunConfig, ranks: list[dict], tl) -> dict:
    mib = 2 ** 20
    rank0 = ranks[0]
    gathers = tl.comm_events(0, "all_gather")
    reduces = tl.comm_events(0, "reduce_scatter")
    overlap = tl.overlap()
    phases = tl.phase_summary()
    timed = [t for r in ranks for t in r["step_seconds"][MEMORY_STEP + 1:]]
    peak = rank0["peak"]
    return {
        "name": config.name, "implementation": config.implementation, "wrapping": config.wrapping,
        "prefetch": config.prefetch, "num_params": rank0["num_params"],
        "step_ms": 1e3 * sum(timed) / len(timed),
        "peak_total_mib": peak.get("total", 0) / mib,
        "peak_unsharded_mib": peak.get("unsharded_params", 0) / mib,
        "peak_comm_mib": peak.get("comm_buffers", 0) / mib,
        "peak_by_category": {k: v for k, v in peak.items() if k != "total"},
        "at_peak": dict(rank0["at_peak"]), "peak_phase": rank0["peak_phase"],
        "all_gathers": len(gathers), "reduce_scatters": len(reduces),
        "gathered_bytes": sum(e.bytes for e in gathers), "reduced_bytes": sum(e.bytes for e in reduces),
        "gathered_mib": sum(e.bytes for e in gathers) / mib, "reduced_mib": sum(e.bytes for e in reduces) / mib,
        "collectives": len(tl.comm_events(0)),
        "overlap": sum(overlap.values()) / len(overlap) if overlap else 0.0,
        "optimizer_ms": 1e3 * sum(p["optimizer"] for p in phases.values()) / max(len(phases), 1),
        "phases": phases,
        "loss": sum(r["losses"][-1] for r in ranks) / len(ranks),
        "losses": [sum(r["losses"][s] for r in ranks) / len(ranks) for s in range(len(rank0["losses"]))],
    }


# -- GPU only: does torch.profiler see the collectives in the same order as our timeline? ------------
def profiler_collective_order(step, timeline_name: str = "all_gather") -> dict:
    """Run ``step()`` once under both ``torch.profiler`` and a ``Timeline`` on CUDA and return
    ``{"timeline": [...], "profiler": [...]}``: the order of ``timeline_name`` collectives each saw
    (names of NCCL kernels for the profiler, module labels for the timeline).

    Raises RuntimeError without CUDA (on CPU gloo the profiler records no collective kernels).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("profiler_collective_order needs a CUDA device: NCCL kernels are what the "
                           "profiler records; on CPU compare Timeline events only")
    from torch.profiler import ProfilerActivity, profile

    from fsdp_lab.timeline import Timeline

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, Timeline() as tl:
        step()
        torch.cuda.synchronize()
    key = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}[timeline_name]
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and key in e.name.lower().replace("_", "")), key=lambda e: e.time_range.start)
    return {"timeline": [e.args.get("module", e.name) for e in tl.comm_events(name=timeline_name)],
            "profiler": [e.name for e in kernels]}
