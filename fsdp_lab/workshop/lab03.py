"""Lab 03 (ZeRO by hand): train a stage on N ranks, the single-process reference, the
ZeRO arithmetic, and the checkers of the learner's DDP, ZeRO-1, ZeRO-2 and ZeRO-3.

``measure(stage_class, world_size)`` trains ``STEPS`` AdamW steps of a small Llama on fresh
ranks (each rank gets its slice of one global batch) and returns, per rank, a
:class:`StageRun`: losses, the gradients the optimizer saw, the whole parameters after the
first and the last step, and, for step ``MEASURED_STEP``, a MemoryTracker result and a
Timeline. ``reference()`` trains the same model on the whole batch in this process. Both, with
the arithmetic below, live in ``lab03_runs.py``; this module re-exports them and holds the checkers.

Each ``check_<stage>(answer)`` compares the learner's class with that reference (every
parameter within ``TOL`` after ``STEPS`` steps), its memory per category with
:func:`expected` (the ZeRO paper's arithmetic for fp32 AdamW), and its bytes on the wire
with the same formula; a wrong answer is diagnosed from what differs (gradients N times too
large, another rank's slice, slices never gathered back, whole gradients kept, a parameter
freed before backward, ...).
"""

from __future__ import annotations

import re

import torch

from fsdp_lab.launch import launch
from fsdp_lab.workshop.checking import CHECK_TIMEOUT, checker, correct, mistake, not_waited
from fsdp_lab.workshop.lab03_runs import (CONFIG, GLOBAL_BATCH, MEASURED_STEP, SEQ_LEN, STAGE_NAMES, STEPS, TOL,
                                          TOL_TEXT, WORLD, Reference, StageRun, batch_for, expected, kib,
                                          num_params, reference, summary, train_on_rank)

__all__ = ["CONFIG", "GLOBAL_BATCH", "MEASURED_STEP", "SEQ_LEN", "STAGE_NAMES", "STEPS", "TOL", "TOL_TEXT", "WORLD",
           "Reference", "StageRun", "batch_for", "expected", "kib", "measure", "num_params", "reference", "summary",
           "train_on_rank", "check_ddp", "check_zero1", "check_zero2", "check_zero3"]


def measure(stage_class, world_size: int = WORLD, *, params_from_shards: bool | None = None,
            timeout: float = CHECK_TIMEOUT) -> list[StageRun]:
    """Train ``stage_class`` on ``world_size`` fresh ranks; one :class:`StageRun` per rank.
    ``params_from_shards`` (default: for a stage named "ZeRO-3") reads the trained parameters
    from the shards, as :func:`train_on_rank` says."""
    if params_from_shards is None:
        params_from_shards = getattr(stage_class, "name", "") == "ZeRO-3"
    return launch(train_on_rank, stage_class, params_from_shards, world_size=world_size, timeout=timeout)


# ----------------------------------------------------------------------------- checking


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line \d+, in (?P<func>\S+)\s*$', re.MULTILINE)


def _frames(text: str) -> list[tuple[str, str]]:
    """(file, function) of every frame of the tracebacks in ``text``, outermost first."""
    return [(m["file"], m["func"]) for m in _FRAME.finditer(text)]


def _phase(text: str) -> str:
    """Where a rank's error was raised, read from the frames of its traceback below
    ``train_on_rank``: "setup" (the stage's construction), "backward" (inside autograd's
    backward: ``loss.backward()`` and the hooks it runs), "forward" (elsewhere in a training
    step) or "" (no traceback, or raised elsewhere, e.g. while reading the parameters back)."""
    frames = _frames(text)
    below = [i for i, (_, func) in enumerate(frames) if func == "train_on_rank"]
    if not below or below[-1] + 1 >= len(frames):
        return ""
    inner = frames[below[-1] + 1:]
    if inner[0][1] == "__init__":
        return "setup"
    if inner[0][1] != "step":
        return ""
    autograd = any(func in ("backward", "_engine_run_backward") and "torch" in file for file, func in inner)
    return "backward" if autograd else "forward"


