"""Checkers for lab 01 (collectives).

* ``check_my_all_reduce(my_all_reduce)``: an all-reduce built from a reduce-scatter and an
  all-gather, recorded through ``fsdp_lab.collectives`` and sending what a ring all-reduce
  sends. Reference: ``collectives.all_reduce`` on the same inputs, on the same ranks.
* ``check_my_reduce_scatter(my_reduce_scatter)``: a reduce-scatter built from an all-reduce
  of a copy of ``t``: any collective but ``collectives.all_reduce`` and any change to ``t`` are
  mistakes. Reference: ``collectives.reduce_scatter_tensor``; the verdict also prices the
  answer's bytes on the wire (from its timeline) against a real reduce-scatter's.
"""

from __future__ import annotations

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.measure import wire_bytes
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, checker, correct, is_placeholder, mistake,
                                        placeholder_left)

WORLD = 4
ELEMENTS_PER_RANK = 3  # each rank's chunk; the full tensor has WORLD * ELEMENTS_PER_RANK


def _rank_input(rank: int) -> torch.Tensor:
    """Rank ``rank``'s full-size input: distinct small integers, exact in float32."""
    return torch.arange(WORLD * ELEMENTS_PER_RANK, dtype=torch.float32) * (rank + 1) + 100.0 * rank


def _run(answer, which: str):
    import torch.distributed as dist

    from fsdp_lab import collectives
    from fsdp_lab.timeline import Timeline

    rank = dist.get_rank()
    given = _rank_input(rank)
    t = given.clone()
    with Timeline() as tl:
        result = answer(t)
    reference = given.clone()
    if which == "all_reduce":
        collectives.all_reduce(reference)
    else:
        reference = torch.empty(ELEMENTS_PER_RANK)
        collectives.reduce_scatter_tensor(reference, given.clone())
    if isinstance(result, torch.Tensor):
        result = result.detach().clone()
    return {"result": result, "t": t, "reference": reference,
            "comm": [(e.name, e.bytes) for e in tl.comm_events()], "wire": wire_bytes(tl.comm_events())}


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def _used(out) -> str:
    names = [name for name, _ in out[0]["comm"]]
    return ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names)) or "no collective"


@checker("my_all_reduce", hint="reduce-scatter t into a shard of t.numel() // world elements "
                                "(each rank then holds the sum of its chunk), then all-gather the "
                                "shards back into t")
def check_my_all_reduce(my_all_reduce):
    """Run ``my_all_reduce(t)`` on 4 ranks and compare with ``collectives.all_reduce``.

    Only ``collectives.reduce_scatter_tensor`` and ``collectives.all_gather_into_tensor`` may
    run, both must, and together they must send what a ring all-reduce of ``t`` sends per rank:
    an answer that sums through ``torch.distributed`` directly (not recorded) or all-gathers whole
    tensors and sums them locally gets the right values but is a mistake.
    """
    out = launch(_run, my_all_reduce, "all_reduce", world_size=WORLD, timeout=CHECK_TIMEOUT)
    if any(is_placeholder(o["result"]) for o in out):
        return placeholder_left("my_all_reduce")
    names = {name for o in out for name, _ in o["comm"]}
    if "all_reduce" in names:
        return mistake("used_all_reduce", f"your function called all_reduce ({_used(out)}); build "
                                          "it from reduce_scatter_tensor and all_gather_into_tensor")
    if not names:
        return mistake("no_collective", "no collectives.reduce_scatter_tensor or "
                                        "collectives.all_gather_into_tensor was recorded "
                                        "(torch.distributed's own calls are not seen), so the "
                                        "exercise's two collectives were not used")
    if names - {"reduce_scatter", "all_gather"}:
        return mistake("used_other_collective", f"your function called {_used(out)}; build it "
                                                "from reduce_scatter_tensor and "
                                                "all_gather_into_tensor alone")
    summed = all(_same(o["t"], o["reference"]) for o in out)
    if summed and all(o["result"] is None for o in out):
        return mistake("returned_none", "t holds the sum, but your function returned None",
                       "end the function with return t")
    size = WORLD * ELEMENTS_PER_RANK * 4
    ring = round(2 * (WORLD - 1) / WORLD * size)  # bytes per rank of a ring all-reduce of t
    wire = out[0]["wire"]
    if summed and all(_same(o["result"], o["reference"]) for o in out):
        if "reduce_scatter" not in names:
            return mistake("no_reduce_scatter", f"t holds the sum, but without a reduce-scatter: "
                                                f"{_used(out)} sent {wire} bytes per rank where a "
                                                f"ring all-reduce of {size} bytes sends {ring}; "
                                                "summing locally what was gathered whole moves "
                                                "every rank's full tensor")
        if wire != ring:
            why = ("part of the sum went through calls that are not recorded (torch.distributed's "
                   "own)" if wire < ring else "a reduce-scatter and an all-gather of t, once each, "
                   "are all an all-reduce needs")
            return mistake("wire_bytes", f"t holds the sum, but {_used(out)} sent {wire} bytes per "
                                         f"rank where a ring all-reduce of {size} bytes sends "
                                         f"{ring}: {why}")
        rs, ag = ([b for name, b in out[0]["comm"] if name == which]
                  for which in ("reduce_scatter", "all_gather"))
        if len(rs) == len(ag) == 1:
            moved = f"a reduce-scatter and an all-gather of {rs[0]} bytes each"
        else:
            moved = (f"{sum(rs)} bytes in {len(rs)} reduce-scatter{'s' * (len(rs) > 1)} and "
                     f"{sum(ag)} in {len(ag)} all-gather{'s' * (len(ag) > 1)}")
        return correct(f"on {WORLD} ranks t holds the sum, as with all_reduce; you moved {moved}, "
                       f"{wire} bytes sent per rank: what a ring all-reduce of that size sends, "
                       "because a ring all-reduce is exactly these two steps")
    first = out[0]
    if all(_same(o["result"], o["reference"]) for o in out):
        return mistake("not_in_place", "the sum is returned but t itself was not changed; "
                                       "all-gather into t, then return t")
    if all(_same(o["result"], o["reference"] / WORLD) or _same(o["t"], o["reference"] / WORLD)
           for o in out):
        return mistake("averaged", f"t holds the average, the sum divided by {WORLD}: an "
                                   "all-reduce sums (use op='sum', the default)")
    if isinstance(first["result"], torch.Tensor) and first["result"].numel() == ELEMENTS_PER_RANK:
        return mistake("returned_shard", "your function returned one rank's chunk; the shards "
                                         "must be all-gathered back into the whole tensor")
    if "all_gather" not in names:
        return mistake("no_all_gather", "each rank holds only its own chunk of the sum; "
                                        "all-gather the shards back into t")
    return mistake("wrong_values", f"rank 0 got {_show(first['t'])}, expected "
                                   f"{_show(first['reference'])} (collectives used: {_used(out)})")


