"""Checkers for lab 01 (collectives).

* ``check_my_all_reduce(my_all_reduce)``: an all-reduce built from a reduce-scatter and an
  all-gather, recorded through ``fsdp_lab.collectives`` and sending what a ring all-reduce
  sends. Reference: ``collectives.all_reduce`` on the same inputs, on the same ranks.
* ``check_my_reduce_scatter(my_reduce_scatter)``: a reduce-scatter built from an all-reduce
  of a copy of ``t``: any collective but ``collectives.all_reduce`` and any change to ``t`` are
  mistakes. Reference: ``collectives.reduce_scatter_tensor``; the verdict also prices the
  answer's bytes on the wire (from its timeline) against a real reduce-scatter's.

An answer right on the 4 ranks is run once more on 2 ranks with 5 elements a chunk: one that fixes
the world size (``t.numel() // 4``) or the chunk size is a mistake.
"""

from __future__ import annotations

import torch

from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from fsdp_lab.workshop.measure import wire_bytes
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, answer_timeline, checker, correct, error_line, is_placeholder,
                                        mistake, not_waited, placeholder_left)

WORLD = 4
ELEMENTS_PER_RANK = 3  # each rank's chunk; the full tensor has WORLD * ELEMENTS_PER_RANK
SMALL_WORLD, SMALL_PER_RANK = 2, 5  # the second run of a right answer: another world and chunk size


def _rank_input(rank: int, numel: int = WORLD * ELEMENTS_PER_RANK) -> torch.Tensor:
    """Rank ``rank``'s full-size input: distinct small integers, exact in float32, with a seeded
    random term so that no rank's input is a linear function of the rank (sums of other slices
    than the right ones then never match a chunk by chance)."""
    noise = torch.randint(0, 50, (numel,), generator=torch.Generator().manual_seed(rank))
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 100.0 * rank + noise.float()


def _run(answer, which: str, per_rank: int = ELEMENTS_PER_RANK):
    import torch.distributed as dist

    from fsdp_lab import collectives

    rank = dist.get_rank()
    given = _rank_input(rank, dist.get_world_size() * per_rank)
    t = given.clone()
    with answer_timeline() as tl:
        result = answer(t)
    reference = given.clone()
    if which == "all_reduce":
        collectives.all_reduce(reference)
    else:
        reference = torch.empty(per_rank)
        collectives.reduce_scatter_tensor(reference, given.clone())
    if isinstance(result, torch.Tensor):
        result = result.detach().clone()
    return {"result": result, "t": t, "reference": reference,
            "comm": [(e.name, e.bytes) for e in tl.comm_events()], "wire": wire_bytes(tl.comm_events()),
            "unwaited": tl.unwaited}


def _same(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def _other_world(answer, which: str):
    """None if ``answer``, right on WORLD ranks, is also right on SMALL_WORLD ranks with
    SMALL_PER_RANK elements a chunk; else the mistake "fixed_world_size"."""
    numel = SMALL_WORLD * SMALL_PER_RANK
    try:
        out = launch(_run, answer, which, SMALL_PER_RANK, world_size=SMALL_WORLD, timeout=CHECK_TIMEOUT)
    except LaunchTimeout:  # a LaunchError too: caught first
        what = "the ranks hung in their collectives"
    except LaunchError as error:
        what = f"a rank raised {error_line(error)}"
    else:
        wrong = [rank for rank, o in enumerate(out) if not _same(o["result"], o["reference"])
                 or (which == "all_reduce" and not _same(o["t"], o["reference"]))]
        if not wrong:
            return None
        rank, o = wrong[0], out[wrong[0]]
        result = o["result"] if which == "reduce_scatter" or not _same(o["result"], o["reference"]) else o["t"]
        if isinstance(result, torch.Tensor) and result.numel() != o["reference"].numel():
            what = f"rank {rank} returned {result.numel()} elements where a chunk has {SMALL_PER_RANK}"
            if which == "all_reduce":
                what = f"rank {rank} returned {result.numel()} elements of {numel}"
        else:
            what = f"rank {rank} got {_show(result)}, expected {_show(o['reference'])}"
    return mistake("fixed_world_size", f"right on {WORLD} ranks, but not on {SMALL_WORLD} ranks with "
                                       f"{numel} elements ({what}): the chunk size must come from "
                                       "the tensor and the world the function runs on, not from "
                                       f"this check's {WORLD} ranks",
                   "k = t.numel() // dist.get_world_size(): no fixed 4 (or 3) in the code")


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
    unwaited = not_waited([o["unwaited"] for o in out])
    if unwaited:
        return unwaited
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
        fixed = _other_world(my_all_reduce, "all_reduce")
        if fixed is not None:
            return fixed
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
    unwaited = not_waited([o["unwaited"] for o in out])
    if unwaited:
        return unwaited
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
        fixed = _other_world(my_reduce_scatter, "reduce_scatter")
        if fixed is not None:
            return fixed
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
    k = ELEMENTS_PER_RANK
    if all(r.numel() == WORLD * k for r in results):
        return mistake("whole_sum", "every rank returned the whole sum; keep only this rank's "
                                    "chunk")
    # each rank all-reduced only its own slice: all get the sum of rank s's slice s over s
    own_slices = sum(_rank_input(r)[r * k:(r + 1) * k] for r in range(WORLD))
    if all(_same(r, own_slices) for r in results):
        return mistake("reduced_own_slice", f"you all-reduced only your slice: every rank passed "
                                            f"its own {k} elements t[rank·k:(rank+1)·k], and an "
                                            "all-reduce adds element i of every rank's tensor, so "
                                            "each chunk was added to other ranks' chunks; all "
                                            "ranks got the same wrong sum",
                       "all-reduce a copy of the whole tensor (every rank passes the same "
                       "positions), then slice this rank's chunk out of the sum")
    sized = [rank for rank, r in enumerate(results) if r.numel() != k]
    # full-size chunks that are other ranks' explain a shifted slice, whatever the other sizes
    shifted = [(rank, [o for o in range(WORLD) if o != rank and _same(r, expected[o])])
               for rank, r in enumerate(results) if r.numel() == k and not _same(r, expected[rank])]
    if shifted and all(other for _, other in shifted):
        (rank, other), sizes = shifted[0], ""
        if sized:
            sizes = f" (and rank {sized[0]} returned {results[sized[0]].numel()} elements)"
        return mistake("wrong_chunk", f"rank {rank} returned the chunk of rank {other[0]}{sizes}; "
                                      f"rank r keeps elements [r·k, (r+1)·k)",
                       "slice the all-reduced copy with the rank: total[rank * k:(rank + 1) * k]")
    if sized:
        return mistake("wrong_size", f"rank {sized[0]} returned {results[sized[0]].numel()} "
                                     f"elements; a chunk has t.numel() // world = {k}")
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
