"""Checkers for lab 04 (FSDP1, flat parameters).

* ``check_rank_shard(rank_shard, real_shards=None)``: ``rank_shard(params, world, rank)``
  returns the 1-D slice of a unit's flat parameter that ``rank`` keeps: the parameters
  flattened end to end, zero-padded to a multiple of ``world``, cut into ``world`` equal
  pieces. Reference: fsdp_lab's FSDP1 arithmetic (``fsdp1.layout.padded_numel`` and
  ``shard_boundaries``) on many shapes, and, when given, the shards real FSDP1 ranks hold
  (``real_shards``: {rank: tensor} of one unit on ``len(real_shards)`` ranks, with the
  parameters it was built from).
* ``check_reduce_flat_grad(reduce_flat_grad)``: the post-backward step of an FSDP1 unit:
  ``reduce_flat_grad(flat_grad)`` gets this rank's whole padded flat gradient and returns
  this rank's shard of the average over ranks. Reference: fsdp_lab's FSDP1 (one unit, 2
  ranks), whose sharded gradient after the same backward the answer must equal; the
  collectives the answer issues (recorded with a ``Timeline``) must be reduce-scatters. An
  answer right on 2 ranks runs once more on 3 (a small made-up flat gradient per rank), so a
  world size written into the answer is caught.
* ``world_sizes(strategy)`` and ``explorer_controls()``: the lab's widget offers only the world
  sizes a strategy runs on (HYBRID_SHARD needs a world fsdp_lab can split in groups).

The lab's step figure is drawn here too (``draw_step``, memory colours ``COLORS_BESIDE_TIMELINE``),
and section 5's strategy table and peak bars (``print_strategy_table``, ``draw_strategy_peaks``).
"""

from __future__ import annotations

import torch

from fsdp_lab.launch import LaunchError, LaunchTimeout, launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, answer_timeline, checker, correct, error_line, is_placeholder,
                                        mistake, not_waited, placeholder_left, wrong_collectives)

REDUCE_WORLD = 2
OTHER_WORLD = 3    # the second world size ``check_reduce_flat_grad`` runs a right answer on
OTHER_NUMEL = 24   # elements of the made-up flat gradient there (a multiple of OTHER_WORLD)


