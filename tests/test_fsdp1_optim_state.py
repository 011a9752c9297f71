"""FSDP1 optimizer state by parameter name: whole, and sharded through DCP, across world sizes.

One launch on 2 ranks trains the test Llama two steps under each strategy (and QLoRA adapters
under FULL_SHARD), returns ``FSDP.optim_state_dict`` and saves it (whole with ``torch.save``,
sharded with ``dcp.save``). Launches on 1 and 4 ranks load it into a fresh optimizer and take
the third step. The reference is independent of the code under test: the same model trained in
one process, whose optimizer state (by parameter name) and third step must come out the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fsdp_lab
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock

from _optim_state_cases import TOL, build_model, build_optimizer, max_diff, one_process_run, take_step

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
CASES = STRATEGIES + ("qlora",)
# (case, how it is saved and loaded): NO_SHARD's ranks hold copies, so it has no DCP form
RESUMED = [(case, how) for case in CASES for how in ("whole", "dcp") if (case, how) != ("NO_SHARD", "dcp")]


def _wrap(case):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy

    strategy = "FULL_SHARD" if case == "qlora" else case
    return FullyShardedDataParallel(build_model(case), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                    sharding_strategy=ShardingStrategy[strategy])


def _full_params(model):
    from fsdp_lab.fsdp1 import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# -- what the ranks run ---------------------------------------------------------------------------
def _save_on_two_ranks(folder):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType, dcp_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in CASES:
        model = _wrap(case)
        optimizer = build_optimizer(model)
        out[(case, "before any step")] = FSDP.optim_state_dict(model, optimizer)
        take_step(model, optimizer, 0, rank, world)
        first_saved, first_whole = copy.deepcopy(optimizer.state_dict()), FSDP.optim_state_dict(model, optimizer)
        take_step(model, optimizer, 1, rank, world)
        # PyTorch's keywords: a state saved one step ago converted instead of the optimizer's own
        # (the optimizer has moved on), the model's group named
        out[(case, "first step", "passed in")] = FSDP.optim_state_dict(model, optimizer, optim_state_dict=first_saved,
                                                                        group=dist.group.WORLD)
        out[(case, "first step", "then")] = first_whole
        whole = FSDP.optim_state_dict(model, optimizer)
        out[case] = whole
        model_state = model.state_dict()
        if rank == 0:
            torch.save({"model": model_state, "optim": whole}, f"{folder}/{case}.pt")
        if case != "NO_SHARD":  # ranks holding copies have no sharded form (an error, tested below)
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                dcp.save({"model": dcp_state_dict(model), "optim": FSDP.optim_state_dict(model, optimizer)},
                         checkpoint_id=f"{folder}/{case}.dcp")
        fresh = build_optimizer(model, reverse=True)  # the same ranks load what they saved, by name
        FSDP.optim_state_dict_to_load(model, fresh, whole, load_directly=True)
        take_step(model, fresh, 2, rank, world)
        out[(case, "resumed on 2")] = _full_params(model)
    out["errors"] = _errors(f"{folder}/FULL_SHARD.dcp")
    return out if rank == 0 else None


def _resume(folder, case, how):
    """A model of other weights loads the 2-rank checkpoint (``how``: "whole" or "dcp"), takes step 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP
    from fsdp_lab.fsdp1 import dcp_state_dict, load_dcp_optim_state_dict, load_dcp_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrap(case)
    optimizer = build_optimizer(model)
    if how == "whole":
        saved = torch.load(f"{folder}/{case}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, saved["optim"]))
    else:
        state = {"model": dcp_state_dict(model)}
        dcp.load(state, checkpoint_id=f"{folder}/{case}.dcp")
        load_dcp_state_dict(model, state["model"])
        load_dcp_optim_state_dict(model, optimizer, f"{folder}/{case}.dcp")
    take_step(model, optimizer, 2, rank, world)
    params = _full_params(model)
    return params if rank == 0 else None


def _resume_all(folder):
    return {(case, how): _resume(folder, case, how) for case, how in RESUMED}


def _errors(checkpoint: str) -> dict:
    """What bad input raises, by case: (exception type, message), or None if nothing was raised."""
    import torch.distributed as dist

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType

    model = _wrap("FULL_SHARD")
    optimizer = build_optimizer(model)
    take_step(model, optimizer, 0, dist.get_rank(), dist.get_world_size())
    whole = FSDP.optim_state_dict(model, optimizer)

    def foreign_parameter():
        FSDP.optim_state_dict(model, torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1))

    def other_groups():
        one_group = torch.optim.AdamW([p for p in model.parameters()], lr=1e-3)
        FSDP.optim_state_dict_to_load(model, one_group, whole)

    def other_model():
        other = FSDP(Llama(LlamaConfig.from_name("cpu", n_layers=2, dim=64), seed=0))
        bad = build_optimizer(other)
        bad.load_state_dict(FSDP.optim_state_dict_to_load(other, bad, whole))

    def sharded_copies():
        copies = _wrap("NO_SHARD")
        with FSDP.state_dict_type(copies, StateDictType.SHARDED_STATE_DICT):
            FSDP.optim_state_dict(copies, build_optimizer(copies))

    def model_of_copies():  # the parameters' own DCP form refuses copies too
        from fsdp_lab.fsdp1 import dcp_state_dict
        dcp_state_dict(_wrap("NO_SHARD"))

    def ranks_differ(sharded=False):  # rank 1 steps SGD with momentum, rank 0 AdamW: other state keys
        other = _wrap("FULL_SHARD")
        opt = build_optimizer(other) if dist.get_rank() == 0 else torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
        take_step(other, opt, 0, dist.get_rank(), dist.get_world_size())
        kind = StateDictType.SHARDED_STATE_DICT if sharded else StateDictType.FULL_STATE_DICT
        with FSDP.state_dict_type(other, kind):
            FSDP.optim_state_dict(other, opt)

    def ranks_differ_sharded():  # an error, not a hang in the ShardedTensors' metadata exchange
        ranks_differ(sharded=True)

    def named_state_passed_in():  # optim_state_dict's own output where optimizer.state_dict() belongs
        FSDP.optim_state_dict(model, optimizer, optim_state_dict=whole)

    def another_group():
        FSDP.optim_state_dict(model, optimizer, group=dist.new_group([0, 1]))

    def named_optimizer():
        FSDP.optim_state_dict_to_load(model, optimizer, whole, is_named_optimizer=True)

    def wrong_key():
        from fsdp_lab.fsdp1 import load_dcp_optim_state_dict
        load_dcp_optim_state_dict(model, optimizer, checkpoint, key="optimizer")

    out = {}
    for fn in (foreign_parameter, other_groups, other_model, sharded_copies, model_of_copies, ranks_differ,
               ranks_differ_sharded, named_state_passed_in, another_group, named_optimizer, wrong_key):
        try:
            fn()
            out[fn.__name__] = None
        except Exception as exc:  # noqa: BLE001 - the test reads type and message
            out[fn.__name__] = (type(exc).__name__, str(exc))
    return out


