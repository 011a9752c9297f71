"""Checkers for lab 06 (mixed precision).

* ``check_reduce_grad_shard(reduce_grad_shard)``: the gradient reduction of a ZeRO-1 /
  Megatron-FSDP ``optim``-mode step: each rank's whole float32 gradient, sent in the wire dtype,
  reduce-scattered, this rank's shard of the mean returned in float32. Reference: the mean of
  all ranks' gradients computed on one process in float32 (and, for a bf16 wire, the same sum
  done in bf16 on one process, which is what gloo does).
* ``check_unscale_and_check(unscale_and_check)``: the loss-scaling step under sharding: unscale
  this rank's gradient shards and agree across ranks whether any is inf/NaN. Reference:
  ``torch.amp.GradScaler`` stepping the whole (unsharded) gradient on one process.

The lab's figures, tables and the explorer's figure are drawn here too (``draw_gradient_life``,
``print_policy_memory``, ``plot_policies``, ``print_policy_ratios``, ``print_policy_losses``,
``print_optim_mode_bug``, ``plot_optim_mode_bug``, ``draw_policy_run``). The training loop of
section 4 and of the explorer, and its measurement, run here as well (``train_and_measure``); the
notebook keeps the policies, the sharded models they train and the other runs.
"""

from __future__ import annotations

import re

import torch

from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, checker, correct, is_placeholder, mistake, placeholder_left,
                                        collective_calls)