def reference_shard(params: list[torch.Tensor], world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the flat parameter of ``params``, built from FSDP1's own
    arithmetic (``shard_boundaries``: which elements of each parameter the rank owns)."""
    from fsdp_lab.fsdp1.layout import padded_numel, shard_boundaries

    numels = [p.numel() for p in params]
    shard = padded_numel(sum(numels), world) // world
    owned = [p.detach().reshape(-1)[a:b] for p, (a, b) in zip(params, shard_boundaries(numels, world, rank))]
    flat = torch.cat(owned) if owned else torch.zeros(0)
    return torch.cat([flat, flat.new_zeros(shard - flat.numel())])


def _cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        count = int(torch.randint(1, 6, (1,), generator=gen))
        shapes = [tuple(torch.randint(1, 7, (int(torch.randint(1, 3, (1,), generator=gen)),),
                                      generator=gen).tolist()) for _ in range(count)]
        params = [torch.randn(s, generator=gen) for s in shapes]
        world = int(torch.randint(2, 6, (1,), generator=gen))
        yield params, world


def _diagnose_shard(answer, params, world) -> object | None:
    """A mistake() for the first rank where ``answer`` differs from the reference, else None."""
    total = sum(p.numel() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for rank in range(world):
        expected = reference_shard(params, world, rank)
        try:
            got = answer([p.clone() for p in params], world, rank)
        except IndexError as error:
            shapes = [tuple(p.shape) for p in params]
            if rank < len(torch.chunk(flat, world)):
                return mistake("raised", f"rank {rank} raised IndexError ({error}) for parameters of shapes "
                                         f"{shapes} on {world} ranks; parameters can be 1-D or 3-D as well as 2-D",
                               "p.reshape(-1) flattens a parameter of any shape")
            return mistake("short_chunks", f"rank {rank} raised IndexError ({error}) for {total} elements on {world} "
                                           "ranks: torch.chunk makes pieces of ceil(n / world) elements, so a short "
                                           f"tensor gives fewer than {world} of them and the last ranks none",
                           "pad the flat tensor with zeros to a multiple of world, then slice "
                           "[rank*S:(rank+1)*S]")
        if is_placeholder(got):
            return placeholder_left("rank_shard")
        if not isinstance(got, torch.Tensor):
            return mistake("not_a_tensor", f"rank_shard returned {type(got).__name__}; return a 1-D tensor")
        got = got.detach()
        if got.shape == expected.shape and torch.equal(got, expected):
            continue
        where = f"for {len(params)} parameters of {[p.numel() for p in params]} elements on {world} ranks"
        if got.numel() == total:
            return mistake("whole_flat", f"rank {rank} got all {total} elements {where}: that is the "
                                         "whole flat parameter; keep only this rank's piece")
        if rank == world - 1 and got.numel() < expected.numel() and torch.equal(got, expected[:got.numel()]):
            return mistake("no_padding", f"rank {rank} got {got.numel()} elements {where}, the right "
                                         f"values but {expected.numel() - got.numel()} short: pad the flat "
                                         "tensor with zeros to a multiple of world first, so every shard "
                                         f"has {expected.numel()}")
        floor = total // world
        if got.numel() == floor and floor != expected.numel():
            return mistake("floor_shard", f"rank {rank} got {floor} elements {where}, the total divided "
                                          f"with rounding down; a shard has ceil(total / world) = "
                                          f"{expected.numel()}, the last rank's end made of padding")
        others = [r for r in range(world) if r != rank
                  and torch.equal(got, reference_shard(params, world, r))] if got.shape == expected.shape else []
        if others:
            return mistake("wrong_rank", f"rank {rank} got the piece of rank {others[0]} {where}",
                           "rank r keeps elements [r*S, (r+1)*S) of the padded flat tensor, S = its length / world")
        if got.numel() == expected.numel() and expected.numel() * world > total and \
                torch.equal(got, torch.cat([flat.new_zeros(expected.numel() * world - total), flat])
                            [rank * expected.numel():(rank + 1) * expected.numel()]):
            return mistake("padding_first", f"the zeros sit at the start of the flat tensor {where}; "
                                            "FSDP1 appends the padding after the last parameter")
        real = max(0, min(expected.numel(), total - rank * expected.numel()))  # this piece's values before the padding
        if got.shape == expected.shape and real < expected.numel() and torch.equal(got[:real], expected[:real]):
            fill = got[real:].unique()
            what = f"{fill.item():g}" if fill.numel() == 1 else "values other than 0"
            return mistake("padding_not_zero", f"rank {rank}'s padding holds {what} {where}: the padding must "
                                               "be zeros (torch.zeros or F.pad), so that a padded gradient adds "
                                               "nothing and an all-gather brings back only zeros past the end")
        return mistake("wrong_values", f"rank {rank} got {got.numel()} elements {where} that are not its "
                                       f"piece of the padded flat tensor ({expected.numel()} elements)")
    return None


@checker("rank_shard", hint="flat = torch.cat of every p.reshape(-1); pad with zeros to "
                            "ceil(numel / world) * world; return flat[rank*S:(rank+1)*S]")
def check_rank_shard(rank_shard, real_shards=None, params=None):
    """Compare ``rank_shard`` with FSDP1's arithmetic on 40 random units (1-5 parameters,
    2-5 ranks) and, when ``real_shards`` ({rank: tensor}) and ``params`` are given, with the
    shards real FSDP1 ranks hold for ``params``."""
    for case_params, world in _cases():
        found = _diagnose_shard(rank_shard, case_params, world)
        if found is not None:
            return found
    if real_shards is not None and params is not None:
        world = len(real_shards)
        found = _diagnose_shard(rank_shard, params, world)
        if found is not None:
            return found
        for rank, real in real_shards.items():
            got = rank_shard([p.clone() for p in params], world, rank)
            if not torch.equal(got.detach().to(real.dtype), real):
                return mistake("differs_from_fsdp1", f"rank {rank}'s piece differs from the shard a real "
                                                     "FSDP1 rank holds")
        total = sum(p.numel() for p in params)
        shard = real_shards[0].numel()
        return correct(f"on 40 random units and on the real block: {total:,} elements, padded to "
                       f"{shard * world:,} ({shard * world - total} zeros at the end of the last rank), "
                       f"{shard:,} per rank, the same bytes each of the {world} FSDP1 ranks holds; "
                       "a parameter can begin on one rank and end on the next")
    return correct("on 40 random units (1-5 parameters, 2-5 ranks): the pieces FSDP1's own "
                   "arithmetic gives, padding included")


def _reduce_case(reduce_flat_grad):
    """On each rank: the whole model as one FSDP1 unit, one backward on this rank's half of a
    batch. Returns the answer's shard, FSDP1's sharded gradient, the names of the collectives
    the answer issued, and the pieces to diagnose."""
    import torch.distributed as dist

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = shard_batch(global_batch(512, 4, 16, step=0), rank, world)
    model = FSDP(Llama("cpu", seed=0))
    model(batch).loss.backward()
    (handle,) = model._handles
    layout = handle.layout
    reference = torch.zeros(layout.shard_numel)
    for info, (a, b) in zip(layout.infos, layout.local_slices()):
        if b > a:
            reference[a:b] = info.param.grad.reshape(-1)

    plain = Llama("cpu", seed=0)
    plain(batch).loss.backward()
    grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in plain.named_parameters()}
    local = torch.cat([grads[info.fqn.replace("_fsdp_wrapped_module.", "")].reshape(-1) for info in layout.infos])
    flat_grad = torch.cat([local, local.new_zeros(layout.padded_numel - layout.numel)])
    given = flat_grad.clone()
    with answer_timeline() as timeline:   # records every collective issued through fsdp_lab.collectives
        result = reduce_flat_grad(given)
    if isinstance(result, torch.Tensor):
        result = result.detach().clone()
    return {"result": result, "reference": reference, "local": flat_grad, "rank": rank,
            "collectives": [e.name for e in timeline.comm_events()], "unwaited": timeline.unwaited,
            "shard_numel": layout.shard_numel, "padded_numel": layout.padded_numel}


def _other_flat_grad(rank: int) -> torch.Tensor:
    """Rank ``rank``'s made-up flat gradient for the run on ``OTHER_WORLD`` ranks."""
    return torch.linspace(-1.0, 1.0, OTHER_NUMEL) * (rank + 1) + rank


