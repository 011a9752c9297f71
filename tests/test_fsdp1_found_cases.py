"""fsdp_lab.fsdp1 in cases a differential test against one process found broken, each checked
against the same model trained in this process: a unit that sits out the synced microbatch of
``no_sync`` (every strategy, both gradient accumulation modes), a unit called twice under
activation checkpointing (both kinds), a DCP checkpoint with a parameter without elements.

One 2-rank launch (module-scoped fixture) runs every case and returns plain values.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from fsdp_lab import launch

WORLD = 2
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


# --- what each rank runs ---------------------------------------------------------------------------
class _TwoBranches(torch.nn.Module):
    """Which branch runs is the caller's choice: a unit can sit out a microbatch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.b1, self.b2, self.head = (torch.nn.Linear(4, 5), torch.nn.Linear(5, 5),
                                                 torch.nn.Linear(5, 5), torch.nn.Linear(5, 3))

    def forward(self, x, use_b1: bool):
        return self.head(torch.tanh((self.b1 if use_b1 else self.b2)(torch.tanh(self.inp(x)))))


# per step, the branch each of two microbatches takes: step 0's b1 runs only under no_sync(), so
# its gradient must still reach step 0's update (and not step 1's)
BRANCH_PLAN = [(True, False), (True, True)]


def _branch_batch(step: int, micro: int):
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)


def _branches_run(strategy_name: str, mode: str) -> dict:
    """Two SGD steps of two microbatches, the first under no_sync(), on _TwoBranches."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs = dict(sharding_strategy=getattr(ShardingStrategy, strategy_name), grad_accumulation=mode)
    model = _TwoBranches()
    model.b1, model.b2 = FSDP(model.b1, **kwargs), FSDP(model.b2, **kwargs)
    model = FSDP(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    for step, plan in enumerate(BRANCH_PLAN):
        for micro, use_b1 in enumerate(plan):
            x, y = _branch_batch(step, micro)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                (torch.nn.functional.mse_loss(model(x[rows], use_b1), y[rows]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


class _CheckpointedTwice(torch.nn.Module):
    """One unit called twice in forward, each call under activation checkpointing."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blk, self.head = torch.nn.Linear(4, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.blk(t)), h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointed_twice_run(reentrant: bool) -> dict:
    """One SGD step, the inner unit FULL_SHARD (freed after each forward, recomputed in backward)."""
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _CheckpointedTwice(reentrant)
    model.blk = FSDP(model.blk)
    model = FSDP(model)
    x, y = _branch_batch(0, 0)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model.state_dict()


class _WithEmptyParameter(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.linear, self.empty = torch.nn.Linear(4, 3), torch.nn.Parameter(torch.randn(0, 3))


def _dcp_with_an_empty_parameter() -> dict:
    """dcp.save of dcp_state_dict, then dcp.load into a model of other values: its state after."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, dcp_state_dict, load_dcp_state_dict

    folder = [tempfile.mkdtemp(prefix="fsdp1_dcp_empty_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    saved, loaded = FSDP(_WithEmptyParameter(seed=0)), FSDP(_WithEmptyParameter(seed=1))
    dcp.save(dcp_state_dict(saved), checkpoint_id=folder[0])
    state = dcp_state_dict(loaded)
    dcp.load(state, checkpoint_id=folder[0])
    load_dcp_state_dict(loaded, state)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    with FSDP.summon_full_params(loaded):
        return {n: p.detach().clone() for n, p in loaded.named_parameters()}


def run_rank() -> dict:
    return {"branches": {(s, mode): _branches_run(s, mode) for s in STRATEGIES for mode in ("flat", "concat")},
            "checkpointed_twice": {reentrant: _checkpointed_twice_run(reentrant) for reentrant in (False, True)},
            "dcp_empty_parameter": _dcp_with_an_empty_parameter()}


@pytest.fixture(scope="module")
def results():
    return launch(run_rank, world_size=WORLD, timeout=300)


# --- references worked in this process ----------------------------------------------------------------
def _branches_reference() -> dict[str, torch.Tensor]:
    model = _TwoBranches()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, plan in enumerate(BRANCH_PLAN):
        for micro, use_b1 in enumerate(plan):
            x, y = _branch_batch(step, micro)
            (torch.nn.functional.mse_loss(model(x, use_b1), y) / 2).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()



# --- the cases ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["flat", "concat"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_unit_that_ran_only_under_no_sync_is_reduced_into_its_step(results, strategy, mode):
    # b1 runs in step 0's first microbatch only (under no_sync): one process sums that gradient
    # into step 0's update; a gradient left unreduced would be lost there and added to step 1's
    reference = _branches_reference()
    for rank, result in enumerate(results):
        state = result["branches"][(strategy, mode)]
        for key, value in reference.items():
            assert (state[key] - value).abs().max().item() <= 1e-6, (strategy, mode, rank, key)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_unit_called_twice_under_checkpointing_trains_like_one_process(results, reentrant):
    # the second call is recomputed after the unit's backward began: its weights must stay gathered
    model = _CheckpointedTwice(reentrant)
    x, y = _branch_batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for rank, result in enumerate(results):
        state = result["checkpointed_twice"][reentrant]
        for key, value in model.state_dict().items():
            assert (state[key] - value).abs().max().item() <= 1e-6, (reentrant, rank, key)


def test_a_dcp_checkpoint_with_an_empty_parameter_round_trips(results):
    # the empty parameter has no range on any rank: as a ShardedTensor DCP refused the whole save
    expected = dict(_WithEmptyParameter(seed=0).named_parameters())
    for result in results:
        got = result["dcp_empty_parameter"]
        assert set(got) == set(expected) and got["empty"].shape == (0, 3)
        assert all(torch.equal(got[n], p.detach()) for n, p in expected.items())
