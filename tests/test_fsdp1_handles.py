"""Every FSDP1 flat-parameter implementation passes the same suite of the ``FlatHandle`` protocol.

Implementations: ``FlatParamHandle`` (ordinary float parameters) and ``NF4FlatParamHandle``
(NF4 weights, registered by ``fsdp_lab.qlora``). Each is built over the parameters of a small
module on 2 and 3 real gloo ranks (3: padding) and taken through the life cycle a unit drives
(gather, views, free, reset) and through what state dicts and ``summon_full_params`` need.
The reference is the module's own parameters before sharding: a gathered parameter must equal
them exactly, and state-dict entries must load back bit-exactly into a handle built from
other values.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab.states import ShardedState


class _Flat:
    """Float parameters: a gathered parameter is a full-shape tensor equal to the original."""

    name = "FlatParamHandle"

    @staticmethod
    def module(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7))

    @staticmethod
    def handle(infos, spec):
        from fsdp_lab.fsdp1.flat_grad import GradConfig
        from fsdp_lab.fsdp1.flat_param import FlatParamHandle

        return FlatParamHandle(infos, spec, compute_dtype=torch.float32, unit_name="suite",
                               grad_config=GradConfig(torch.float32, torch.float32, world_size=spec.size))

    @staticmethod
    def whole(tensor) -> list[torch.Tensor]:
        return [tensor.detach().clone()]


class _NF4:
    """NF4 weights: a gathered weight is an NF4Tensor with the original bytes in every inner tensor."""

    name = "NF4FlatParamHandle"

    @staticmethod
    def module(seed: int) -> nn.Module:
        from fsdp_lab.qlora import to_nf4

        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 200, bias=False))
        for layer in model:
            layer.weight = nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
        return model

    @staticmethod
    def handle(infos, spec):
        from fsdp_lab.qlora.nf4_handle import NF4FlatParamHandle

        return NF4FlatParamHandle(infos, spec, param_dtype=None, unit_name="suite")

    @staticmethod
    def whole(tensor) -> list[torch.Tensor]:
        from fsdp_lab.qlora.nf4_tensor import INNER_TENSORS

        return [getattr(tensor, name).clone() for name in INNER_TENSORS] + [tensor.dequantize()]


IMPLEMENTATIONS = {"FlatParamHandle": _Flat, "NF4FlatParamHandle": _NF4}


def _build(impl, seed: int):
    """(module, handle, originals): the handle over all of the module's parameters."""
    import torch.distributed as dist

    from fsdp_lab.fsdp1.layout import ParamInfo, ShardingSpec

    module = impl.module(seed)
    originals = [impl.whole(p) for p in module.parameters()]
    infos = [ParamInfo(name, p.shape, p.numel(), 0, p, [(module.get_submodule(name.rpartition(".")[0]),
                                                          name.rpartition(".")[2])])
             for name, p in module.named_parameters()]
    return module, impl.handle(infos, ShardingSpec.over(dist.group.WORLD, torch.device("cpu"))), originals


def _on_modules(handle) -> list:
    return [module._parameters[name] for info in handle.infos for module, name in info.uses]


def _whole_on_modules(impl, handle) -> list[list[torch.Tensor]]:
    return [impl.whole(t) for t in _on_modules(handle)]


def _equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
                                    for x, y in zip(a, b))


