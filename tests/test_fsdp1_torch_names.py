"""Code written for PyTorch's FSDP1 runs on fsdp_lab's: PyTorch's option objects and state-dict settings.

``from torch.distributed.fsdp import ShardingStrategy, ...`` passed to this package's
``FullyShardedDataParallel`` means what it means to PyTorch's; ``set_state_dict_type`` with
PyTorch's ``FullStateDictConfig(offload_to_cpu, rank0_only)`` and ``FullOptimStateDictConfig``
behaves as PyTorch documents it. The references are PyTorch's own objects (field by field) and
the same model trained in one process; one launch on 2 ranks runs every distributed case.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

import fsdp_lab
from fsdp_lab.fsdp1 import api, size_based_auto_wrap_policy
from fsdp_lab.models.data import global_batch, shard_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock

TOL = 1e-6
# a block of the "cpu" Llama: attention 4 x 128 x 128 with 2 of 4 heads for k and v, SwiGLU 3 x 128 x 352, two norms
BLOCK_PARAMETERS = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352 + 2 * 128


@pytest.mark.parametrize("kind", [api.ShardingStrategy, api.BackwardPrefetch, api.StateDictType])
def test_pytorch_enum_members_become_ours_by_name(kind):
    theirs = getattr(torch_fsdp, kind.__name__)
    for member in kind:
        assert api.from_torch(theirs[member.name], kind) is member


def test_members_and_objects_pytorch_has_and_we_do_not_are_refused_or_converted():
    with pytest.raises(NotImplementedError, match="StateDictType.LOCAL_STATE_DICT is not implemented"):
        api.from_torch(torch_fsdp.StateDictType.LOCAL_STATE_DICT, api.StateDictType)
    assert api.from_torch(torch_fsdp.CPUOffload(offload_params=True), api.CPUOffload) == api.CPUOffload(True)
    theirs = torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16, cast_forward_inputs=True)
    ours = api.from_torch(theirs, api.MixedPrecision)
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads", "cast_forward_inputs",
                  "cast_root_forward_inputs"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # PyTorch's FSDP1 keeps master weights and gradients in the parameters' own dtype
    assert ours.main_params_dtype is None and ours.main_grads_dtype is None
    assert api.from_torch("FULL_SHARD", api.ShardingStrategy) == "FULL_SHARD"  # left for the type check to name


@pytest.mark.parametrize("args,error,words", [
    (("FULL_STATE_DICT",), TypeError, "state_dict_type must be StateDictType.FULL_STATE_DICT"),
    ((api.StateDictType.FULL_STATE_DICT, torch_fsdp.ShardedStateDictConfig()), RuntimeError,
     "FULL_STATE_DICT takes state_dict_config=FullStateDictConfig(...) or None"),
    ((api.StateDictType.SHARDED_STATE_DICT, None, torch_fsdp.FullOptimStateDictConfig()), RuntimeError,
     "SHARDED_STATE_DICT takes optim_state_dict_config=ShardedOptimStateDictConfig(...) or None"),
])
def test_state_dict_settings_refuse_what_pytorch_refuses(args, error, words):
    with pytest.raises(error) as info:
        api.StateDictSettings.checked(*args)
    assert words in str(info.value)


# -- one launch ---------------------------------------------------------------------------------
def _step(model, optimizer, step, rank=0, world=1):
    batch = shard_batch(global_batch(512, 4, 16, step=step), rank, world)
    model(batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _ranks():
    import torch.distributed as dist

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    model = FSDP(Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0),
                 auto_wrap_policy=TorchModuleWrapPolicy({TransformerBlock}),
                 sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
                 backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
                 cpu_offload=torch_fsdp.CPUOffload(offload_params=True), use_orig_params=True)
    out["strategy"] = (model.sharding_strategy, model.backward_prefetch, model.cpu_offload)
    out["units"] = (len(FSDP.fsdp_modules(model)), len(FSDP.fsdp_modules(model, root_only=True)))
    out["size_wrapped"] = {}
    for impl, size_policy in (("torch", torch_size_policy), ("ours", size_based_auto_wrap_policy)):
        sized = FSDP(Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0),
                     auto_wrap_policy=functools.partial(size_policy, min_num_params=BLOCK_PARAMETERS))
        out["size_wrapped"][impl] = sorted(type(u._fsdp_wrapped_module).__name__ for u in FSDP.fsdp_modules(sized))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for step in range(2):
        _step(model, optimizer, step, rank, world)
    previous = FSDP.set_state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT,
                                        torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                        torch_fsdp.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
    out["previous"] = previous.state_dict_type
    out["now"] = FSDP.get_state_dict_type(model).state_dict_config
    out["model_state"], out["optim_state"] = model.state_dict(), FSDP.optim_state_dict(model, optimizer)
    # loading under rank0_only: only rank 0's state dict is read, the others pass None
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    given = out["optim_state"] if rank == 0 else None
    fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, given))
    _step(model, fresh, 2, rank, world)
    with FSDP.state_dict_type(model, torch_fsdp.StateDictType.FULL_STATE_DICT):  # this package's default
        out["after_third_step"] = model.state_dict()
    out["restored"] = FSDP.get_state_dict_type(model).state_dict_config
    return out


@pytest.fixture(scope="module")
def ranks():
    return fsdp_lab.launch(_ranks, world_size=2, timeout=240)


@pytest.fixture(scope="module")
def one_process():
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    for step in range(2):
        _step(model, optimizer, step)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    params = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer, 2)
    return params, state, model.state_dict()


def _max_diff(got, want):
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def test_pytorch_options_mean_the_same_here(ranks):
    strategy, prefetch, offload = ranks[0]["strategy"]
    assert strategy is api.ShardingStrategy.SHARD_GRAD_OP and prefetch is api.BackwardPrefetch.BACKWARD_POST
    assert offload == api.CPUOffload(offload_params=True)
    assert ranks[0]["units"] == (3, 1)  # the root and two blocks; one outermost


def test_pytorch_size_based_policy_wraps_what_it_wraps_in_pytorch(ranks):
    # the blocks reach the size (embedding and output, 512 x 128 each, do not): two units and the root
    wrapped = ranks[0]["size_wrapped"]
    assert wrapped["torch"] == wrapped["ours"] == ["Llama", "TransformerBlock", "TransformerBlock"]


def test_rank0_only_full_state_dicts_are_on_rank_0_alone(ranks, one_process):
    params, state, _ = one_process
    assert ranks[1]["model_state"] == {} and ranks[1]["optim_state"] == {}
    assert _max_diff(ranks[0]["model_state"], params) <= TOL
    saved = ranks[0]["optim_state"]["state"]
    for name, entry in state.items():
        assert _max_diff(saved[name], entry) <= TOL, name


def test_loading_under_rank0_only_resumes_like_one_process(ranks, one_process):
    *_, after = one_process
    assert _max_diff(ranks[0]["after_third_step"], after) <= TOL
    assert _max_diff(ranks[1]["after_third_step"], after) <= TOL


def test_set_and_get_state_dict_type_report_the_settings(ranks):
    assert ranks[0]["previous"] is api.StateDictType.FULL_STATE_DICT
    assert ranks[0]["now"] == torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    assert ranks[0]["restored"] == torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)


@pytest.mark.parametrize("name,instead", [
    ("full_optim_state_dict", "use FSDP.optim_state_dict"), ("scatter_full_optim_state_dict", "use FSDP.optim_state_dict"),
    ("shard_full_optim_state_dict", "use FSDP.optim_state_dict"), ("sharded_optim_state_dict", "use FSDP.optim_state_dict"),
    ("flatten_sharded_optim_state_dict", "use FSDP.optim_state_dict"), ("rekey_optim_state_dict", "use FSDP.optim_state_dict"),
    ("register_comm_hook", "reduction is this package's own"), ("check_is_root", "outermost"),
])
def test_pytorch_methods_we_lack_name_themselves_not_the_wrapped_module(name, instead):
    # a name the wrapper lacks is looked up on the wrapped module: the error blamed 'Linear'
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    assert hasattr(torch_fsdp.FullyShardedDataParallel, name)  # PyTorch's own, in this torch
    with pytest.raises(NotImplementedError, match=f"FullyShardedDataParallel.{name} is PyTorch's and not "
                                                   f"implemented here: .*{instead}"):
        getattr(FSDP, name)(None, None)


def test_indexing_reaches_the_wrapped_sequential():
    # PyTorch's FSDP1 forwards indexing: FSDP(nn.Sequential(...))[0] is the first layer
    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP

    with fsdp_lab.simulated_world(2):
        seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        model = FSDP(seq)
        assert model[0] is seq[0] and isinstance(model[1], torch.nn.ReLU) and len(model[:1]) == 1
        with pytest.raises(TypeError, match="not subscriptable"):
            FSDP(torch.nn.Linear(4, 4))[0]
