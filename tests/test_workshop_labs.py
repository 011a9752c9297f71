"""What every lab's checker tests share (``Shipped``, ``SharedLaunch``, ``refuse_launch``), and lab
00's verdicts; each other lab's are in ``test_workshop_labNN.py``.

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
from fsdp_lab.workshop import checking, lab00
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


def sum_over_world(values):
    import torch.distributed as dist
    total = values.sum().clone()
    collectives.all_reduce(total)
    return (total / dist.get_world_size()).item()       # the ranks hold different numbers of values


def mean_on_rank_zero(values):
    import torch.distributed as dist
    totals = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=values.dtype)])
    collectives.all_reduce(totals)
    return (totals[0] / totals[1]).item() if dist.get_rank() == 0 else None


def unwaited_mean(values):
    totals = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=values.dtype)])
    collectives.all_reduce(totals, async_op=True)       # the handle is dropped: never waited on
    return (totals[0] / totals[1]).item()


LAB00 = Shipped("00_start_here")


@pytest.fixture(scope="module")
def lab00_launch():
    solution = LAB00["global_mean"][1]
    return SharedLaunch(lab00._run_global_mean, [(solution,), (mean_of_means,), (local_mean,),
                                                 (sum_of_values,), (integer_mean,),
                                                 (gather_objects_mean,), (gather_to_one_mean,),
                                                 (gather_tensor_mean,), (unwaited_mean,),
                                                 (sum_over_world,), (mean_on_rank_zero,)],
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
    per_rank = lab00.check_global_mean(sum_over_world)
    assert per_rank.mistake == "divided_by_world" and "29.3333, the sum of all values divided" in per_rank.message
    only_zero = lab00.check_global_mean(mean_on_rank_zero)
    assert only_zero.mistake == "not_a_number" and "ranks 1, 2 returned NoneType" in only_zero.message
    unwaited = lab00.check_global_mean(unwaited_mean)
    assert unwaited.mistake == "not_waited" and "issued all_reduce with async_op=True" in unwaited.message
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
