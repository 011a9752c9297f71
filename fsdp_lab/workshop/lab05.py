"""Checkers for lab 05 (FSDP2, per-parameter sharding).

* ``check_shard_param(shard_param, real=None, param=None)``: ``shard_param(param, world, rank)``
  returns rank ``rank``'s padded ``Shard(0)`` piece of ``param``: ``ceil(rows / world)`` rows,
  its own rows of ``torch.chunk(param, world)`` on top and zeros below. Reference:
  ``torch.chunk`` (what PyTorch's FSDP2 uses) on many shapes and, when given, the padded
  shards real ranks of fsdp_lab's ``fully_shard`` hold for ``param`` (``real``: {rank: tensor}).
* ``check_pre_forward(pre_forward)``: ``pre_forward(module, args)`` is a forward pre-hook that
  all-gathers each of ``module.shards`` (this rank's padded shards) into the full parameter
  (``module.rows[name]`` rows) and sets it on the module. Reference: the same ``nn.Linear``
  run in one process with its full weights (on 4 ranks, 7 rows: one padding row); the
  collectives the hook issues (recorded with a ``Timeline``) must be all-gathers.
"""

from __future__ import annotations

import math

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import (CHECK_TIMEOUT, answer_timeline, checker, correct, is_placeholder, mistake,
                                        not_waited, placeholder_left, wrong_collectives)

HOOK_WORLD = 4
HOOK_SHAPE = (7, 5)  # out_features, in_features of the checked nn.Linear: 7 rows on 4 ranks