def _explain(error: BaseException, text: str):
    if "self.shards is not set" in text:
        return mistake("no_self_shards", "the stage never set self.shards, which the check reads to "
                                         "gather the parameters from the shards",
                       "in setup(): self.shards = [self.param_shard(p) for p in self.params]")
    if "optimizer" in text and "AttributeError" in text:
        return mistake("no_optimizer", "the stage has no `self.optimizer` after setup()",
                       "setup() must create self.optimizer (self.make_optimizer(tensors))")
    freed = "storage of size 0" in text or "storage size of 0" in text or re.search(r"\b0 bytes", text)
    phase = _phase(text) if freed else ""
    if freed and phase in ("forward", "backward") and any(func == "gather" for _, func in _frames(text)):
        return mistake("gathered_into_freed",
                       "gather wrote into a parameter whose storage was freed (0 bytes): a freed "
                       "parameter keeps its shape but has no memory to receive the slices",
                       "in gather(): alloc_storage(p) first, then all-gather the slices into p.data")
    if phase == "setup":
        return mistake("freed_before_shard",
                       "setup read a parameter whose storage was already freed: free_storage(p) ran "
                       "before self.param_shard(p) took this rank's slice of it, so there was nothing "
                       "to copy", "in setup(): first self.shards = [self.param_shard(p) for p in "
                                  "self.params], then free_storage(p) for each parameter")
    if phase == "forward":
        return mistake("not_gathered_for_forward",
                       "forward used a parameter whose storage was freed: a unit's parameters were "
                       "not gathered before its forward",
                       "register a forward pre-hook on each unit that gathers that unit, the module "
                       "the hook receives (unit.register_forward_pre_hook(lambda module, args: "
                       "self.gather(module))); a lambda that names the loop variable gathers the "
                       "loop's last unit for every unit")
    if phase == "backward":
        return mistake("freed_before_backward",
                       "backward used a parameter whose storage was freed: it was freed after "
                       "forward and not gathered again before its unit's backward",
                       "register a backward pre-hook on each unit that gathers its parameters "
                       "(unit.register_full_backward_pre_hook)")
    if freed:
        return mistake("used_freed_parameter", "a parameter was used while its storage was freed: "
                                               "gather a unit's parameters before its forward")
    if "'NoneType' object has no attribute" in text and "grad" in text:
        if any(func == "after_step" for _, func in _frames(text)):
            return mistake("reduced_after_step",
                           "a .grad was None in after_step: it runs after the optimizer step and "
                           "optimizer.zero_grad(set_to_none=True), so no gradient is left there to "
                           "reduce", "reduce the gradients in after_backward, before the optimizer "
                                     "steps with them")
        return mistake("grad_is_none", "a .grad was None where the code read it: a hook or an "
                                       "earlier loop had already dropped it (p.grad = None), or "
                                       "it was read before backward produced it")
    return None