WORLD = 2
NUMEL = 8  # a whole gradient; each rank's shard is NUMEL // WORLD elements
# a second run, for answers right on WORLD ranks: NUMEL // OTHER_WORLD elements per shard, so an
# answer that writes in 2 for the world size (the shard's size or the division) fails there
OTHER_WORLD = 4
WIRES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_gradient(rank: int) -> torch.Tensor:
    """Rank ``rank``'s whole float32 gradient in the checks: values that bf16 cannot hold exactly."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def _run_reduce(answer):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, wire in WIRES.items():
        local = rank_gradient(rank)
        with collective_calls() as calls:
            result = answer(local, wire)
        if isinstance(result, torch.Tensor):
            result = result.detach().clone()
        out[name] = {"result": result, "comm": [(c.name, c.bytes, c.args.get("dtype")) for c in calls]}
    return out


def _close(a, b, atol=1e-6) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == torch.float32
            and torch.allclose(a, b, rtol=0, atol=atol))


def _other_world(reduce_grad_shard):
    """None if ``reduce_grad_shard``, right on WORLD ranks, is right on OTHER_WORLD ranks too (both
    wires; the bf16 one within bf16's rounding), else the mistake "fixed_world"."""
    where = f"on {OTHER_WORLD} ranks ({NUMEL} elements, {NUMEL // OTHER_WORLD} per shard)"
    hint = ("take the world size from torch.distributed.get_world_size(): the shard has "
            "local_grad.numel() // world elements and the sum is divided by world")
    try:
        out = launch(_run_reduce, reduce_grad_shard, world_size=OTHER_WORLD, timeout=CHECK_TIMEOUT)
    except LaunchTimeout:
        raise  # the checker's own verdict for a hang
    except LaunchError as error:
        first = str(error).strip().splitlines()
        # without "rank N raised": which rank fails first changes from run to run
        summary = re.sub(r"^rank \d+ raised ", "", first[0]) if first else "a rank failed"
        return mistake("fixed_world", f"on {WORLD} ranks your shards are right, but {where} your code raised "
                                      f"{summary}: it assumes {WORLD} ranks somewhere", hint=hint)
    mean = torch.stack([rank_gradient(r) for r in range(OTHER_WORLD)]).mean(0).chunk(OTHER_WORLD)
    ratio = OTHER_WORLD / WORLD
    for wire, atol in (("float32", 1e-6), ("bfloat16", 3e-2)):
        results = [o[wire]["result"] for o in out]
        if all(_close(res, mean[r], atol) for r, res in enumerate(results)):
            continue
        if all(_close(res, mean[r] * ratio, atol * ratio) for r, res in enumerate(results)):
            return mistake("fixed_world", f"on {WORLD} ranks your shards are right, but {where} each is "
                                          f"{ratio:g}x the mean: the sum was divided by {WORLD}, not by the "
                                          "world size", hint=hint)
        shown = results[0].tolist() if isinstance(results[0], torch.Tensor) else type(results[0]).__name__
        return mistake("fixed_world", f"on {WORLD} ranks your shards are right, but {where} rank 0 returned "
                                      f"{shown} with a {wire} wire instead of the mean gradient's shard "
                                      f"{mean[0].tolist()}: the code assumes {WORLD} ranks somewhere", hint=hint)
    return None


@checker("reduce_grad_shard", hint="cast local_grad to wire_dtype, reduce-scatter it (sum over ranks) into "
                                   "a wire_dtype tensor of local_grad.numel() // world elements, then return "
                                   "that shard in float32 divided by the world size")
def check_reduce_grad_shard(reduce_grad_shard):
    """Run ``reduce_grad_shard(local_grad, wire_dtype)`` on 2 ranks with a float32 and a bf16 wire
    and compare each rank's result with the mean gradient computed on one process; an answer right
    there runs once more on OTHER_WORLD ranks, where one that writes in 2 ranks fails."""
    out = launch(_run_reduce, reduce_grad_shard, world_size=WORLD, timeout=CHECK_TIMEOUT)
    if any(is_placeholder(o[w]["result"]) for o in out for w in WIRES):
        return placeholder_left("reduce_grad_shard")
    grads = [rank_gradient(r) for r in range(WORLD)]
    total = torch.stack(grads).sum(0)
    mean_shards = (total / WORLD).chunk(WORLD)
    k = NUMEL // WORLD
    fp32 = [o["float32"] for o in out]
    results = [o["result"] for o in fp32]
    if not all(isinstance(r, torch.Tensor) for r in results):
        return mistake("not_a_tensor", f"rank 0 returned {type(results[0]).__name__}; return this rank's "
                                       "shard as a tensor")
    if any(r.numel() == NUMEL for r in results):
        return mistake("whole_gradient", f"you returned all {NUMEL} elements; in ZeRO-1 a rank keeps only "
                                         f"its {k}-element shard of the reduced gradient (its optimizer "
                                         "steps only that slice)")
    names = {name for o in fp32 for name, _, _ in o["comm"]}
    if not names and not all(_close(res, mean_shards[r]) for r, res in enumerate(results)):
        return mistake("no_collective", "no collective ran: each rank's shard must hold the other ranks' "
                                        "gradients too", hint="collectives.reduce_scatter_tensor(shard, wire)")
    own = [(g.chunk(WORLD)[r]) for r, g in enumerate(grads)]
    if all(_close(res, (own[r] + total.chunk(WORLD)[r]) / WORLD) or _close(res, own[r] + mean_shards[r])
           for r, res in enumerate(results)):
        return mistake("added_to_local_shard",
                       "rank i got its own gradient plus the reduced one, g_i + sum_j g_j: you added the "
                       "reduced shard into the rank's un-reduced slice of the buffer (Megatron-FSDP's optim "
                       "mode had exactly this bug until Megatron-LM PR #3067)",
                       hint="the reduced shard replaces the local slice (copy, do not add)")
    if all(_close(res, total.chunk(WORLD)[r]) for r, res in enumerate(results)):
        return mistake("not_averaged", "each shard is the sum over the ranks, not the mean: the update "
                                       f"would be {WORLD}x too large", hint="divide by the world size")
    if all(_close(res, mean_shards[(r + 1) % WORLD]) for r, res in enumerate(results)):
        return mistake("wrong_shard", "each rank holds another rank's shard of the mean",
                       hint="rank r's shard is elements r*k:(r+1)*k")
    if not all(_close(res, mean_shards[r]) for r, res in enumerate(results)):
        return mistake("wrong_values", f"rank 0's shard {results[0].tolist()} differs from the mean "
                                       f"gradient's {mean_shards[0].tolist()}")
    bf16 = [o["bfloat16"] for o in out]
    if any(not isinstance(o["result"], torch.Tensor) or o["result"].dtype != torch.float32 for o in bf16):
        dtype = getattr(bf16[0]["result"], "dtype", None)
        return mistake("returned_wire_dtype", f"with a bf16 wire you returned {dtype}: the shard the "
                                              "optimizer steps must be accumulated in float32",
                       hint="return shard.float() / world")
    # the mean a bf16 wire gives: each gradient rounded to bf16, summed in bf16 (as gloo does)
    summed_in_bf16 = torch.stack([g.to(torch.bfloat16) for g in grads]).sum(0).float() / WORLD
    error = (summed_in_bf16 - total / WORLD).abs().max().item()
    if not names:  # right values through calls neither recorder sees (a group's own methods, say)
        fixed = _other_world(reduce_grad_shard)
        if fixed is not None:
            return fixed
        return correct(f"on {WORLD} ranks each shard is the mean gradient (off the float32 mean by up to "
                       f"{error:.1e} with a bf16 wire). The check saw none of your collectives, so the bytes "
                       "on the wire were not counted: with collectives.reduce_scatter_tensor or "
                       "torch.distributed.reduce_scatter_tensor it would count them")
    wire_dtypes = {d for o in bf16 for _, _, d in o["comm"]}
    if wire_dtypes != {"bfloat16"}:
        return mistake("wire_not_bf16", f"asked for a bf16 wire, your collectives sent {sorted(wire_dtypes)}: "
                                        "the bytes on the wire are not halved",
                       hint="cast local_grad to wire_dtype before the reduce-scatter")
    if not all(_close(o["result"], summed_in_bf16.chunk(WORLD)[r], atol=0) for r, o in enumerate(bf16)):
        return mistake("wrong_values_bf16", "with a bf16 wire your shards differ from the sum of the ranks' "
                                            "bf16 gradients (done on one process)",
                       hint="cast local_grad to wire_dtype before the reduce-scatter, and the shard back "
                            "to float32 after it")
    sent = {w: sum(b for name, b, _ in out[0][w]["comm"]) for w in WIRES}
    if "all_reduce" not in names and names != {"reduce_scatter"}:
        return mistake("not_reduce_scatter", f"the values are right, but through {', '.join(sorted(names))} "
                                             "instead of one reduce-scatter, which sums on the way and hands each "
                                             "rank only its shard",
                       hint="one collectives.reduce_scatter_tensor(shard, local_grad.to(wire_dtype))")
    if "all_reduce" in names:
        return mistake("used_all_reduce", f"the values are right but you all-reduced: every rank received "
                                          f"the whole gradient ({sent['float32']} bytes per call) to keep a "
                                          "1/N shard of it", hint="reduce_scatter_tensor gives each rank only "
                                                                  "its shard")
    fixed = _other_world(reduce_grad_shard)
    if fixed is not None:
        return fixed
    return correct(f"on {WORLD} ranks each shard is the mean gradient; the bf16 wire moved {sent['bfloat16']} "
                   f"bytes per reduce-scatter instead of {sent['float32']}, and because each rank's gradient was "
                   f"rounded to bf16 and the ranks' contributions summed in bf16, the shard is off the float32 "
                   f"mean by up to {error:.1e}: float32 accumulation afterwards cannot remove that rounding")


# ----------------------------------------------------------------------------- loss scaling

SCALE = 1024.0
# {case: (rank, shard, value)}: the bad value sits in either shard, so a flag that looks at one
# shard only (set anew for each shard in a loop) misses one of the infs
CASES = {"inf in rank 1's last shard": (1, 1, float("inf")), "nan in rank 0's first shard": (0, 0, float("nan")),
         "inf in rank 0's first shard": (0, 0, float("inf")), "no overflow": (None, None, None)}
INF_LAST, NAN_FIRST, INF_FIRST = list(CASES)[:3]


def rank_shards(rank: int, case: str) -> list[torch.Tensor]:
    """Rank ``rank``'s scaled gradient shards (two tensors) in ``case``."""
    gen = torch.Generator().manual_seed(7 + rank)
    shards = [torch.randn(3, generator=gen) * SCALE, torch.randn(2, generator=gen) * SCALE]
    bad_rank, shard, value = CASES[case]
    if rank == bad_rank:
        shards[shard][0] = value
    return shards


def _run_unscale(answer):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for case in CASES:
        shards = rank_shards(rank, case)
        found = answer(shards, SCALE)
        out[case] = {"found": found, "shards": [s.clone() for s in shards]}
    return out


def _reference(case: str):
    """torch.amp.GradScaler on one process, on the whole gradient (all ranks' shards): whether it
    found an overflow (it skips the step) and the unscaled gradients."""
    params = []
    for i in range(2):
        whole = torch.cat([rank_shards(r, case)[i] for r in range(WORLD)])
        p = torch.nn.Parameter(torch.zeros_like(whole))
        p.grad = whole
        params.append(p)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(torch.zeros(()))  # GradScaler creates its scale tensor on first use
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.step(opt)
    stepped = any(bool(p.detach().ne(0).any()) for p in params)
    unscaled = [[p.grad[r * n:(r + 1) * n] for p, n in zip(params, (3, 2))] for r in range(WORLD)]
    return (not stepped), unscaled


def _same_shards(mine, reference) -> bool:
    return all(isinstance(a, torch.Tensor) and a.shape == b.shape
               and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(mine, reference))


@checker("unscale_and_check", hint="multiply every shard by 1 / scale in place; set a one-element flag to 1 "
                                   "if any shard has an inf or NaN (torch.isfinite); all-reduce the flag "
                                   "with op='max'; return bool(flag)")
def check_unscale_and_check(unscale_and_check):
    """Run ``unscale_and_check(shards, scale)`` on 2 ranks for an inf in rank 1's last shard, a NaN
    and an inf in rank 0's first shard, and no overflow; compare with torch.amp.GradScaler on the
    whole gradient on one process."""
    out = launch(_run_unscale, unscale_and_check, world_size=WORLD, timeout=CHECK_TIMEOUT)
    if any(is_placeholder(o[c]["found"]) for o in out for c in CASES):
        return placeholder_left("unscale_and_check")
    if any(not isinstance(o[c]["found"], (bool, int)) and not
           (isinstance(o[c]["found"], torch.Tensor) and o[c]["found"].numel() == 1) for o in out for c in CASES):
        return mistake("not_a_bool", f"return True or False, not {type(out[0]['no overflow']['found']).__name__}")
    verdicts = {c: [bool(o[c]["found"]) for o in out] for c in CASES}
    references = {c: _reference(c) for c in CASES}
    for case, found in verdicts.items():
        if len(set(found)) > 1:
            return mistake("local_only", f"with {case}, rank 0 said {found[0]} and rank 1 {found[1]}: each rank "
                                         "looked only at its own shard, so one rank would step and the other "
                                         "skip: the model would mix updated and stale shards",
                           hint="all-reduce the flag (op='max') so every rank decides the same")
    if verdicts[INF_LAST][0] and not verdicts[INF_FIRST][0]:
        return mistake("one_shard_only", f"with an {INF_LAST} you returned True, with an {INF_FIRST} False: "
                                         "the flag kept only the last shard's verdict (set anew for each "
                                         "shard?)", hint="set the flag once before the loop and only ever "
                                                         "raise it inside")
    if verdicts[INF_LAST][0] and verdicts[INF_FIRST][0] and not verdicts[NAN_FIRST][0]:
        return mistake("missed_nan", "an inf was found but a NaN was not: torch.isinf misses NaN",
                       hint="use torch.isfinite(...).all()")
    for case, (expected, _) in references.items():
        if verdicts[case][0] != expected:
            return mistake("wrong_flag", f"with {case} you returned {verdicts[case][0]}; GradScaler "
                                         f"{'skips' if expected else 'takes'} that step")
    clean = [o["no overflow"]["shards"] for o in out]
    scaled = [rank_shards(r, "no overflow") for r in range(WORLD)]
    if all(_same_shards(c, s) for c, s in zip(clean, scaled)):
        return mistake("not_unscaled", "the shards still hold the scaled gradients: the optimizer would "
                                       f"step {SCALE:.0f}x too far", hint="multiply each shard by 1 / scale in place")
    # the shards handed in are scaled already: multiplying them by the scale leaves SCALE x those
    if all(_same_shards(c, [t * SCALE for t in s]) for c, s in zip(clean, scaled)):
        return mistake("multiplied_by_scale", "the shards were multiplied by the scale instead of divided")
    for case, (_, unscaled) in references.items():
        if not all(_same_shards(o[case]["shards"], unscaled[r]) for r, o in enumerate(out)):
            return mistake("wrong_unscale", f"with {case} your shards differ from what GradScaler.unscale_ "
                                            "leaves (divide in place, also when an overflow was found)")
    return correct(f"every rank skips the three steps with an overflow (an inf in either shard of either rank, "
                   f"a NaN) and steps the clean one, as torch.amp.GradScaler decides on the whole gradient; the shards are "
                   f"divided by {SCALE:.0f}. One all-reduce of one element per step keeps the ranks agreeing")


# ----------------------------------------------------------------------------- the lab's training runs

def train_and_measure(model, vocab_size: int, steps: int, batch: int, seq: int, micro: int,
                      loss_scaling: bool = False) -> dict:
    """Train ``model`` (already sharded with its mixed-precision policy) with AdamW (lr 3e-3, eps
    1e-4) for ``steps`` steps on this rank's shard of each global batch of ``batch`` sequences of
    ``seq`` tokens (``fsdp_lab.models.data.global_batch`` at that step's seed, ``vocab_size``
    token ids), in ``micro`` microbatches whose gradients sync on the last one only; with
    ``loss_scaling`` (a float16 policy) under ``ShardedLossScaler``. The second step (the first
    with AdamW's state) is measured on this rank with ``MemoryTracker`` and ``Timeline``.

    Call it on every rank of a launch: each step's loss is all-reduced. Returns a dict:
    "losses" (the loss of each step, mean over ranks), "memory" ({category: bytes} at the peak
    of the measured step), "highest" ({category: the highest bytes it reached in that step}),
    "wire" ({collective: bytes in that step, nccl-tests' size: all-gather output, reduce-scatter
    input}), "skipped" (steps loss scaling skipped; 0 without it) and "scale" (the final loss
    scale; None without it). Categories and collectives at 0 bytes are left out. Raises
    ValueError if ``steps`` < 2 (nothing would be measured).
    """
    import contextlib

    import torch.distributed as dist

    from fsdp_lab.grad_scaler import ShardedLossScaler
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.timeline import Timeline

    if steps < 2:
        raise ValueError(f"steps={steps}: the second step is the one measured, train at least 2")
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    scaler = ShardedLossScaler() if loss_scaling else None   # float16 needs loss scaling; bf16 does not
    losses = []
    for step in range(steps):
        data = shard_batch(global_batch(vocab_size, batch, seq, step=step), rank, world)
        measured = step == 1
        with (MemoryTracker(model, opt) if measured else contextlib.nullcontext()) as mt, \
                (Timeline() if measured else contextlib.nullcontext()) as tl:
            loss = torch.zeros(())
            for i, chunk in enumerate(data.chunk(micro)):
                model.set_requires_gradient_sync(i == micro - 1)
                micro_loss = model(chunk.input_ids, chunk.labels).loss / micro
                (micro_loss if scaler is None else scaler.scale(micro_loss)).backward()
                loss += micro_loss.detach().float()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        if measured:
            memory = {k: v for k, v in mt.peak().items() if v}              # all categories at one instant
            highest = {k: v for k, v in mt.max_by_category().items() if v}  # each category's own maximum
            wire = {}
            for e in tl.comm_events(rank):
                wire[e.name] = wire.get(e.name, 0) + e.bytes
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {"losses": losses, "memory": memory, "highest": highest, "wire": wire,
            "skipped": 0 if scaler is None else scaler.skipped,
            "scale": None if scaler is None else scaler.get_scale()}


# ----------------------------------------------------------------------------- the lab's figures and tables
# matplotlib and ipywidgets are imported inside these functions: the checkers' ranks import this
# module and need neither.

DTYPE_COLORS = {torch.float32: "#4C72B0", torch.bfloat16: "#DD8452", torch.float16: "#55A868"}
MEMORY_COLUMNS = {"sharded_params": ("sharded", 7), "unsharded_params": ("gathered", 8),
                  "unsharded_grads": ("acc.grad", 8), "sharded_grads": ("sh.grad", 7),
                  "optimizer_state": ("optim", 6), "activations": ("act.", 6), "temporaries": ("temp", 6)}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype without its module: ``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def draw_gradient_life(life: dict, stages: list[tuple[str, str]], ax=None):
    """One box per stage of a gradient's life, left to right, coloured by dtype and labelled with
    its size in KiB. ``life``: {stage: (dtype, bytes)}; ``stages``: [(stage, label)] in order.
    Returns the Axes. Raises KeyError for a stage that ``life`` lacks."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(11, 2.6))[1]
    for i, (key, label) in enumerate(stages):
        dtype, nbytes = life[key]
        ax.add_patch(plt.Rectangle((i * 1.5, 0), 1.2, 1, color=DTYPE_COLORS.get(dtype, "#999"), alpha=0.85))
        ax.text(i * 1.5 + 0.6, 0.62, dtype_name(dtype), ha="center", fontsize=9, color="white", weight="bold")
        ax.text(i * 1.5 + 0.6, 0.3, f"{nbytes / 1024:.0f} KiB", ha="center", fontsize=8, color="white")
        ax.text(i * 1.5 + 0.6, -0.25, "\n".join(label.split(" ", 2)[:2] + label.split(" ", 2)[2:]),
                ha="center", va="top", fontsize=7)
        if i:
            ax.annotate("", xy=(i * 1.5, 0.5), xytext=(i * 1.5 - 0.3, 0.5), arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.2, len(stages) * 1.5)
    ax.set_ylim(-0.9, 1.2)
    ax.axis("off")
    ax.set_title("life of layers.0.feed_forward.w1's gradient (rank 0, 2 ranks)")
    return ax


def print_policy_memory(table: dict) -> None:
    """Print one row per policy: the highest each memory category reached (KiB) and the bytes
    all-gathered and reduce-scattered per step. ``table``: {policy: {"highest": {category: bytes},
    "wire": {collective: bytes}}}. Raises KeyError for a row without "highest" or "wire"."""
    header = " ".join(f"{name:>{width}}" for name, width in MEMORY_COLUMNS.values())
    print(f"{'policy':>30} | {header} | {'AG bytes':>9} {'RS bytes':>9}")
    for name, row in table.items():
        m = row["highest"]
        print(f"{name:>30} | " + " ".join(f"{m.get(c, 0) / 1024:{w}.0f}" for c, (_, w) in MEMORY_COLUMNS.items())
              + f" | {row['wire'].get('all_gather', 0):9,d} {row['wire'].get('reduce_scatter', 0):9,d}")
    print("(KiB on rank 0: the highest each category reached during the second step; bytes per step on rank 0)")


def plot_policies(table: dict):
    """Left: each policy's loss minus the "fp32" policy's, step by step; right: memory by category
    at rank 0's peak (KiB), one stacked bar per policy. ``table``: {policy: {"losses": [...],
    "memory": {category: bytes}}}. Returns the Figure. Raises KeyError without an "fp32" policy."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    reference = table["fp32"]["losses"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1.1, 1]})
    for name, row in table.items():
        if name != "fp32":
            ax0.plot(range(1, len(reference) + 1), [a - b for a, b in zip(row["losses"], reference)], label=name, lw=1.2)
    ax0.axhline(0, color="black", lw=0.8, label="fp32 (the reference)")
    ax0.set_xlabel("step"); ax0.set_ylabel("loss − fp32 loss")
    ax0.set_title(f"each policy's loss minus the fp32 run's (fp32: {reference[0]:.3f} → {reference[-1]:.3f})", fontsize=9)
    ax0.legend(fontsize=7)
    plot_breakdown({name.replace(" + ", "\n"): row["memory"] for name, row in table.items()}, ax=ax1, unit="KiB",
                   title="memory by category at rank 0's peak, second step")
    ax1.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return fig