def _suite(impl) -> dict:
    """The protocol's life cycle on one implementation; each check is a bool (or an error text)."""
    from fsdp_lab.fsdp1.handle import FlatHandle

    module, handle, originals = _build(impl, seed=0)
    params = [info.param for info in handle.infos]
    out = {"is_a_FlatHandle": isinstance(handle, FlatHandle)}
    out["at_rest_sharded"] = handle.state == ShardedState.SHARDED and handle.unsharded_bytes() == 0 and \
        all(a is b for a, b in zip(_on_modules(handle), params))
    handle.unshard()
    out["gathering_after_unshard"] = handle.state == ShardedState.GATHERING
    handle.wait_for_unshard()
    handle.use_unsharded_views(track_grads=False)
    out["unsharded_equals_original"] = handle.state == ShardedState.UNSHARDED and handle.unsharded_bytes() > 0 and \
        _equal(_whole_on_modules(impl, handle), originals)
    handle.use_sharded_views()
    freed = handle.reshard()
    out["reshard_frees"] = freed and handle.unsharded_bytes() == 0 and handle.state == ShardedState.SHARDED and \
        all(a is b for a, b in zip(_on_modules(handle), params))
    out["reshard_twice_is_a_no_op"] = handle.reshard() is False

    # reset while an all-gather is in flight, and to_idle after forward views
    handle.unshard()
    handle.reset()
    out["reset_finishes_and_frees"] = handle.state == ShardedState.SHARDED and handle.unsharded_bytes() == 0
    handle.wait_for_unshard()
    handle.use_unsharded_views(track_grads=False)
    handle.to_idle()
    out["to_idle_puts_parameters_back"] = handle.state == ShardedState.SHARDED and \
        all(a is b for a, b in zip(_on_modules(handle), params))

    # state dict entries into a handle built from other values, bit-exactly
    entries = [handle.sharded_entry(i) for i in range(len(handle.infos))]
    _, other, other_originals = _build(impl, seed=1)
    out["other_values_differ"] = not _equal(other_originals, originals)
    for i, entry in enumerate(entries):
        other.load_sharded_entry(i, entry, f"p{i}")
    other.wait_for_unshard()
    other.use_unsharded_views(track_grads=False)
    out["sharded_entries_round_trip"] = _equal(_whole_on_modules(impl, other), originals)
    other.to_idle()
    try:
        other.load_sharded_entry(1, entries[0], "p1")
        out["wrong_entry_raises"] = "no error"
    except ValueError as error:
        out["wrong_entry_raises"] = "p1" in str(error)
    _, third, _ = _build(impl, seed=1)
    for i, value in enumerate(impl.module(0).parameters()):  # the seed-0 module again, whole
        third.load_full_entry(i, value.detach(), f"p{i}")
    third.wait_for_unshard()
    third.use_unsharded_views(track_grads=False)
    out["full_entries_load"] = _equal(_whole_on_modules(impl, third), originals)
    third.to_idle()

    # summon_full_params: whole parameters in the block (the original values), or a refusal that
    # leaves nothing gathered
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(handle.full_params(writeback=False, offload_to_cpu=False, with_grads=False,
                                                   materialize=True))
            out["full_params_shapes"] = all(tuple(p.shape) == tuple(i.shape) for p, i in zip(params, handle.infos))
            out["full_params_values"] = _equal([impl.whole(info.param) for info in handle.infos], originals)
    except NotImplementedError as error:
        out["full_params_shapes"] = f"refused: {str(error)[:40]}"
    out["after_full_params_sharded"] = handle.state == ShardedState.SHARDED and handle.unsharded_bytes() == 0 and \
        all(a is b for a, b in zip(_on_modules(handle), params))
    return out


def _rank() -> dict:
    import fsdp_lab.qlora  # noqa: F401 - registers the NF4 handle, as any QLoRA model does

    return {name: _suite(impl) for name, impl in IMPLEMENTATIONS.items()}


_LAUNCHED: dict[int, list] = {}


def _results(world: int) -> list[dict]:
    if world not in _LAUNCHED:
        _LAUNCHED[world] = fsdp_lab.launch(_rank, world_size=world, timeout=300)
    return _LAUNCHED[world]


CHECKS = ("is_a_FlatHandle", "at_rest_sharded", "gathering_after_unshard", "unsharded_equals_original",
          "reshard_frees", "reshard_twice_is_a_no_op", "reset_finishes_and_frees", "to_idle_puts_parameters_back",
          "other_values_differ", "sharded_entries_round_trip", "wrong_entry_raises", "full_entries_load",
          "after_full_params_sharded")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_every_handle_passes_the_protocol_suite(world, impl):
    for rank, result in enumerate(_results(world)):
        checks = result[impl]
        failed = {name: checks[name] for name in CHECKS if checks[name] is not True}
        assert not failed, f"rank {rank}: {failed}"


@pytest.mark.parametrize("world", [2])
def test_full_params_gives_every_handle_its_whole_original_values(world):
    for result in _results(world):
        for impl in IMPLEMENTATIONS:
            assert result[impl]["full_params_shapes"] is True, impl
            assert result[impl]["full_params_values"] is True, impl


def test_importing_fsdp1_does_not_import_qlora():
    import subprocess
    import sys

    code = ("import sys, fsdp_lab.fsdp1; "
            "print(sorted(m for m in sys.modules if m.startswith('fsdp_lab.qlora')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_nf4_type_check_outside_qlora():
    """FSDP code finds NF4 through protocols (FSDP1's handle registry, FSDP2's fsdp_* methods):
    no module outside qlora/ imports NF4Tensor or checks for it."""
    import ast
    import pathlib

    package = pathlib.Path(fsdp_lab.__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.parent.name == "qlora":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = [n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])]
            if "NF4Tensor" in names:
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert offenders == []
