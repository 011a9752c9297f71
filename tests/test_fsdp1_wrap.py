"""FSDP1 auto-wrapping picks the units PyTorch's picks, policy by policy.

The reference is PyTorch's own ``torch.distributed.fsdp.wrap._recursive_wrap`` with PyTorch's
policy of the same settings; both wrap in a marker module (no process group needed), on models
with the cases that tell the rules apart: a shared submodule, a weight shared between two
modules, a force-leaf ``MultiheadAttention``, nested containers, ignored modules.
"""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn
from torch.distributed.fsdp import wrap as torch_wrap

from fsdp_lab.fsdp1 import wrap
from fsdp_lab.models.llama import Llama, LlamaConfig, TransformerBlock


class Unit(nn.Module):
    """Stands for a wrapper: holds the wrapped module."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.inner = module


class SharedModule(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(100, 100)
        self.a = nn.Sequential(nn.Linear(100, 100), shared)
        self.b = nn.Sequential(shared, nn.Linear(100, 100))
        self.c = nn.ModuleList([nn.ModuleList([nn.Linear(50, 50), nn.Linear(50, 50)]), nn.Linear(10, 10)])
        self.mha = nn.MultiheadAttention(64, 4)


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Sequential(nn.Linear(60, 60), nn.Linear(60, 60))
        self.y = nn.Sequential(nn.Linear(60, 60))
        self.y[0].weight = self.x[0].weight
        self.z = nn.Linear(60, 60)


MODELS = {"llama": lambda: Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0),
          "tied llama": lambda: Llama(LlamaConfig.from_name("cpu-tied", n_layers=2), seed=0),
          "shared module": SharedModule, "shared weight": SharedWeight}
IGNORED = {"none": lambda m: [], "first child": lambda m: [next(m.children())]}
# (test id, settings): ids spelled out, since a set's order (and so str) differs between processes
SIZE_SETTINGS = [(f"min{n}{label}", dict(min_num_params=n, **extra)) for n in (100, 7000, 20000, 184576)
                 for label, extra in (("", {}), ("-leaf-Sequential", {"force_leaf_modules": {nn.Sequential}}),
                                      ("-exclude-Block-ModuleList",
                                       {"exclude_wrap_modules": {TransformerBlock, nn.ModuleList}}))]
CLASS_SETS = {"Block": {TransformerBlock}, "Linear": {nn.Linear}, "Sequential-MHA": {nn.Sequential, nn.MultiheadAttention}}


def _units(model) -> list[str]:
    return sorted(name.replace("inner.", "") or "<root>" for name, m in model.named_modules() if isinstance(m, Unit))


def _ours(build, policy, ignore):
    model = build()
    ignored = {m for top in IGNORED[ignore](model) for m in top.modules()}
    wrap.recursive_wrap(model, policy, Unit, ignored, lambda m: isinstance(m, Unit))
    return _units(model)


def _pytorchs(build, policy, ignore):
    model = build()
    ignored = {m for top in IGNORED[ignore](model) for m in top.modules()}
    torch_wrap._recursive_wrap(model, policy, Unit, ignored, {p for m in ignored for p in m.parameters()},
                               only_wrap_children=True)
    return _units(model)


@pytest.mark.parametrize("ignore", IGNORED)
@pytest.mark.parametrize("settings", [s for _, s in SIZE_SETTINGS], ids=[i for i, _ in SIZE_SETTINGS])
@pytest.mark.parametrize("model", MODELS)
def test_size_based_policy_wraps_as_in_pytorch(model, settings, ignore):
    expected = _pytorchs(MODELS[model], functools.partial(torch_wrap.size_based_auto_wrap_policy, **settings), ignore)
    ours = functools.partial(wrap.size_based_auto_wrap_policy, **settings)
    assert _ours(MODELS[model], ours, ignore) == expected
    # PyTorch's own policy object gives the same units here
    theirs = functools.partial(torch_wrap.size_based_auto_wrap_policy, **settings)
    assert _ours(MODELS[model], theirs, ignore) == expected


@pytest.mark.parametrize("ignore", IGNORED)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("classes", CLASS_SETS)
def test_class_policies_wrap_as_in_pytorch(model, classes, ignore):
    classes = CLASS_SETS[classes]
    expected = _pytorchs(MODELS[model], torch_wrap.ModuleWrapPolicy(classes), ignore)
    assert _ours(MODELS[model], wrap.ModuleWrapPolicy(classes), ignore) == expected
    transformer = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls=classes)
    assert _ours(MODELS[model], transformer, ignore) == expected