def print_policy_ratios(table: dict) -> None:
    """Print what bf16 halves and what float32 accumulation doubles, as ratios between the lab's
    four policies (named as in the lab): gathered parameters, all-gather and reduce-scatter bytes,
    the accumulation buffer. Raises KeyError if a policy or a collective is missing."""
    def highest(policy, category):
        return table[policy]["highest"].get(category, 0)

    def wire(policy, collective):
        return table[policy]["wire"][collective]

    fp32, bf16 = "fp32", "bf16 params + fp32 reduce"
    acc32, acc16 = "bf16 comm + fp32 accumulation", "bf16 params + bf16 reduce"
    print(f"gathered params, bf16 / fp32 compute: "
          f"{highest(bf16, 'unsharded_params') / highest(fp32, 'unsharded_params'):.2f}; "
          f"all-gather bytes: {wire(bf16, 'all_gather') / wire(fp32, 'all_gather'):.2f}; "
          f"reduce-scatter bytes, bf16 / fp32 wire: {wire(acc16, 'reduce_scatter') / wire(bf16, 'reduce_scatter'):.2f}; "
          f"acc.grad column, fp32 / bf16 accumulation: "
          f"{highest(acc32, 'unsharded_grads') / highest(acc16, 'unsharded_grads'):.2f}")