def _reduce_other_world(reduce_flat_grad):
    """On each rank: ``reduce_flat_grad`` of this rank's made-up flat gradient (a copy)."""
    import torch.distributed as dist

    result = reduce_flat_grad(_other_flat_grad(dist.get_rank()))
    return result.detach().clone() if isinstance(result, torch.Tensor) else result


def _other_world_mistake(reduce_flat_grad):
    """None when ``reduce_flat_grad`` is right on ``OTHER_WORLD`` ranks too, else a mistake()."""
    def fixed_world(what: str):
        return mistake("fixed_world", f"on {REDUCE_WORLD} ranks the shard is right, but on {OTHER_WORLD} ranks "
                                      f"{what}; the answer must hold for any world size",
                       "read the world size with dist.get_world_size(): a shard of flat_grad.numel() // world "
                       "elements, divided by world")

    try:
        out = launch(_reduce_other_world, reduce_flat_grad, world_size=OTHER_WORLD, timeout=CHECK_TIMEOUT)
    except LaunchTimeout:
        raise  # the checker's own verdict for a hang
    except LaunchError as error:
        return fixed_world(f"a rank raised {error_line(error)}")
    mean = sum(_other_flat_grad(r) for r in range(OTHER_WORLD)) / OTHER_WORLD
    size = OTHER_NUMEL // OTHER_WORLD
    for rank, result in enumerate(out):
        want = mean[rank * size:(rank + 1) * size]
        if not isinstance(result, torch.Tensor) or result.shape != want.shape:
            shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            return fixed_world(f"rank {rank} returned {shape} for a {OTHER_NUMEL}-element flat gradient "
                               f"(a shard: ({size},))")
        if not _close(result, want):
            return fixed_world(f"rank {rank}'s shard is not the average over the {OTHER_WORLD} ranks")
    return None


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-7)