# -- the host side --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("optim_state")
    results = fsdp_lab.launch(_save_on_two_ranks, str(folder), world_size=2, timeout=300)[0]
    return folder, results


@pytest.fixture(scope="module")
def resumed(saved):
    folder, _ = saved
    return {world: fsdp_lab.launch(_resume_all, str(folder), world_size=world, timeout=300)[0] for world in (1, 4)}


@pytest.fixture(scope="module")
def one_process():
    return {case: one_process_run(case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_whole_state_equals_one_process_by_name(saved, one_process, case):
    _, results = saved
    state, groups, group_names, _ = one_process[case]
    whole = results[case]
    assert whole["state"].keys() == state.keys()
    for name, entry in state.items():
        assert whole["state"][name].keys() == entry.keys()
        assert max_diff(whole["state"][name], entry) <= TOL, name
        assert whole["state"][name]["exp_avg"].shape == entry["exp_avg"].shape
    assert [{k: v for k, v in g.items() if k != "params"} for g in whole["param_groups"]] == groups
    assert [g["params"] for g in whole["param_groups"]] == group_names


@pytest.mark.parametrize("case", CASES)
def test_a_state_passed_in_is_the_one_converted(saved, case):
    _, results = saved
    passed, then, now = (results[(case, "first step", "passed in")], results[(case, "first step", "then")],
                         results[case])
    assert passed["state"].keys() == then["state"].keys()
    for name, entry in then["state"].items():
        assert max_diff(passed["state"][name], entry) == 0, name
    assert any(max_diff(passed["state"][n], now["state"][n]) > 0 for n in now["state"])  # not the current one


@pytest.mark.parametrize("case", CASES)
def test_a_fresh_optimizer_has_no_state_to_save(saved, case):
    _, results = saved
    assert results[(case, "before any step")]["state"] == {}


@pytest.mark.parametrize("case", CASES)
def test_resuming_on_the_same_ranks_matches_one_process(saved, one_process, case):
    _, results = saved
    assert max_diff(results[(case, "resumed on 2")], one_process[case][3]) <= TOL


@pytest.mark.parametrize("world", (1, 4))
@pytest.mark.parametrize("case,how", RESUMED)
def test_resuming_on_another_world_size_matches_one_process(resumed, one_process, world, case, how):
    assert max_diff(resumed[world][(case, how)], one_process[case][3]) <= TOL


@pytest.mark.parametrize("case,error,words", [
    ("foreign_parameter", "ValueError", "is not a parameter of the model"),
    ("other_groups", "ValueError", "the saved parameter groups name other parameters"),
    ("other_model", "ValueError", "is not the parameter's"),
    ("sharded_copies", "NotImplementedError", "NO_SHARD keeps copies"),
    ("model_of_copies", "NotImplementedError", "NO_SHARD keeps copies"),
    ("ranks_differ", "RuntimeError", "the ranks' optimizer states differ"),
    ("ranks_differ_sharded", "RuntimeError", "the ranks' optimizer states differ"),
    ("named_state_passed_in", "ValueError", "must be the optimizer's own state_dict()"),
    ("another_group", "ValueError", "group= names another process group than the model's"),
    ("named_optimizer", "NotImplementedError", "is_named_optimizer=True"),
    ("wrong_key", "ValueError", "no optimizer state under 'optimizer'"),
])
def test_bad_input_names_the_problem(saved, case, error, words):
    _, results = saved
    raised = results["errors"][case]
    assert raised is not None, f"{case} did not raise"
    assert raised[0] == error and words in raised[1], raised