def _allclose(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(
        a, b, rtol=1e-4, atol=1e-6)


def _expected_slices(grads: dict, names: list[str], rank: int, world: int, sharded: bool):
    out = []
    for name in names:
        flat = grads[name].reshape(-1)
        size = flat.numel() // world
        out.append(flat[rank * size:(rank + 1) * size] if sharded else grads[name])
    return out


def _check_stage(stage: str, stage_class):
    world = WORLD
    runs = measure(stage_class, world, params_from_shards=stage == "ZeRO-3")
    ref = reference(world)
    names = list(ref.initial)
    elements, tensors = sum(t.numel() for t in ref.initial.values()), len(names)
    sharded = stage != "DDP"
    whole = 4 * elements
    unwaited = not_waited([run.timeline.unwaited for run in runs], "keep each handle the hooks' collectives return "
                                                          "and wait on all of them in after_backward, before "
                                                          "the optimizer reads the gradients")
    if unwaited:
        return unwaited

    # 1. the gradient the optimizer sees at the first step
    for run in runs:
        got = run.grads[0]
        if len(got) != len(names):
            return mistake("optimizer_tensors", f"the optimizer of rank {run.rank} steps {len(got)} "
                                                f"tensors; it should step one per parameter "
                                                f"({len(names)}), in the model's order")
        numels = run.numels or [None if g is None else g.numel() for g in got]
        if sharded and all(k == ref.initial[n].numel() for k, n in zip(numels, names)):
            return mistake("optimizer_not_sharded", "the optimizer steps whole parameters: with "
                                                    "ZeRO it steps only this rank's slices")
        if any(g is None for g in got):
            return mistake("no_gradient", f"when the optimizer stepped on rank {run.rank}, some of "
                                          "its tensors had no .grad")
        want = _expected_slices(ref.grads[0], names, run.rank, world, sharded)
        if all(_allclose(g, w) for g, w in zip(got, want)):
            continue
        if all(_allclose(g, w * world) for g, w in zip(got, want)):
            return mistake("not_averaged", f"the gradients on rank {run.rank} are {world}x the "
                                           "single-process ones: they were summed over the ranks "
                                           "but not divided by the world size",
                           "reduce with op=\"avg\" (or divide by the world size)")
        if all(_allclose(g, w / world) for g, w in zip(got, want)):
            return mistake("averaged_twice", f"the gradients on rank {run.rank} are 1/{world} of the "
                                             "single-process ones: divided by the world size twice "
                                             "(op=\"avg\" already divides)",
                           "either op=\"avg\", or the default sum and then a division by the world size")
        local = _expected_slices(ref.local_grads[run.rank], names, run.rank, world, sharded)
        if all(_allclose(g, w) for g, w in zip(got, local)):
            return mistake("not_reduced", f"rank {run.rank} stepped with the gradient of its own "
                                          "slice of the batch: gradients were not reduced over "
                                          "the ranks")
        wrong = [n for n, g, w in zip(names, got, want) if not _allclose(g, w)]
        if len(wrong) < len(names):
            shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
            unreduced = all(_allclose(got[names.index(n)], local[names.index(n)]) for n in wrong)
            return mistake("some_gradients_wrong", f"on rank {run.rank} the gradients of {shown} differ from "
                                                   "single-process training"
                                                   + (" (they are this rank's own, not reduced)" if unreduced
                                                      else "") + f"; the other {len(names) - len(wrong)} "
                                                   "are right", "reduce every parameter's gradient, "
                                                                "the same way")
        for other in range(world):
            theirs = _expected_slices(ref.grads[0], names, other, world, sharded)
            if other != run.rank and all(_allclose(g, w) for g, w in zip(got, theirs)):
                return mistake("wrong_shard", f"rank {run.rank}'s optimizer got the gradient slice "
                                              f"of rank {other}: a rank keeps slice [r·k, (r+1)·k) "
                                              "of each gradient", "use self.my_slice and the "
                                                                  "reduce-scatter's output")
        return mistake("wrong_gradients", f"the gradients on rank {run.rank} differ from "
                                          "single-process training at the first step")
    # 2. the parameters after the first step, the second step's gradients, the last parameters
    for run in runs:
        if all(torch.allclose(run.after_first[n], ref.after_first[n], atol=TOL, rtol=0) for n in names):
            continue
        mine = [_expected_slices(run.after_first, [n], run.rank, world, True)[0] for n in names]
        ours = [_expected_slices(ref.after_first, [n], run.rank, world, True)[0] for n in names]
        if all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(mine, ours)):
            return mistake("not_gathered", f"after the step rank {run.rank} has updated only its own "
                                           "slice of each parameter: the other slices were never "
                                           "gathered back", "all-gather every rank's updated slice "
                                                            "into the whole parameter after the step")
        return mistake("wrong_update", f"after the first step the parameters of rank {run.rank} "
                                       "differ from single-process training")
    for run in runs:
        want = _expected_slices(ref.grads[1], names, run.rank, world, sharded)
        if not all(_allclose(g, w) for g, w in zip(run.grads[1], want)):
            return mistake("stale_gradients", "the first step's gradients are right but the second "
                                              "step's are not: something carries over from one "
                                              "step to the next",
                           "drop each whole gradient once it is reduced (p.grad = None)")

    worst = max((run.final[n] - ref.final[n]).abs().max().item() for run in runs for n in names)
    if worst > TOL:
        return mistake("diverged", f"after {STEPS} steps a parameter differs from single-process "
                                   f"training by {worst:.1e} (more than {TOL_TEXT})")

    # 3. memory per category and bytes on the wire, against the ZeRO arithmetic
    want = expected(stage, elements, tensors, world)
    got = summary(runs)
    most, now = runs[0].memory.max_by_category, runs[0].memory.current
    if got["optimizer_state"] > want["optimizer_state"]:
        return mistake("optimizer_not_sharded", f"the optimizer state is {kib(got['optimizer_state'])} "
                                                f"per rank; {stage} keeps {kib(want['optimizer_state'])}")
    if sharded and got["grad_slices"] != whole // world:
        return mistake("untagged_grad_slices", f"the tracker counted {kib(got['grad_slices'])} of "
                                               f"gradient slices, expected {kib(whole // world)}: it "
                                               "counts a slice's gradient only when "
                                               "self.new_grad_shard(shard) made it",
                       "make each slice's gradient with self.new_grad_shard(shard)")
    if stage in ("ZeRO-2", "ZeRO-3") and most.get("grads", 0):
        return mistake("whole_grads_kept", f"whole gradients stayed on the parameters "
                                           f"({kib(most['grads'])} at once): {stage} drops each one "
                                           "in its hook, right after reducing it",
                       "reduce-scatter each gradient in a hook, p.register_post_accumulate_grad_hook(...), "
                       "and set p.grad = None there, right after it")
    if stage == "ZeRO-3":
        if 0 < most.get("params", 0) <= whole // world:
            return mistake("untagged_param_shards", f"{kib(most['params'])} of parameters were counted "
                                                    "as whole ones, one shard's worth: the tracker knows "
                                                    "a shard only when self.param_shard(p) made it",
                           "in setup(): self.shards = [self.param_shard(p) for p in self.params]")
        if most.get("params", 0):
            return mistake("params_not_sharded", f"{kib(most['params'])} of whole parameters stayed "
                                                 "allocated: free every parameter in setup, after "
                                                 "taking its slice")
        kept = max(run.kept_after_setup for run in runs)
        if kept:
            return mistake("params_not_sharded", f"right after setup the whole parameters still held "
                                                 f"{kib(kept)} on a rank: ZeRO-3 keeps only the slices "
                                                 "between uses, so free every parameter in setup, after "
                                                 "taking its slice (a forward hook that frees it later "
                                                 "leaves it whole until then)",
                           "in setup(): free_storage(p) for each parameter once self.shards holds its slice")
        if now.get("unsharded_params", 0):
            return mistake("not_freed_after_backward",
                           f"{kib(now['unsharded_params'])} of gathered parameters were still alive "
                           "after the step: gathered and not freed once their gradients were reduced, "
                           "or gathered again after the optimizer step, where ZeRO-3 gathers nothing "
                           "(the next forward's pre-hook does)",
                           "free each parameter in reduce_gradient, once its gradient is reduced; "
                           "after_step has nothing to do")
        if got["gathered"] >= whole:
            return mistake("not_freed_after_forward", "every parameter was gathered at the same "
                                                      "time: free each unit after its forward")
    if not got["collectives"]:
        return mistake("no_collective", f"{stage} trained right, but no collective went through "
                                        "fsdp_lab.collectives, which the check records to count the bytes "
                                        "on the wire (torch.distributed's own functions bypass it)",
                       "call collectives.all_reduce, reduce_scatter_tensor and all_gather_into_tensor: "
                       "torch.distributed's arguments, recorded on the timeline")
    if got["wire"] != want["wire"]:
        used = ", ".join(f"{calls} {name}" for name, (calls, _) in got["collectives"].items())
        hint = ""
        if stage in ("ZeRO-1", "ZeRO-2") and "all_reduce" in got["collectives"]:
            hint = ("a rank needs only its slice of the averaged gradient: reduce-scatter it, for "
                    "half an all-reduce's traffic")
        return mistake("wire_bytes", f"one step sent {kib(got['wire'])} per rank ({used}); {stage} "
                                     f"sends {kib(want['wire'])}", hint)
    return correct(_praise(stage, got, want, expected("DDP", elements, tensors, world), world))


