"""Every lab checker fed the shipped stub, the shipped solution and typical wrong answers.

Stubs and solutions are the exercise texts of ``labs/src/NN_*.py`` (lab 03's are the classes of
``fsdp_lab.workshop.zero``, from which its exercises are made). Each verdict is asserted: a stub is
"not solved" without running anything, the solution is correct, each wrong answer is named.

Checkers launch ranks; to keep the suite fast, all answers of one lab run in one launch
(``SharedLaunch``: the cases one after another on the same ranks, with ``gc.collect()`` between
them so a case's leftovers are gone before the next is measured) and the checker's launch is
answered from those results. The references the checkers compare with (single-process training,
collectives.all_reduce, fsdp1.shard_boundaries) still run for real.
"""

from __future__ import annotations

import functools
import gc
import math
import pathlib
import sys
import traceback
from collections.abc import Mapping

import pytest
import torch

import fsdp_lab
from fsdp_lab import collectives
from fsdp_lab.launch import LaunchError
from fsdp_lab.workshop import checking, lab00, lab01, lab03, zero
from fsdp_lab.workshop.zero import DataParallel, alloc_storage, free_storage

LABS = pathlib.Path(__file__).resolve().parents[1] / "labs"

NAMESPACE = {"torch": torch, "collectives": collectives, "math": math, "functools": functools,
             "DataParallel": DataParallel, "alloc_storage": alloc_storage, "free_storage": free_storage}


class Shipped(Mapping):
    """{name: (stub, solution)} of the exercises of ``labs/src/<lab>.py``, each defined from its
    text as a learner's notebook defines it (sent to ranks by value, like a notebook's).
    ``names``: what the lab's set-up cells import beyond ``NAMESPACE``.

    Read on first use, not when the test module is imported: a rank that unpickles one of a test
    module's functions imports that module, and reading a lab imports nbformat (about 3 s of
    CPU a rank, at every launch)."""

    def __init__(self, lab: str, names: dict | None = None):
        self.lab, self.names = lab, names or {}

    @functools.cached_property
    def _exercises(self) -> dict[str, tuple[object, object]]:
        if str(LABS / "src") not in sys.path:
            sys.path.insert(0, str(LABS / "src"))
        import nbbuild

        out = {}
        for ex in nbbuild.exercises(nbbuild.load_cells(LABS / "src" / f"{self.lab}.py")):
            versions = []
            for text in (ex.student, ex.solution):
                namespace = {"__name__": f"notebook_{self.lab}", **NAMESPACE, **self.names}
                before = set(namespace)
                exec(compile(text, f"<{self.lab} exercise>", "exec"), namespace)
                (name,) = [n for n in namespace if n not in before and not n.startswith("__")]
                versions.append(namespace[name])
            out[name] = tuple(versions)
        return out

    def __getitem__(self, name: str) -> tuple[object, object]:
        return self._exercises[name]

    def __iter__(self):
        return iter(self._exercises)

    def __len__(self) -> int:
        return len(self._exercises)


def _each(target, cases):
    """On every rank: ``target(*case)`` for each case, in order; an error is kept, not raised."""
    results = []
    for case in cases:
        gc.collect()
        try:
            results.append(("ok", target(*case)))
        except Exception as error:  # noqa: BLE001 - the checker under test gets it back
            summary = "".join(traceback.format_exception_only(type(error), error)).strip()
            results.append(("error", summary, traceback.format_exc()))
    return results


class SharedLaunch:
    """One real launch of ``target(*case)`` for every case; ``launch`` then answers a checker's
    ``launch(target, *case, ...)`` from it, raising LaunchError for a case that raised, as
    ``fsdp_lab.launch`` would."""

    def __init__(self, target, cases: list[tuple], world_size: int):
        self.target, self.cases = target, cases
        self.per_rank = fsdp_lab.launch(_each, target, cases, world_size=world_size, timeout=600)

    def launch(self, fn, *case, world_size, timeout=None, **kwargs):
        assert fn is self.target
        index = next(i for i, c in enumerate(self.cases)
                     if len(c) == len(case) and all(a is b or a == b for a, b in zip(c, case)))
        results = [rank_results[index] for rank_results in self.per_rank]
        assert len(results) == world_size
        for rank, result in enumerate(results):
            if result[0] == "error":
                _, summary, tb = result
                raise LaunchError(f"rank {rank} raised {summary}\n--- traceback of rank {rank} ---\n{tb}",
                                  rank=rank, traceback=tb)
        return [result[1] for result in results]