def reference_shard(param: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s padded ``Shard(0)`` piece: its chunk of ``torch.chunk(param, world)``
    (possibly empty), zero-padded to ``ceil(rows / world)`` rows."""
    rows = math.ceil(param.shape[0] / world)
    chunks = torch.chunk(param.detach(), world, dim=0)
    padded = param.new_zeros((rows, *param.shape[1:]))
    if rank < len(chunks):
        padded[:chunks[rank].shape[0]] = chunks[rank]
    return padded


def _cases():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (8, 2), (1, 4), (3, 3), (11, 2, 2)]
    for shape in shapes:
        for world in (2, 3, 4, 5):
            yield torch.randn(shape, generator=gen), world


def _diagnose_shard(shard_param, param: torch.Tensor, world: int):
    """A mistake() for the first rank where ``shard_param`` differs from ``reference_shard``
    on ``param`` and ``world`` ranks, else None."""
    rows = math.ceil(param.shape[0] / world)
    for rank in range(world):
        expected = reference_shard(param, world, rank)
        try:
            got = shard_param(param.clone(), world, rank)
        except IndexError as error:
            pieces = len(torch.chunk(param, world, dim=0))
            if rank < pieces:
                return mistake("raised", f"a {tuple(param.shape)} parameter on {world} ranks, rank {rank}: "
                                         f"IndexError ({error}); parameters can be 1-D or 3-D as well as 2-D",
                               "param.new_zeros((rows, *param.shape[1:])) makes zero rows of any shape")
            return mistake("short_chunks", f"a {tuple(param.shape)} parameter on {world} ranks, rank {rank}: "
                                           f"IndexError ({error}). torch.chunk gave only {pieces} pieces: it "
                                           f"cuts ceil(rows / world) = {rows} rows each, so rank {rank} has "
                                           "no real rows", f"when rank >= len(chunks), return {rows} zero rows")
        if is_placeholder(got):
            return placeholder_left("shard_param")
        if not isinstance(got, torch.Tensor):
            return mistake("not_a_tensor", "return the padded shard as a tensor")
        got = got.detach()
        if got.shape == expected.shape and torch.equal(got, expected):
            continue
        where = f"a {tuple(param.shape)} parameter on {world} ranks, rank {rank}"
        chunks = torch.chunk(param, world, dim=0)
        own = chunks[rank] if rank < len(chunks) else param[:0]
        if got.shape == own.shape and torch.equal(got, own):
            return mistake("no_padding", f"{where}: you returned its {own.shape[0]} real rows; every "
                                         f"rank stores {rows} rows (zeros below) so that all "
                                         "all-gather inputs have one size")
        if got.shape[0] == param.shape[0] // world and param.shape[0] % world:
            return mistake("floor_rows", f"{where}: {got.shape[0]} rows is rows // world; a shard has "
                                         f"ceil(rows / world) = {rows}")
        if got.shape == expected.shape and own.shape[0] < rows and \
                torch.equal(got[rows - own.shape[0]:], own) and not got[:rows - own.shape[0]].any():
            return mistake("padding_first", f"{where}: the zero rows are on top; FSDP2 puts the "
                                            "padding below the real rows")
        if got.shape == param.shape and torch.equal(got, param):
            return mistake("whole_param", f"{where}: you returned the whole parameter; a rank keeps "
                                          f"only its {rows} rows (zeros below where real rows run out)")
        if got.dim() == param.dim() and param.dim() > 1 and got.shape[0] == param.shape[0]:
            return mistake("wrong_dim", f"{where}: you cut along dim 1; Shard(0) cuts rows (dim 0)")
        others = [r for r in range(world) if r != rank and got.shape == expected.shape
                  and torch.equal(got, reference_shard(param, world, r))]
        if others:
            return mistake("wrong_rank", f"{where}: you returned rank {others[0]}'s piece",
                           "rank r's rows start at r * ceil(rows / world)")
        split = torch.tensor_split(param, world, dim=0)[rank]
        if split.shape[0] != own.shape[0] and got.shape[0] >= split.shape[0] and \
                torch.equal(got[:split.shape[0]], split):
            counts = [len(c) for c in torch.tensor_split(param, world, dim=0)]
            real = [len(c) for c in chunks] + [0] * (world - len(chunks))
            return mistake("tensor_split", f"{where}: you took rows as torch.tensor_split deals them, "
                                           f"{counts} per rank; FSDP2 deals them as torch.chunk does, "
                                           f"{real}: ceil(rows / world) = {rows} rows to each rank until "
                                           "they run out", "torch.chunk(param, world, dim=0)[rank] (none for "
                                                           "the ranks past its last piece), then pad")
        return mistake("wrong_values", f"{where}: expected shape {tuple(expected.shape)}, got "
                                       f"{tuple(got.shape)} with other values")
    return None


@checker("shard_param", hint="rows = ceil(param.shape[0] / world); take this rank's chunk of "
                             "torch.chunk(param, world, dim=0) (maybe none) and pad it with zero rows "
                             "to `rows` rows")
def check_shard_param(shard_param, real=None, param=None):
    """Compare with ``reference_shard`` on every case of ``_cases`` (6 shapes x 4 worlds) and,
    when ``real`` ({rank: padded shard}) and ``param`` are given, with the padded shards
    fsdp_lab's fully_shard holds for ``param`` on ``len(real)`` ranks, value for value."""
    cases = list(_cases())
    for case, world in cases:
        found = _diagnose_shard(shard_param, case, world)
        if found is not None:
            return found
    counted = f"every piece of {len(cases)} parameters x worlds matches torch.chunk plus padding"
    if real is None or param is None:
        return correct(f"{counted} (zero rows up to ceil(rows / world))")
    world = len(real)
    found = _diagnose_shard(shard_param, param, world)
    if found is not None:
        return found
    for rank, held in sorted(real.items()):
        got = shard_param(param.clone(), world, rank).detach()
        if got.shape != held.shape or not torch.equal(got.to(held.dtype), held):
            return mistake("differs_from_fully_shard", f"rank {rank}: your piece of the {tuple(param.shape)} "
                                                       f"weight differs from the padded shard fully_shard's "
                                                       f"rank {rank} holds")
    chunks = torch.chunk(param, world, dim=0)
    rows = [chunks[r].shape[0] if r < len(chunks) else 0 for r in range(world)]
    shape = "x".join(str(d) for d in param.shape)
    return correct(f"{counted}; for the {shape} weight on {world} ranks fully_shard's ranks hold {rows} "
                   f"real rows in storages of {math.ceil(param.shape[0] / world)} rows each, the same "
                   "values as yours")


def _hook_case(pre_forward):
    """On each rank: an nn.Linear whose parameters are replaced by this rank's padded shards,
    with ``pre_forward`` as its forward pre-hook; the output, what the hook set and the names
    of the collectives it issued, beside a one-process reference run of the same layer."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = torch.nn.Linear(HOOK_SHAPE[1], HOOK_SHAPE[0])
    x = torch.randn(3, HOOK_SHAPE[1])
    reference = full(x).detach()
    layer = torch.nn.Linear(HOOK_SHAPE[1], HOOK_SHAPE[0])
    layer.load_state_dict(full.state_dict())
    layer.shards, layer.rows = {}, {}
    for name in ("weight", "bias"):
        param = layer._parameters.pop(name)
        layer.shards[name] = reference_shard(param, world, rank)
        layer.rows[name] = param.shape[0]
        setattr(layer, name, None)
    hook_error = []

    def hook(module, args):
        try:
            return pre_forward(module, args)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised on as the learner's hook would
            lines = str(exc).strip().splitlines()
            hook_error.append(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)
            raise

    layer.register_forward_pre_hook(hook)
    try:
        with answer_timeline() as timeline:   # records every collective issued through fsdp_lab.collectives
            out = layer(x).detach()
        error = ""
    except Exception as exc:  # noqa: BLE001 - the hook's error, or shapes that do not multiply: reported below
        out, error = None, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    issued = [e.name for e in timeline.comm_events()]
    seen = {name: (None if getattr(layer, name) is None else getattr(layer, name).detach().clone())
            for name in ("weight", "bias")}
    return {"out": out, "error": error, "hook_error": hook_error[0] if hook_error else "",
            "reference": reference, "seen": seen, "collectives": issued, "unwaited": timeline.unwaited,
            "shards": {name: tuple(shard.shape) for name, shard in layer.shards.items()},
            "full": {n: p.detach().clone() for n, p in full.named_parameters()}}


@checker("pre_forward", hint="for each name, shard in module.shards.items(): gathered = "
                             "torch.empty(world * shard.shape[0], *shard.shape[1:]); "
                             "collectives.all_gather_into_tensor(gathered, shard); "
                             "setattr(module, name, gathered[:module.rows[name]])")
def check_pre_forward(pre_forward):
    """Run the hook on 4 ranks before an nn.Linear(5, 7) whose weights are sharded, compare
    the layer's output and gathered weights with the same layer run in one process, and
    require that the hook's collectives were all-gathers."""
    out = launch(_hook_case, pre_forward, world_size=HOOK_WORLD, timeout=CHECK_TIMEOUT)
    first = out[0]
    rows = HOOK_SHAPE[0]
    padded = math.ceil(rows / HOOK_WORLD) * HOOK_WORLD
    seen = first["seen"]["weight"]
    raised = next((o["hook_error"] for o in out if o["hook_error"]), "")
    if "ellipsis" in raised.lower():
        return placeholder_left("pre_forward")
    unwaited = not_waited([o["unwaited"] for o in out])
    if unwaited:
        return unwaited
    if raised:
        where = "before setting module.weight" if seen is None else "after setting module.weight"
        return mistake("hook_raised", f"{where}, the hook raised {raised}")
    if seen is None:
        return mistake("not_set", "the hook did not set module.weight; setattr(module, name, full) for "
                                  "each gathered parameter")
    if seen.shape[0] == padded and padded != rows:
        return mistake("kept_padding", f"the gathered weight has {padded} rows: the {HOOK_WORLD} padded "
                                       f"shards end to end; drop the padding: keep the first {rows}")
    if seen.shape[0] == math.ceil(rows / HOOK_WORLD):
        return mistake("not_gathered", "the weight the layer used is this rank's shard; all-gather the "
                                       "shards of every rank first")
    for name in ("weight", "bias"):
        got, whole = first["seen"][name], first["full"][name]
        if got is not None and got.shape != whole.shape:
            if got.dim() == whole.dim() + 1 and got.shape[1:] == first["shards"][name]:
                return mistake("stacked_output", f"the gathered {name} has shape {tuple(got.shape)}: the "
                                                 "all-gather's output was stacked, (world, rows, ...), so its "
                                                 "first entries are whole shards, not rows; gather into "
                                                 "(world * rows, ...) (or reshape the stacked output to it) "
                                                 "and keep gathered[:module.rows[name]]")
            if got.shape[1:] == whole.shape[1:]:
                return mistake("wrong_rows", f"the gathered {name} has {got.shape[0]} rows, the parameter "
                                             f"{whole.shape[0]}: the {HOOK_WORLD} shards end to end have "
                                             f"{padded}, the last {padded - rows} padding; keep "
                                             "gathered[:module.rows[name]]")
            return mistake("wrong_shape", f"the gathered {name} has shape {tuple(got.shape)}, the parameter "
                                          f"{tuple(whole.shape)}")
    if first["error"]:
        return mistake("raised", f"the forward failed: {first['error']}")
    if all(o["out"] is not None and o["out"].shape == o["reference"].shape
           and torch.allclose(o["out"], o["reference"], atol=1e-6) for o in out) and \
            all(o["seen"][n] is not None and torch.equal(o["seen"][n], o["full"][n])
                for o in out for n in ("weight", "bias")):
        wrong = wrong_collectives(first["collectives"], "all_gather", "the weights came back whole",
                                  "an all-gather sends each rank's shard to the others, (N-1)/N of the parameter "
                                  "per rank; an all-reduce of zero-padded whole tensors sends 2(N-1)/N of it",
                                  "collectives.all_gather_into_tensor(gathered, shard)")
        if wrong is not None:
            return wrong
        return correct(f"on {HOOK_WORLD} ranks the layer computed what the unsharded layer computes in one "
                       f"process: each weight came back whole ({rows} rows from {HOOK_WORLD} padded shards of "
                       f"{math.ceil(rows / HOOK_WORLD)}, {padded - rows} padding row dropped) — FSDP2's "
                       "pre-forward all-gather, one collective per parameter here where fully_shard "
                       "batches a group into one")
    whole = first["full"]["weight"]
    padded_whole = torch.cat([whole, whole.new_zeros((padded - rows, *whole.shape[1:]))])
    if seen.shape[0] == rows and padded != rows and torch.equal(seen, padded_whole[-rows:]):
        return mistake("dropped_first_rows", f"the hook kept the last {rows} of the {padded} gathered rows: "
                                             f"the padding is the last {padded - rows} of them, so that "
                                             "dropped real rows from the top and kept the padding; keep "
                                             f"the first {rows}, gathered[:module.rows[name]]")
    if seen.shape[0] == rows and not torch.equal(seen, first["full"]["weight"]):
        return mistake("wrong_order", "the gathered weight has the right shape but the wrong rows; "
                                      "all_gather_into_tensor puts rank r's shard at rows "
                                      "[r*S, (r+1)*S)")
    return mistake("wrong_output", "the layer's output differs from the unsharded layer's")
