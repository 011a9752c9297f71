"""FSDP2 optimizer state through PyTorch's own checkpoint APIs, across world sizes.

FSDP2's parameters are DTensors, so the optimizer's state is too, and PyTorch's
``torch.distributed.checkpoint.state_dict`` functions (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``) key it by parameter name: sharded DTensors for
``torch.distributed.checkpoint``, or whole tensors. One launch on 2 ranks trains the
test Llama (and QLoRA adapters) two steps and saves both forms; launches on 1 and 4 ranks load
them and take the third step. The reference is independent of the code under test: the same
model trained in one process (its optimizer state by name, and the third step).
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab

from _optim_state_cases import TOL, build_model, build_optimizer, max_diff, one_process_run, take_step

CASES = ("plain", "qlora")
# torch 2.6's set_optimizer_state_dict loses the groups' entries ("params", "betas": KeyError) here
LOADS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 7)


def _wrap(case):
    from fsdp_lab.fsdp2 import fully_shard

    model = build_model(case)
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _model_state(model):
    from fsdp_lab.fsdp2 import dcp_state_dict

    return dcp_state_dict(model)  # NF4 weights in their own units; plain DTensors otherwise


def _trained(model):
    from fsdp_lab.fsdp2 import full_tensor

    return {n: full_tensor(p).clone() for n, p in model.named_parameters() if p.requires_grad}


# -- what the ranks run ---------------------------------------------------------------------------
def _save_on_two_ranks(folder):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in CASES:
        model = _wrap(case)
        optimizer = build_optimizer(model)
        for step in range(2):
            take_step(model, optimizer, step, rank, world)
        whole = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                     cpu_offload=True))
        if rank == 0:
            out[case] = whole
            torch.save(whole, f"{folder}/{case}.pt")
        dcp.save({"model": _model_state(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=f"{folder}/{case}")
    return out if rank == 0 else None


def _resume(folder):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from fsdp_lab.fsdp2 import load_dcp_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in CASES:
        for how in ("whole", "dcp"):
            model = _wrap(case)
            optimizer = build_optimizer(model)
            take_step(model, optimizer, 7, rank, world)  # some other state, to be replaced
            state = {"model": _model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=f"{folder}/{case}")
            load_dcp_state_dict(model, state["model"])
            if how == "dcp":
                set_optimizer_state_dict(model, optimizer, state["optim"])
            else:
                whole = torch.load(f"{folder}/{case}.pt", weights_only=True)  # every rank reads the file
                set_optimizer_state_dict(model, optimizer, whole, options=StateDictOptions(full_state_dict=True))
            take_step(model, optimizer, 2, rank, world)
            out[(case, how)] = _trained(model)
    return out if rank == 0 else None


# -- the host side --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2_optim_state")
    return folder, fsdp_lab.launch(_save_on_two_ranks, str(folder), world_size=2, timeout=300)[0]


@pytest.fixture(scope="module")
def resumed(saved):
    if not LOADS:
        pytest.skip(f"torch {torch.__version__}'s set_optimizer_state_dict loses parameter-group entries")
    folder, _ = saved
    return {world: fsdp_lab.launch(_resume, str(folder), world_size=world, timeout=300)[0] for world in (1, 4)}


@pytest.fixture(scope="module")
def one_process():
    return {case: one_process_run(case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_whole_optimizer_state_by_name_equals_one_process(saved, one_process, case):
    _, results = saved
    state = one_process[case][0]
    whole = results[case]["state"]
    assert whole.keys() == state.keys()
    for name, entry in state.items():
        assert whole[name]["exp_avg"].shape == entry["exp_avg"].shape
        assert max_diff(whole[name], entry) <= TOL, name


@pytest.mark.parametrize("world", (1, 4))
@pytest.mark.parametrize("how", ("whole", "dcp"))
@pytest.mark.parametrize("case", CASES)
def test_resuming_on_another_world_size_matches_one_process(resumed, one_process, world, how, case):
    assert max_diff(resumed[world][(case, how)], one_process[case][3]) <= TOL