def refuse_launch(*args, **kwargs):
    raise AssertionError("a stub must be judged without launching ranks")


# ----------------------------------------------------------------------------- lab 00


def mean_of_means(values):
    m = values.mean().clone()
    collectives.all_reduce(m, op="avg")
    return m.item()


def local_mean(values):
    return values.mean().item()


def sum_of_values(values):
    total = values.sum().clone()
    collectives.all_reduce(total)
    return total.item()


def integer_mean(values):
    totals = torch.tensor([int(values.sum().item()), values.numel()])
    collectives.all_reduce(totals)
    return (totals[0] // totals[1]).item()              # integer division drops the fraction


def gather_objects_mean(values):
    import torch.distributed as dist
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, values)          # the right mean, from all values in one place
    return torch.cat(everything).mean().item()


def gather_to_one_mean(values):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    everything = [None] * world if rank == 0 else None
    dist.gather_object(values, everything, dst=0)       # rank 0 collects every rank's values
    mean = torch.tensor(torch.cat(everything).mean().item() if rank == 0 else 0.0, dtype=torch.float64)
    collectives.broadcast(mean, src=0)
    return mean.item()


def gather_tensor_mean(values):
    import torch.distributed as dist
    padded = torch.zeros(dist.get_world_size(), dtype=values.dtype)
    padded[:values.numel()] = values
    everything = torch.empty(dist.get_world_size() * padded.numel(), dtype=values.dtype)
    collectives.all_gather_into_tensor(everything, padded)
    counts = torch.arange(1, dist.get_world_size() + 1)  # rank r holds r + 1 values
    return (everything.sum() / counts.sum()).item()


def all_reduce_values(values):
    v = values.clone()
    collectives.all_reduce(v)                           # the ranks' tensors differ in size
    return v.mean().item()


LAB00 = Shipped("00_start_here")


@pytest.fixture(scope="module")
def lab00_launch():
    solution = LAB00["global_mean"][1]
    return SharedLaunch(lab00._run_global_mean, [(solution,), (mean_of_means,), (local_mean,),
                                                 (sum_of_values,), (integer_mean,),
                                                 (gather_objects_mean,), (gather_to_one_mean,),
                                                 (gather_tensor_mean,)],
                        world_size=lab00.MEAN_WORLD)


def test_global_mean_verdicts(lab00_launch, monkeypatch):
    stub, solution = LAB00["global_mean"]
    monkeypatch.setattr(lab00, "launch", refuse_launch)
    assert lab00.check_global_mean(stub).mistake == "stub"
    monkeypatch.setattr(lab00, "launch", lab00_launch.launch)
    right = lab00.check_global_mean(solution)
    # (0 + 10+12 + 20+22+24) / 6 = 88 / 6: no whole number, so an integer division shows
    assert right.solved and "every rank returned 14.6667, the mean of all 6 values" in right.message
    assert lab00.check_global_mean(mean_of_means).mistake == "mean_of_means"
    assert lab00.check_global_mean(local_mean).mistake == "no_collective"
    assert lab00.check_global_mean(sum_of_values).mistake == "not_divided"
    floor = lab00.check_global_mean(integer_mean)
    assert floor.mistake == "integer_division" and "returned 14," in floor.message
    # the right mean, but from the values collected in one place
    for gathering, used in ((gather_objects_mean, "all_gather"), (gather_to_one_mean, "gather"),
                            (gather_tensor_mean, "all_gather")):
        verdict = lab00.check_global_mean(gathering)
        assert verdict.mistake == "gathered_values", f"{gathering.__name__}: {verdict}"
        assert f"used {used}," in verdict.message and "only its sum and its count" in verdict.message


def test_global_mean_of_different_sizes_is_named():
    # a real launch: ranks all-reducing tensors of different sizes break the process group
    verdict = lab00.check_global_mean(all_reduce_values)
    assert verdict.mistake == "different_sizes", verdict
    assert "different sizes" in verdict.message and "fixed-size totals" in verdict.hint
    assert "Connection" not in verdict.message