def _praise(stage: str, got: dict, want: dict, ddp: dict, world: int) -> str:
    same = f"on {world} ranks your {stage} matches single-process training (every parameter " \
           f"within {TOL_TEXT} after {STEPS} steps)"
    calls = ", ".join(f"{calls} {name}s" for name, (calls, _) in got["collectives"].items())
    if stage == "DDP":
        return (f"{same}; each step all-reduced {kib(got['params'])} of gradients "
                f"({calls}) and sent {kib(got['wire'])} per rank, 2(N-1)/N of it")
    if stage == "ZeRO-1":
        return (f"{same}; optimizer state {kib(got['optimizer_state'])} per rank where DDP keeps "
                f"{kib(ddp['optimizer_state'])} (1/{world} of the moments, every step counter); whole "
                f"gradients still {kib(got['whole_grads'])} at once; {kib(got['wire'])} on the wire, "
                f"as much as DDP ({calls})")
    if stage == "ZeRO-2":
        return (f"{same}; gradients kept: {kib(got['grad_slices'])} of slices, 1/{world} of DDP's "
                f"{kib(ddp['grads'])}, no whole gradient outlived its hook; optimizer state "
                f"{kib(got['optimizer_state'])}; {kib(got['wire'])} on the wire, as much as DDP")
    return (f"{same}; parameters kept: {kib(got['params'])} of slices, 1/{world} of "
            f"{kib(ddp['params'])}, at most {kib(got['gathered'])} gathered at once; "
            f"{kib(got['wire'])} on the wire = {got['wire'] / ddp['wire']:g}x DDP's "
            f"({calls}): the parameters are gathered twice, for forward and for backward")