@checker("reduce_flat_grad", hint="out = torch.empty(flat_grad.numel() // world); "
                                  "collectives.reduce_scatter_tensor(out, flat_grad); return out / world")
def check_reduce_flat_grad(reduce_flat_grad):
    """Run ``reduce_flat_grad`` on 2 ranks after one backward, compare with the sharded
    gradient fsdp_lab's FSDP1 computes from the same model and data, and require that the
    answer's collectives were reduce-scatters; an answer right there runs once more on
    ``OTHER_WORLD`` ranks, where it must return each rank's shard of the average too."""
    out = launch(_reduce_case, reduce_flat_grad, world_size=REDUCE_WORLD, timeout=CHECK_TIMEOUT)
    if any(is_placeholder(o["result"]) for o in out):
        return placeholder_left("reduce_flat_grad")
    unwaited = not_waited([o["unwaited"] for o in out])
    if unwaited:
        return unwaited
    if not all(isinstance(o["result"], torch.Tensor) for o in out):
        return mistake("not_a_tensor", "return this rank's shard of the averaged gradient as a tensor")
    if all(_close(o["result"], o["reference"]) for o in out):
        wrong = wrong_collectives(out[0]["collectives"], "reduce_scatter", "the shard is right",
                                  "a reduce-scatter gives each rank only its shard and sends (N-1)/N of the flat "
                                  "gradient per rank; an all-reduce gives every rank the whole sum for twice that",
                                  "collectives.reduce_scatter_tensor(shard, flat_grad)")
        if wrong is not None:
            return wrong
        other = _other_world_mistake(reduce_flat_grad)
        if other is not None:
            return other
        shard = out[0]["shard_numel"]
        return correct(f"each rank holds the same {shard:,} averaged gradient values as FSDP1's sharded "
                       f".grad: one reduce-scatter of the {out[0]['padded_numel']:,}-element flat gradient "
                       f"({out[0]['padded_numel'] * 4 / 2**20:.2f} MiB in fp32), then a division by "
                       f"the world size {REDUCE_WORLD}")
    total = [o["reference"] * REDUCE_WORLD for o in out]
    if all(_close(o["result"], t) for o, t in zip(out, total)):
        return mistake("not_averaged", f"each rank holds the sum of the {REDUCE_WORLD} ranks' gradients: "
                                       "the loss is a mean over the whole batch, so divide by the world size")
    if all(_close(o["result"], o["reference"] / REDUCE_WORLD) for o in out):
        return mistake("averaged_twice", f"each rank holds 1/{REDUCE_WORLD} of the averaged gradient: divided "
                                         "by the world size twice (op=\"avg\" already divides)",
                       "either reduce_scatter_tensor(shard, flat_grad, op=\"avg\"), or the default sum and "
                       "then shard / world")
    full = torch.cat([o["reference"] for o in out])
    if all(_close(o["result"], full) for o in out):
        return mistake("whole_gradient", "every rank returned the whole averaged flat gradient (an "
                                         "all-reduce); FSDP1 keeps only this rank's shard")
    if all(_close(o["result"], o["local"][o["rank"] * o["shard_numel"]:(o["rank"] + 1) * o["shard_numel"]])
           for o in out):
        return mistake("not_reduced", "each rank returned its own gradient's piece: nothing was summed "
                                      "over the ranks")
    if all(_close(o["result"], out[1 - o["rank"]]["reference"]) for o in out):
        return mistake("wrong_shard", "each rank holds the other rank's shard",
                       "rank r keeps elements [r*S, (r+1)*S) of the flat gradient")
    shapes = {tuple(o["result"].shape) for o in out}
    if shapes != {(out[0]["shard_numel"],)}:
        return mistake("wrong_size", f"the result has shape {sorted(shapes)[0]}; a shard has "
                                     f"{out[0]['shard_numel']} elements (flat_grad.numel() // world)")
    return mistake("wrong_values", "the shard differs from FSDP1's sharded gradient")