def floor_range(numel, rank, world):
    per = numel // world
    return rank * per, (rank + 1) * per


def unclipped_range(numel, rank, world):
    per = math.ceil(numel / world)
    return rank * per, (rank + 1) * per


def inclusive_range(numel, rank, world):
    per = math.ceil(numel / world)
    start = min(rank * per, numel)
    return start, min(start + per, numel) - 1 if start < numel else numel


def test_shard_range_verdicts():
    stub, solution = LAB00["shard_range"]
    assert lab00.check_shard_range(stub).mistake == "stub"
    right = lab00.check_shard_range(solution)
    assert right.solved and "ranges 0:3, 3:6, 6:9, 9:10" in right.message
    assert lab00.check_shard_range(floor_range).mistake == "floor_division"
    assert lab00.check_shard_range(unclipped_range).mistake == "not_clipped"
    assert lab00.check_shard_range(inclusive_range).mistake == "end_inclusive"
    assert lab00.check_shard_range(lambda n, r, w: (..., ...)).status == checking.NOT_SOLVED


# ----------------------------------------------------------------------------- lab 01


def averaged_all_reduce(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t, op="avg")
    collectives.all_gather_into_tensor(t, shard)
    return t


def shard_only(t):
    import torch.distributed as dist
    shard = torch.empty(t.numel() // dist.get_world_size())
    collectives.reduce_scatter_tensor(shard, t)
    return shard


def all_reduce_itself(t):
    collectives.all_reduce(t)
    return t


def first_chunk_everywhere(t):
    import torch.distributed as dist
    k = t.numel() // dist.get_world_size()
    total = t.clone()
    collectives.all_reduce(total)
    return total[:k]


def own_chunk_unreduced(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    collectives.all_reduce(t.clone())
    return t[rank * k:(rank + 1) * k].clone()


def next_chunk(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    total = t.clone()
    collectives.all_reduce(total)
    return total[(rank + 1) * k:(rank + 2) * k]      # off by one: the last rank gets nothing


def last_chunk_short(t):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    k = t.numel() // world
    total = t.clone()
    collectives.all_reduce(total)
    return total[rank * k:(rank + 1) * k - (rank == world - 1)]   # the last rank drops an element


def own_slice_reduced(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // dist.get_world_size()
    mine = t[rank * k:(rank + 1) * k].clone()
    collectives.all_reduce(mine)                     # adds the ranks' different slices together
    return mine


def all_reduce_for_four(t):
    shard = torch.empty(t.numel() // 4, dtype=t.dtype)   # the world size of the check, fixed
    collectives.reduce_scatter_tensor(shard, t)
    collectives.all_gather_into_tensor(t, shard)
    return t


def reduce_scatter_for_four(t):
    import torch.distributed as dist
    rank, k = dist.get_rank(), t.numel() // 4            # the world size of the check, fixed
    total = t.clone()
    collectives.all_reduce(total)
    return total[rank * k:(rank + 1) * k]


class Lab01Launch:
    """Lab 01's checkers run a right answer once more on SMALL_WORLD ranks: one SharedLaunch
    per world size, each checker launch answered from the one of its size."""

    def __init__(self, cases: list[tuple], small_cases: list[tuple]):
        self.shared = {lab01.WORLD: SharedLaunch(lab01._run, cases, world_size=lab01.WORLD),
                       lab01.SMALL_WORLD: SharedLaunch(lab01._run, [(*c, lab01.SMALL_PER_RANK) for c in small_cases],
                                                       world_size=lab01.SMALL_WORLD)}

    def launch(self, fn, *case, world_size, **kwargs):
        return self.shared[world_size].launch(fn, *case, world_size=world_size, **kwargs)


LAB01 = Shipped("01_collectives")


@pytest.fixture(scope="module")
def lab01_launch():
    ar, rs = LAB01["my_all_reduce"][1], LAB01["my_reduce_scatter"][1]
    right = [(ar, "all_reduce"), (all_reduce_for_four, "all_reduce"), (rs, "reduce_scatter"),
             (reduce_scatter_for_four, "reduce_scatter")]
    cases = right + [(averaged_all_reduce, "all_reduce"), (shard_only, "all_reduce"),
                     (all_reduce_itself, "all_reduce"), (first_chunk_everywhere, "reduce_scatter"),
                     (own_chunk_unreduced, "reduce_scatter"), (next_chunk, "reduce_scatter"),
                     (last_chunk_short, "reduce_scatter"), (own_slice_reduced, "reduce_scatter")]
    return Lab01Launch(cases, right)


def test_my_all_reduce_verdicts(lab01_launch, monkeypatch):
    stub, solution = LAB01["my_all_reduce"]
    monkeypatch.setattr(lab01, "launch", refuse_launch)
    assert lab01.check_my_all_reduce(stub).mistake == "stub"
    monkeypatch.setattr(lab01, "launch", lab01_launch.launch)
    right = lab01.check_my_all_reduce(solution)
    # 12 float32 = 48 bytes; a ring sends (n-1)/n of it twice: 2 * 3/4 * 48 = 72 per rank
    assert right.solved and "72 bytes sent per rank" in right.message
    assert lab01.check_my_all_reduce(averaged_all_reduce).mistake == "averaged"
    assert lab01.check_my_all_reduce(shard_only).mistake == "returned_shard"
    assert lab01.check_my_all_reduce(all_reduce_itself).mistake == "used_all_reduce"
    # right on the check's 4 ranks, but the 4 is written into the answer
    fixed = lab01.check_my_all_reduce(all_reduce_for_four)
    assert fixed.mistake == "fixed_world_size", fixed
    assert "not on 2 ranks with 10 elements" in fixed.message and "dist.get_world_size()" in fixed.hint


def test_my_reduce_scatter_verdicts(lab01_launch, monkeypatch):
    stub, solution = LAB01["my_reduce_scatter"]
    monkeypatch.setattr(lab01, "launch", refuse_launch)
    assert lab01.check_my_reduce_scatter(stub).mistake == "stub"
    monkeypatch.setattr(lab01, "launch", lab01_launch.launch)
    right = lab01.check_my_reduce_scatter(solution)
    # the all-reduce sends 2 * 3/4 * 48 = 72 bytes; a real reduce-scatter 3/4 * 48 = 36
    assert right.solved and "sent 72 bytes per rank where a real reduce-scatter" in right.message
    assert "sends 36: 2x the traffic" in right.message
    assert lab01.check_my_reduce_scatter(first_chunk_everywhere).mistake == "wrong_chunk"
    assert lab01.check_my_reduce_scatter(own_chunk_unreduced).mistake == "not_reduced"
    shifted = lab01.check_my_reduce_scatter(next_chunk)
    assert shifted.mistake == "wrong_chunk", shifted
    assert "rank 0 returned the chunk of rank 1 (and rank 3 returned 0 elements)" in shifted.message
    short = lab01.check_my_reduce_scatter(last_chunk_short)
    assert short.mistake == "wrong_size" and "rank 3 returned 2 elements" in short.message, short
    own = lab01.check_my_reduce_scatter(own_slice_reduced)
    assert own.mistake == "reduced_own_slice" and "only your slice" in own.message, own
    fixed = lab01.check_my_reduce_scatter(reduce_scatter_for_four)
    assert fixed.mistake == "fixed_world_size", fixed
    assert "rank 0 returned 2 elements where a chunk has 5" in fixed.message


# ----------------------------------------------------------------------------- lab 03


class SummedDDP(zero.DataParallel):
    def after_backward(self):
        for p in self.params:
            collectives.all_reduce(p.grad)              # forgot to divide by the world size


class SilentDDP(zero.DataParallel):
    pass                                                # never communicates


class TorchDistributedDDP(zero.DataParallel):
    def after_backward(self):
        import torch.distributed as dist
        for p in self.params:                           # right, but unseen by the timeline
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


class UngatheredZeRO1(zero.ZeRO1):
    def after_step(self):
        pass                                            # slices never gathered back


class AllReduceZeRO1(zero.ZeRO1):
    def after_backward(self):
        for p, shard in zip(self.params, self.shards):
            collectives.all_reduce(p.grad, op="avg")    # right numbers, twice the gradient traffic
            shard.grad = self.new_grad_shard(shard).copy_(self.my_slice(p.grad))
            p.grad = None


class OtherSliceZeRO1(zero.ZeRO1):
    def after_backward(self):
        for p, shard in zip(self.params, self.shards):
            collectives.all_reduce(p.grad, op="avg")
            flat, size = p.grad.reshape(-1), shard.numel()
            other = (self.rank + 1) % self.world        # wrong shard bounds
            shard.grad = self.new_grad_shard(shard).copy_(flat[other * size:(other + 1) * size])
            p.grad = None


class StaleZeRO1(zero.ZeRO1):
    def after_backward(self):
        for p, shard in zip(self.params, self.shards):
            shard.grad = self.new_grad_shard(shard)
            collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
            # p.grad kept: backward adds the next step's gradient to it


class LateDropZeRO2(zero.ZeRO2):
    def reduce_gradient(self, shard, p):
        shard.grad = self.new_grad_shard(shard)
        collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")

    def after_backward(self):
        for p in self.params:
            p.grad = None                               # dropped only after the whole backward


class NoBackwardGatherZeRO3(zero.ZeRO3):
    def setup(self):
        super().setup()
        for unit in self.units():                       # keep forward's hooks, drop the backward one
            unit._backward_pre_hooks.clear()


class NeverFreedZeRO3(zero.ZeRO3):
    def free(self, unit):
        pass


class KeptAfterBackwardZeRO3(zero.ZeRO3):
    def reduce_gradient(self, shard, p):
        shard.grad = self.new_grad_shard(shard)
        collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
        p.grad = None                                   # the parameter is not freed


class UntaggedGradZeRO1(zero.ZeRO1):
    def after_backward(self):
        for p, shard in zip(self.params, self.shards):
            shard.grad = torch.empty_like(shard)        # right values; the tracker cannot name it
            collectives.reduce_scatter_tensor(shard.grad, p.grad.reshape(-1), op="avg")
            p.grad = None


class UntaggedShardsZeRO3(zero.ZeRO3):
    def param_shard(self, param):
        return self.my_slice(param.data).clone().requires_grad_()    # the slice, but not tagged


class ShardOfOnlyZeRO3(zero.ZeRO3):
    def setup(self):
        super().setup()
        self.shards = None                                 # kept only in self.shard_of


class NoForwardGatherZeRO3(zero.ZeRO3):
    def setup(self):
        super().setup()
        for unit in self.units():                       # keep the backward hook, drop the forward pre-hook
            unit._forward_pre_hooks.clear()


class FreedBeforeShardZeRO3(zero.ZeRO3):
    def setup(self):
        for p in self.params:
            free_storage(p)                             # freed before param_shard copies its slice
        super().setup()


def _zero3_setup(stage, free=True, late_binding=False):
    """ZeRO3.setup written out, with the mistakes a learner makes in it."""
    stage.shards = [stage.param_shard(p) for p in stage.params]
    stage.shard_of = dict(zip(stage.params, stage.shards))
    for p, shard in zip(stage.params, stage.shards):
        if free:
            free_storage(p)
        p.register_post_accumulate_grad_hook(functools.partial(stage.reduce_gradient, shard))
    stage.optimizer = stage.make_optimizer(stage.shards)
    for unit in stage.units():
        if late_binding:                                # every hook gathers the loop's last unit
            unit.register_forward_pre_hook(lambda m, a: stage.gather(unit))
        else:
            unit.register_forward_pre_hook(lambda m, a: stage.gather(m))
        unit.register_forward_hook(lambda m, a, o: stage.free(m))
        unit.register_full_backward_pre_hook(lambda m, g: stage.gather(m))


class LateBindingZeRO3(zero.ZeRO3):
    def setup(self):
        _zero3_setup(self, late_binding=True)


class NotFreedInSetupZeRO3(zero.ZeRO3):
    def setup(self):
        _zero3_setup(self, free=False)                  # the first forward hook frees them instead


class WholeOptimizerZeRO1(zero.ZeRO1):
    def setup(self):
        super().setup()
        self.optimizer = self.make_optimizer(self.params)   # whole parameters, not the shards


class WholeOptimizerZeRO3(zero.ZeRO3):
    def setup(self):
        super().setup()
        self.optimizer = self.make_optimizer(self.params)


LAB03 = Shipped("03_zero_by_hand")
STAGES = {"DDP": (lab03.check_ddp, zero.DDP, {SummedDDP: "not_averaged", SilentDDP: "not_reduced",
                                              TorchDistributedDDP: "no_collective"}),
          "ZeRO1": (lab03.check_zero1, zero.ZeRO1, {UngatheredZeRO1: "not_gathered",
                                                    AllReduceZeRO1: "wire_bytes",
                                                    OtherSliceZeRO1: "wrong_shard",
                                                    StaleZeRO1: "stale_gradients",
                                                    UntaggedGradZeRO1: "untagged_grad_slices",
                                                    WholeOptimizerZeRO1: "optimizer_not_sharded"}),
          "ZeRO2": (lab03.check_zero2, zero.ZeRO2, {LateDropZeRO2: "whole_grads_kept"}),
          "ZeRO3": (lab03.check_zero3, zero.ZeRO3, {NoBackwardGatherZeRO3: "freed_before_backward",
                                                    NeverFreedZeRO3: "not_freed_after_forward",
                                                    KeptAfterBackwardZeRO3: "not_freed_after_backward",
                                                    UntaggedShardsZeRO3: "untagged_param_shards",
                                                    ShardOfOnlyZeRO3: "no_self_shards",
                                                    NoForwardGatherZeRO3: "not_gathered_for_forward",
                                                    LateBindingZeRO3: "not_gathered_for_forward",
                                                    FreedBeforeShardZeRO3: "freed_before_shard",
                                                    NotFreedInSetupZeRO3: "params_not_sharded",
                                                    WholeOptimizerZeRO3: "optimizer_not_sharded"})}


@pytest.fixture(scope="module")
def lab03_launch():
    cases = [(c, name == "ZeRO3") for name, (_, solution, wrong) in STAGES.items()
             for c in (solution, *wrong)]
    return SharedLaunch(lab03.train_on_rank, cases, world_size=lab03.WORLD)


def test_lab03_exercises_are_the_reference_stages():
    for name, (_, solution, _) in STAGES.items():
        stub, shipped_solution = LAB03[name]
        assert checking.unfinished_parts(stub) and not checking.unfinished_parts(shipped_solution)
        assert shipped_solution.__doc__ == solution.__doc__


@pytest.mark.parametrize("stage", list(STAGES))
def test_lab03_verdicts(stage, lab03_launch, monkeypatch):
    check, solution, wrong = STAGES[stage]
    monkeypatch.setattr(lab03, "launch", refuse_launch)
    stub = LAB03[stage][0]
    assert check(stub).mistake == "stub"
    monkeypatch.setattr(lab03, "launch", lab03_launch.launch)
    right = check(solution)
    assert right.solved, right
    assert "matches single-process training" in right.message
    for answer, mistake in wrong.items():
        verdict = check(answer)
        assert verdict.mistake == mistake, f"{answer.__name__}: {verdict}"


def test_lab03_praise_names_the_saving_of_each_stage(lab03_launch, monkeypatch):
    monkeypatch.setattr(lab03, "launch", lab03_launch.launch)
    elements, tensors = lab03.num_params()
    half = lab03.kib(4 * elements // 2)
    assert f"parameters kept: {half} of slices" in lab03.check_zero3(zero.ZeRO3).message
    assert "= 1.5x DDP's" in lab03.check_zero3(zero.ZeRO3).message
    assert f"gradients kept: {half} of slices" in lab03.check_zero2(zero.ZeRO2).message


def test_zero_arithmetic_by_hand():
    # 1000 parameters in 10 tensors on 4 ranks, fp32 + AdamW: 4 + 4 + 8 bytes each, step counters 4 B
    assert lab03.expected("DDP", 1000, 10, 4) == {"params": 4000, "grads": 4000,
                                                  "optimizer_state": 8040, "wire": 6000}
    assert lab03.expected("ZeRO-1", 1000, 10, 4)["optimizer_state"] == 2040
    assert lab03.expected("ZeRO-2", 1000, 10, 4)["grads"] == 1000
    assert lab03.expected("ZeRO-3", 1000, 10, 4) == {"params": 1000, "grads": 1000,
                                                     "optimizer_state": 2040, "wire": 9000}
    with pytest.raises(ValueError, match="unknown stage"):
        lab03.expected("ZeRO-4", 1, 1, 1)
