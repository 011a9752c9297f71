"""Checkers for lab 06 (mixed precision).

* ``check_reduce_grad_shard(reduce_grad_shard)``: the gradient reduction of a ZeRO-1 /
  Megatron-FSDP ``optim``-mode step: each rank's whole float32 gradient, sent in the wire dtype,
  reduce-scattered, this rank's shard of the mean returned in float32. Reference: the mean of
  all ranks' gradients computed on one process in float32 (and, for a bf16 wire, the same sum
  done in bf16 on one process, which is what gloo does).
* ``check_unscale_and_check(unscale_and_check)``: the loss-scaling step under sharding: unscale
  this rank's gradient shards and agree across ranks whether any is inf/NaN. Reference:
  ``torch.amp.GradScaler`` stepping the whole (unsharded) gradient on one process.
"""

from __future__ import annotations

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import CHECK_TIMEOUT, checker, correct, is_placeholder, mistake, placeholder_left

WORLD = 2
NUMEL = 8  # a whole gradient; each rank's shard is NUMEL // WORLD elements
WIRES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rank_gradient(rank: int) -> torch.Tensor:
    """Rank ``rank``'s whole float32 gradient in the checks: values that bf16 cannot hold exactly."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def _run_reduce(answer):
    import torch.distributed as dist

    from fsdp_lab.timeline import Timeline

    rank = dist.get_rank()
    out = {}
    for name, wire in WIRES.items():
        local = rank_gradient(rank)
        with Timeline() as tl:
            result = answer(local, wire)
        if isinstance(result, torch.Tensor):
            result = result.detach().clone()
        out[name] = {"result": result,
                     "comm": [(e.name, e.bytes, e.args.get("dtype")) for e in tl.comm_events()]}
    return out


def _close(a, b, atol=1e-6) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == torch.float32
            and torch.allclose(a, b, rtol=0, atol=atol))


@checker("reduce_grad_shard", hint="cast local_grad to wire_dtype, reduce-scatter it (sum over ranks) into "
                                   "a wire_dtype tensor of local_grad.numel() // world elements, then return "
                                   "that shard in float32 divided by the world size")
def check_reduce_grad_shard(reduce_grad_shard):
    """Run ``reduce_grad_shard(local_grad, wire_dtype)`` on 2 ranks with a float32 and a bf16 wire
    and compare each rank's result with the mean gradient computed on one process."""
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
    if not names:
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
    wire_dtypes = {d for o in bf16 for _, _, d in o["comm"]}
    if wire_dtypes != {"bfloat16"}:
        return mistake("wire_not_bf16", f"asked for a bf16 wire, your collectives sent {sorted(wire_dtypes)}: "
                                        "the bytes on the wire are not halved",
                       hint="cast local_grad to wire_dtype before the reduce-scatter")
    summed_in_bf16 = (torch.stack([g.to(torch.bfloat16) for g in grads]).sum(0)).float() / WORLD
    if not all(_close(o["result"], summed_in_bf16.chunk(WORLD)[r], atol=0) for r, o in enumerate(bf16)):
        return mistake("wrong_values_bf16", "with a bf16 wire your shards differ from the sum of the ranks' "
                                            "bf16 gradients (done on one process)")
    sent = {w: sum(b for name, b, _ in out[0][w]["comm"]) for w in WIRES}
    if "all_reduce" in names:
        return mistake("used_all_reduce", f"the values are right but you all-reduced: every rank received "
                                          f"the whole gradient ({sent['float32']} bytes per call) to keep a "
                                          "1/N shard of it", hint="reduce_scatter_tensor gives each rank only "
                                                                  "its shard")
    error = (summed_in_bf16 - total / WORLD).abs().max().item()
    return correct(f"on {WORLD} ranks each shard is the mean gradient; the bf16 wire moved {sent['bfloat16']} "
                   f"bytes per reduce-scatter instead of {sent['float32']}, and because the sum across ranks "
                   f"ran in bf16 the shard is off the float32 mean by up to {error:.1e}: float32 accumulation "
                   "afterwards cannot remove that rounding")


# ----------------------------------------------------------------------------- loss scaling

SCALE = 1024.0
CASES = {"inf on rank 1": (1, float("inf")), "nan on rank 0": (0, float("nan")), "no overflow": (None, None)}


def rank_shards(rank: int, case: str) -> list[torch.Tensor]:
    """Rank ``rank``'s scaled gradient shards (two tensors) in ``case``."""
    gen = torch.Generator().manual_seed(7 + rank)
    shards = [torch.randn(3, generator=gen) * SCALE, torch.randn(2, generator=gen) * SCALE]
    bad_rank, value = CASES[case]
    if rank == bad_rank:
        shards[1][0] = value
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
    """Run ``unscale_and_check(shards, scale)`` on 2 ranks for an inf on rank 1, a NaN on rank 0 and
    no overflow; compare with torch.amp.GradScaler on the whole gradient on one process."""
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
                                         "skip and the replicas drift apart",
                           hint="all-reduce the flag (op='max') so every rank decides the same")
    if verdicts["inf on rank 1"][0] and not verdicts["nan on rank 0"][0]:
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
    if all(_same_shards(c, [t * SCALE * SCALE for t in s]) for c, s in zip(clean, scaled)):
        return mistake("multiplied_by_scale", "the shards were multiplied by the scale instead of divided")
    for case, (_, unscaled) in references.items():
        if not all(_same_shards(o[case]["shards"], unscaled[r]) for r, o in enumerate(out)):
            return mistake("wrong_unscale", f"with {case} your shards differ from what GradScaler.unscale_ "
                                            "leaves (divide in place, also when an overflow was found)")
    return correct(f"every rank skips the two steps with an overflow (an inf on rank 1, a NaN on rank 0) and "
                   f"steps the clean one, as torch.amp.GradScaler decides on the whole gradient; the shards are "
                   f"divided by {SCALE:.0f}. One all-reduce of one element per step keeps the ranks agreeing")