_HINTS = {
    "DDP": "after backward, all-reduce every p.grad with op=\"avg\" (the mean over ranks)",
    "ZeRO-1": "setup: self.shards = [self.my_slice(p.data).requires_grad_() ...] and "
              "self.optimizer over them; after backward reduce-scatter each p.grad into "
              "shard.grad = self.new_grad_shard(shard) and drop p.grad; after the step "
              "all-gather each shard into p.data",
    "ZeRO-2": "like ZeRO-1, but reduce-scatter inside p.register_post_accumulate_grad_hook "
              "(the hook gets p) and drop p.grad there",
    "ZeRO-3": "shards from self.param_shard(p), free_storage(p); per unit: forward pre-hook "
              "gathers (alloc_storage + all-gather), forward hook frees, full backward pre-hook "
              "gathers again; the gradient hook reduce-scatters, drops p.grad and frees p",
}


def _stage_checker(stage: str):
    @checker(stage, hint=_HINTS[stage], explain=_explain)
    def check(stage_class):
        return _check_stage(stage, stage_class)

    check.__name__ = f"check_{stage.lower().replace('-', '')}"
    check.__doc__ = (f"Train the learner's {stage} class on {WORLD} ranks and compare it with "
                     "single-process training, the ZeRO memory arithmetic and the bytes formula.")
    return check


check_ddp = _stage_checker("DDP")
check_zero1 = _stage_checker("ZeRO-1")
check_zero2 = _stage_checker("ZeRO-2")
check_zero3 = _stage_checker("ZeRO-3")