WIDGET_WORLDS = (1, 2, 4)   # world sizes the lab's widget offers


def world_sizes(strategy: str, choices=WIDGET_WORLDS) -> list[int]:
    """The world sizes of ``choices`` that ``strategy`` (a ShardingStrategy name) runs on:
    all of them, but for HYBRID_SHARD only those fsdp_lab can split into >= 2 groups of >= 2
    ranks (``fsdp1.groups.hybrid_shard_size``, which raises ValueError for the others)."""
    from fsdp_lab.fsdp1.groups import hybrid_shard_size

    if strategy != "HYBRID_SHARD":
        return list(choices)
    allowed = []
    for world in choices:
        try:
            hybrid_shard_size(world)
        except ValueError:
            continue
        allowed.append(world)
    return allowed


def explorer_controls() -> dict:
    """The lab widget's controls, by ``render``'s keyword: strategy, wrapping (default "per
    linear") and world size (default 2). Choosing a strategy narrows the world sizes to
    ``world_sizes(strategy)``, keeping the chosen one when it is still allowed, else the
    largest allowed."""
    import ipywidgets as widgets

    strategy = widgets.Dropdown(options=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                                value="FULL_SHARD", description="strategy")
    wrapping = widgets.Dropdown(options=["per block", "whole model", "per linear"], value="per linear",
                                description="wrapping")
    world = widgets.Dropdown(options=list(WIDGET_WORLDS), value=2, description="world size")

    def narrow(change):
        chosen, allowed = world.value, world_sizes(change.new)
        world.options = allowed
        world.value = chosen if chosen in allowed else allowed[-1]

    strategy.observe(narrow, names="value")
    return {"strategy": strategy, "wrapping": wrapping, "world_size": world}