def print_policy_losses(table: dict, gap: dict) -> None:
    """Print each policy's first and last loss (the header names the last step, the length of the
    longest loss list) and its largest distance from the reference (``gap``: {policy: largest
    |loss - fp32 loss|}; the reference has no entry). Raises KeyError for a row without "losses"."""
    # ≈: bf16/fp16 digits that depend on the CPU's matrix kernels (oneDNN's AMX or AVX-512 BF16 where
    # the CPU has them, PyTorch's own elsewhere); labs/nbval_sanitize.cfg leaves them out of the comparison
    last_step = f"loss@{max(len(row['losses']) for row in table.values())}"
    print(f"{'policy':>30} | {'loss@1':>7} {last_step:>7} | largest |loss - fp32 loss|")
    for name, row in table.items():
        first, last = row["losses"][0], row["losses"][-1]
        print(f"{name:>30} | {'≈%.4f' % first:>7} {'≈%.4f' % last:>7} | "
              + (f"≈{gap[name]:.2e}" if name in gap else "(the reference)"))


def plot_optim_mode_bug(bug: dict):
    """Left: the loss per step of the single process, the fixed and the buggy reduction; right:
    buggy minus fixed. ``bug``: {"single process" | "fixed" | "buggy": [loss per step]}. Returns
    the Figure. Raises KeyError if one of the three runs is missing."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.4))
    steps = range(1, len(bug["fixed"]) + 1)
    for name, style in [("single process", dict(color="black", lw=2.5, alpha=0.35)),
                        ("fixed", dict(color="#4C72B0", lw=1.2)), ("buggy", dict(color="#C44E52", lw=1.2))]:
        ax0.plot(steps, bug[name], label=name, **style)
    ax0.set_xlabel("step"); ax0.set_ylabel("loss (mean over ranks)"); ax0.legend(fontsize=8)
    ax0.set_title("ZeRO-1 on 2 ranks, reduced the way Megatron-FSDP's optim mode did")
    ax1.plot(steps, [b - f for b, f in zip(bug["buggy"], bug["fixed"])], color="#C44E52")
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_xlabel("step"); ax1.set_ylabel("buggy loss − fixed loss")
    ax1.set_title("the cost of counting each rank's own gradient twice")
    fig.tight_layout()
    return fig


def print_optim_mode_bug(bug: dict) -> None:
    """Print the losses of the three runs at a few steps, the largest distance of the fixed run from
    the single process, the step where the buggy run leaves the fixed one, and their mean loss over
    the last 10 steps. ``bug``: {"single process" | "fixed" | "buggy": [loss per step]}, at least
    30 steps. Raises StopIteration if the buggy and fixed runs never differ by more than 1e-4."""
    steps = len(bug["fixed"])
    print(f"{'step':>5} | {'single process':>14} {'fixed (copy)':>12} {'buggy (add)':>11}")
    for step in (1, 10, 20, 30, steps):
        print(f"{step:5d} | {bug['single process'][step - 1]:14.4f} {bug['fixed'][step - 1]:12.4f} {bug['buggy'][step - 1]:11.4f}")
    fixed_gap = max(abs(a - b) for a, b in zip(bug["fixed"], bug["single process"]))
    print(f"fixed vs single process: largest difference {'below 1e-5' if fixed_gap < 1e-5 else f'{fixed_gap:.1e}'} "
          "(float32 round-off)")
    first = next(i + 1 for i, (b, f) in enumerate(zip(bug["buggy"], bug["fixed"])) if abs(b - f) > 1e-4)
    tail_buggy, tail_fixed = sum(bug["buggy"][-10:]) / 10, sum(bug["fixed"][-10:]) / 10
    print(f"buggy leaves the fixed run at step {first}; mean loss over the last 10 steps: buggy {tail_buggy:.4f}, "
          f"fixed {tail_fixed:.4f} ({'higher' if tail_buggy > tail_fixed else 'lower'} with the bug); buggy above fixed on "
          f"{sum(b > f for b, f in zip(bug['buggy'][1:], bug['fixed'][1:]))} of {steps - 1} steps after the first")

def draw_policy_run(run: dict):
    """(Figure, text) of one policy's run: its loss curve and its memory at rank 0's peak (KiB);
    the text gives the bytes per collective per step, the first and last loss, and, under loss
    scaling, the final scale and the steps skipped. ``run``: the dict ``train_and_measure``
    returns ("losses", "memory", "wire", "scale", "skipped"). Raises KeyError if one is missing,
    ValueError (from ``plot_breakdown``) for an unknown memory category."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    steps = len(run["losses"])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.4))
    ax0.plot(range(1, steps + 1), run["losses"], color="#4C72B0")
    ax0.set_xlabel("step"); ax0.set_ylabel("loss"); ax0.set_title("loss")
    plot_breakdown({"this policy": run["memory"]}, ax=ax1, unit="KiB", title="memory at rank 0's peak")
    fig.tight_layout()
    wire = ", ".join(f"{k} {v:,d} B" for k, v in run["wire"].items())
    scaling = (f" | loss scale {run['scale']:g}, {run['skipped']} of {steps} steps skipped"
               if run["scale"] is not None else "")
    return fig, f"per step on rank 0: {wire} | loss ≈{run['losses'][0]:#.3g} -> ≈{run['losses'][-1]:#.3g}{scaling}"
