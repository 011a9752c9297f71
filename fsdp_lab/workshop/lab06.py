"""Checkers for lab 06 (mixed precision).

* ``check_reduce_grad_shard(reduce_grad_shard)``: the gradient reduction of a ZeRO-1 /
  Megatron-FSDP ``optim``-mode step: each rank's whole float32 gradient, sent in the wire dtype,
  reduce-scattered, this rank's shard of the mean returned in float32. Reference: the mean of
  all ranks' gradients computed on one process in float32 (and, for a bf16 wire, the same sum
  done in bf16 on one process, which is what gloo does).
* ``check_unscale_and_check(unscale_and_check)``: the loss-scaling step under sharding: unscale
  this rank's gradient shards and agree across ranks whether any is inf/NaN. Reference:
  ``torch.amp.GradScaler`` stepping the whole (unsharded) gradient on one process.

The training loop of section 4 and of the explorer, and its measurement, run here as well
(``train_and_measure``); the notebook keeps the policies, the sharded models they train and the
other runs. The lab's figures and tables are drawn in ``lab06_figures`` and re-exported here
(``draw_gradient_life``, ``print_policy_memory``, ``plot_policies``, ``print_policy_ratios``,
``print_policy_losses``, ``print_optim_mode_bug``, ``plot_optim_mode_bug``, ``draw_policy_run``),
so the notebook calls every helper as ``lab06.<name>``.
"""

from __future__ import annotations

import torch

from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, checker, collective_calls, correct, error_line, is_placeholder,
                                        mistake, not_waited, placeholder_left)
from fsdp_lab.workshop.lab06_figures import (DTYPE_COLORS, MEMORY_COLUMNS, draw_gradient_life, draw_policy_run,
                                             dtype_name, plot_optim_mode_bug, plot_policies, print_optim_mode_bug,
                                             print_policy_losses, print_policy_memory, print_policy_ratios)

__all__ = ["check_reduce_grad_shard", "check_unscale_and_check", "train_and_measure", "rank_gradient",
           "rank_shards", "WORLD", "NUMEL", "OTHER_WORLD", "SCALE", "CASES",
           # re-exported from lab06_figures, for the notebook's lab06.<name>
           "DTYPE_COLORS", "MEMORY_COLUMNS", "draw_gradient_life", "draw_policy_run", "dtype_name",
           "plot_optim_mode_bug", "plot_policies", "print_optim_mode_bug", "print_policy_losses",
           "print_policy_memory", "print_policy_ratios"]

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
        return mistake("fixed_world", f"on {WORLD} ranks your shards are right, but {where} your code raised "
                                      f"{error_line(error)}: it assumes {WORLD} ranks somewhere", hint=hint)
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
    if any(res.shape != (k,) for res in results) and all(
            res.numel() == k and _close(res.reshape(k), mean_shards[r]) for r, res in enumerate(results)):
        shape = next(tuple(res.shape) for res in results if res.shape != (k,))
        return mistake("wrong_shape", f"the values are the mean gradient's, but the shard has shape {shape}: "
                                      f"a shard is 1-D, ({k},), the shape reduce_scatter_tensor's output has",
                       hint="make the output torch.empty(local_grad.numel() // world, dtype=wire_dtype), "
                            "and return it without a view")
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
        with collective_calls() as calls:
            found = answer(shards, SCALE)
        out[case] = {"found": found, "shards": [s.clone() for s in shards],
                     "comm": [(c.name, c.bytes) for c in calls], "unwaited": calls.unwaited}
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
    unwaited = not_waited([o[c]["unwaited"] for o in out for c in CASES])
    if unwaited:
        return unwaited
    for o in out:
        for case in CASES:
            found = o[case]["found"]
            found = found.item() if type(found).__module__ == "numpy" else found  # numpy's bool
            if not isinstance(found, (bool, int)) or found not in (0, 1):
                shown = (f"a tensor ({found.dtype}, {found.numel()} element{'s' * (found.numel() != 1)})"
                         if isinstance(found, torch.Tensor) else repr(found))
                return mistake("not_a_bool", f"with {case} your function returned {shown}: return True or "
                                             "False, which the caller's `if` reads the same on every rank",
                               hint="return bool(flag.item()) after the all-reduce (op='max' keeps it 0 or 1)")
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
    calls = out[0]["no overflow"]["comm"]
    if len(calls) > 1:
        used = ", ".join(f"{name} of {nbytes} B" for name, nbytes in calls)
        return mistake("several_collectives", f"right flags, but {len(calls)} collectives per call ({used}): one "
                                              "all-reduce of one flag for all the shards decides the step, and "
                                              "every extra collective is one more wait per step",
                       hint="raise one flag over every shard in a loop, then all-reduce it once (op='max')")
    sent = f"one {calls[0][0].replace('_', '-')} of {calls[0][1]} bytes" if calls else "one collective"
    return correct(f"every rank skips the three steps with an overflow (an inf in either shard of either rank, "
                   f"a NaN) and steps the clean one, as torch.amp.GradScaler decides on the whole gradient; the shards are "
                   f"divided by {SCALE:.0f}. {sent[0].upper() + sent[1:]} per step keeps the ranks agreeing")


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

