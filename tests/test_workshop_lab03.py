"""Lab 03's checkers (DDP and ZeRO-1/2/3 by hand) fed the shipped stubs, the reference stages of
``fsdp_lab.workshop.zero`` (from which the exercises are made) and typical wrong stages; every
stage's answers run in one shared launch (``SharedLaunch``). References inside the checkers:
single-process training of the same model and the ZeRO paper's arithmetic.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fsdp_lab import collectives
from fsdp_lab.workshop import checking, lab03, zero
from fsdp_lab.workshop.zero import free_storage
from test_workshop_labs import SharedLaunch, Shipped, refuse_launch


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


class AfterStepDDP(zero.DataParallel):
    def after_step(self):
        for p in self.params:                           # the step already ran, and zero_grad
            collectives.all_reduce(p.grad, op="avg")    # set every .grad to None


class TwiceAveragedDDP(zero.DataParallel):
    def after_backward(self):
        for p in self.params:
            collectives.all_reduce(p.grad, op="avg")
            p.grad /= self.world                        # avg already divided


class LastSkippedDDP(zero.DataParallel):
    def after_backward(self):
        for p in self.params[:-1]:                      # the last parameter stays this rank's own
            collectives.all_reduce(p.grad, op="avg")


class UnwaitedDDP(zero.DataParallel):
    def after_backward(self):
        for p in self.params:                           # the handles are dropped, never waited on
            collectives.all_reduce(p.grad, op="avg", async_op=True)


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


class NoAllocZeRO3(zero.ZeRO3):
    def gather(self, unit):
        for p in unit.parameters():                     # alloc_storage(p) forgotten
            collectives.all_gather_into_tensor(p.data.reshape(-1), self.shard_of[p].detach())


class GatherAfterStepZeRO3(zero.ZeRO3):
    def after_step(self):
        for unit in self.units():                       # ZeRO-3 gathers nothing after the step
            self.gather(unit)


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
                                              TorchDistributedDDP: "no_collective",
                                              AfterStepDDP: "reduced_after_step", UnwaitedDDP: "not_waited",
                                              TwiceAveragedDDP: "averaged_twice",
                                              LastSkippedDDP: "some_gradients_wrong"}),
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
                                                    WholeOptimizerZeRO3: "optimizer_not_sharded",
                                                    NoAllocZeRO3: "gathered_into_freed",
                                                    GatherAfterStepZeRO3: "not_freed_after_backward"})}


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


def test_lab03_names_the_parameters_left_out(lab03_launch, monkeypatch):
    monkeypatch.setattr(lab03, "launch", lab03_launch.launch)
    names = list(lab03.reference().initial)
    verdict = lab03.check_ddp(LastSkippedDDP)
    assert f"the gradients of {names[-1]} differ" in verdict.message, verdict
    assert "this rank's own, not reduced" in verdict.message and f"other {len(names) - 1} are right" in verdict.message


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