@checker("my_reduce_scatter", hint="all-reduce a copy of t (every rank gets the whole sum), then "
                                    "return this rank's chunk: elements [rank·k, (rank+1)·k) with "
                                    "k = t.numel() // world")
def check_my_reduce_scatter(my_reduce_scatter):
    """Run ``my_reduce_scatter(t)`` on 4 ranks; require ``collectives.all_reduce`` as its only
    collective and ``t`` unchanged; compare each rank's chunk with
    ``collectives.reduce_scatter_tensor`` and its bytes on the wire with a real one's."""
    out = launch(_run, my_reduce_scatter, "reduce_scatter", world_size=WORLD, timeout=CHECK_TIMEOUT)
    if any(is_placeholder(o["result"]) for o in out):
        return placeholder_left("my_reduce_scatter")
    names = {name for o in out for name, _ in o["comm"]}
    if names - {"all_reduce"}:
        return mistake("used_other_collective", f"your function called {_used(out)}; build the "
                                                "reduce-scatter from collectives.all_reduce alone",
                       "all-reduce a copy of t (total = t.clone(); collectives.all_reduce(total)), "
                       "then return this rank's chunk of total")
    if not names:
        return mistake("no_all_reduce", "no collectives.all_reduce was recorded (torch.distributed's "
                                        "own calls are not seen), so nothing was summed through "
                                        "fsdp_lab and its cost cannot be priced",
                       "all-reduce a copy of t with collectives.all_reduce, then return this "
                       "rank's chunk of it")
    changed = [rank for rank, o in enumerate(out) if not torch.equal(o["t"], _rank_input(rank))]
    if changed:
        return mistake("changed_t", f"your function changed its input t (on rank {changed[0]}, "
                                    f"t now holds {_show(out[changed[0]]['t'])}); the caller's t "
                                    "must be left alone",
                       "all-reduce a copy: total = t.clone(); collectives.all_reduce(total); "
                       "then slice total, not t")
    if all(_same(o["result"], o["reference"]) for o in out):
        size = WORLD * ELEMENTS_PER_RANK * 4
        real = round(size * (WORLD - 1) / WORLD)
        return correct(f"every rank holds its chunk of the sum, as with reduce_scatter_tensor; "
                       f"but your all-reduce sent {out[0]['wire']} bytes per rank where a real "
                       f"reduce-scatter of {size} bytes sends {real}: "
                       f"{out[0]['wire'] / real:g}x the traffic, which is what gloo's own "
                       "reduce-scatter pays (it all-reduces the whole buffer)")
    expected = [o["reference"] for o in out]  # rank r's chunk of the sum
    results = [o["result"] for o in out]
    if not all(isinstance(r, torch.Tensor) for r in results):
        return mistake("not_a_tensor", "return this rank's chunk as a tensor")
    if any(r.numel() != ELEMENTS_PER_RANK for r in results):
        if all(r.numel() == WORLD * ELEMENTS_PER_RANK for r in results):
            return mistake("whole_sum", "every rank returned the whole sum; keep only this rank's "
                                        "chunk")
        return mistake("wrong_size", f"rank 0 returned {results[0].numel()} elements; a chunk has "
                                     f"t.numel() // world = {ELEMENTS_PER_RANK}")
    for rank, result in enumerate(results):
        if _same(result, expected[rank]):
            continue
        other = [r for r in range(WORLD) if _same(result, expected[r])]
        if other:
            return mistake("wrong_chunk", f"rank {rank} returned the chunk of rank {other[0]}; "
                                          f"rank r keeps elements [r·k, (r+1)·k)",
                           "slice the all-reduced copy with the rank: total[rank * k:(rank + 1) * k]")
        if _same(result, expected[rank] / WORLD):
            return mistake("averaged", f"rank {rank} holds the average of its chunk, the sum "
                                       f"divided by {WORLD}: a reduce-scatter sums")
        own = _rank_input(rank)[rank * ELEMENTS_PER_RANK:(rank + 1) * ELEMENTS_PER_RANK]
        if _same(result, own):
            return mistake("not_reduced", f"rank {rank} returned its own input's chunk: nothing "
                                          "was summed over the ranks")
        return mistake("wrong_values", f"rank {rank} returned {_show(result)}, expected "
                                       f"{_show(expected[rank])}")
    return mistake("wrong_values", "the chunks differ from reduce_scatter_tensor's")


def _show(t) -> str:
    return str([round(x, 3) for x in t.tolist()]) if isinstance(t, torch.Tensor) else repr(t)