def draw_step(runs, title: str):
    """The figure of one launched FSDP1 step: ``runs`` (one dict per rank, from lab 04's
    ``one_step``: "timeline" and rank 0's "samples" of (moment, gathered MiB per unit, memory by
    category in bytes)) drawn as the merged timeline, a heat map of which units are gathered at
    each moment, and rank 0's memory by category at the same moments (MiB)."""
    import matplotlib.pyplot as plt

    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.memory_plots import COLORS_BESIDE_TIMELINE

    samples = runs[0]["samples"]
    labels = [label for label, _, _ in samples]
    xs = range(len(samples))
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(11, 9.5), gridspec_kw={"height_ratios": [1.2, 1, 1.3]})
    plot_timeline(Timeline.merge([r["timeline"] for r in runs]), ax=a, title=title)
    units_ = list(samples[0][1])
    grid = [[s[1][u] / 2**20 for s in samples] for u in units_]
    most = max((v for row in grid for v in row), default=0.0)
    # vmin 0: the scale starts at nothing gathered (an all-zero grid would get -0.1 to 0.1 MiB)
    im = b.imshow(grid, aspect="auto", cmap="Blues", interpolation="nearest", vmin=0, vmax=most or 1.0)
    b.set_yticks(range(len(units_)), units_, fontsize=7 if len(units_) <= 8 else max(3, 56 // len(units_)))
    b.set_xticks(list(xs), [])
    b.set_title("rank 0: which units are gathered (unsharded parameters, MiB)")
    if not most:  # NO_SHARD, or one rank: every rank holds whole parameters
        b.text(0.5, 0.5, "nothing is gathered: each rank holds every parameter whole", transform=b.transAxes,
               ha="center", va="center", fontsize=10)
    fig.colorbar(im, ax=b, pad=0.01)
    cats = [k for k in COLORS_BESIDE_TIMELINE if any(s[2].get(k, 0) for s in samples)]
    c.stackplot(list(xs), *[[s[2].get(k, 0) / 2**20 for s in samples] for k in cats],
                labels=cats, colors=[COLORS_BESIDE_TIMELINE[k] for k in cats], step="post")
    c.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    c.set_xlim(b.get_xlim())
    c.set_ylabel("MiB"); c.set_xlabel("moment in the step (forward, backward, optimizer)")
    c.set_title("rank 0 memory by category at the same moments")
    c.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# section 5's table and figure: one row or bar per (strategy, wrapping, world size)
STRATEGY_CATEGORIES = {"sharded_params": "sh.par", "unsharded_params": "unsh.par", "sharded_grads": "sh.grad",
                       "unsharded_grads": "unsh.grad", "optimizer_state": "optim", "activations": "activ",
                       "temporaries": "temp", "comm_buffers": "comm", "other": "other"}


def print_strategy_table(table: dict) -> None:
    """Print one row per setting of ``table`` ({setting: {"loss", "comms": {collective: (calls,
    bytes)}, "sent": bytes, "peak": {category: bytes}}}): the loss, the all-gathers, reduce-scatters
    and all-reduces of one step, the MiB sent and rank 0's peak (MiB) by category at its moment.
    Raises KeyError for a row without those fields."""
    cats = STRATEGY_CATEGORIES
    print(f"{'setting':36} {'loss':>7} {'AG':>3} {'RS':>3} {'AR':>3} {'sent':>7} {'peak':>7}   "
          "rank 0 at its peak, MiB: " + " ".join(f"{short:>8}" for short in cats.values()))
    for name, r in table.items():
        c, p = r["comms"], r["peak"]
        print(f"{name:36} {r['loss']:7.4f} {c['all_gather'][0]:3d} {c['reduce_scatter'][0]:3d} "
              f"{c['all_reduce'][0]:3d} {r['sent'] / 2**20:7.3f} {sum(p.values()) / 2**20:7.2f}   "
              + " ".join(f"{p.get(k, 0) / 2**20:8.3f}" for k in cats))


def draw_strategy_peaks(table: dict):
    """Horizontal stacked bars of rank 0's peak (MiB) by category at the moment of the peak, one
    per setting of ``table`` (as ``print_strategy_table`` takes), its total written beside it.
    Returns the Figure."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import COLORS_BESIDE_TIMELINE

    fig, ax = plt.subplots(figsize=(10, 4.2))
    peaks = {n: r["peak"] for n, r in table.items()}
    left = [0.0] * len(peaks)
    for cat in STRATEGY_CATEGORIES:
        vals = [p.get(cat, 0) / 2**20 for p in peaks.values()]
        ax.barh(list(peaks), vals, left=left, label=cat, color=COLORS_BESIDE_TIMELINE[cat])
        left = [l + v for l, v in zip(left, vals)]
    for y, total in enumerate(left):
        ax.text(total + 0.2, y, f"{total:.2f}", va="center", fontsize=8)
    ax.set_xlim(0, max(left) * 1.12)
    ax.invert_yaxis()
    ax.set_xlabel("rank 0 peak, MiB (categories at the moment of the peak)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.set_title("peak memory by category at the moment of the peak")
    fig.tight_layout()
    return fig
