"""Argument checks shared by the public API and the command line: each error names the argument."""

from __future__ import annotations

import argparse
from typing import Any


def check_bool(field: str, value: Any) -> None:
    """Raise TypeError unless ``value`` is True or False: flags given as strings ("no") or
    numbers would otherwise read as truthy and silently switch a feature on."""
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be True or False, got {value!r}")


def check_positive_int(field: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is an int >= 1 (a bool is refused: ``True`` would be read
    as 1). ``field`` names the argument in the message, e.g. ``"world_size"``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive int, got {value!r}")


def check_model_and_optimizer(owner: str, model: Any, optimizer: Any, *, required: bool = False) -> None:
    """Raise TypeError, naming the fix, unless ``model`` is a module and ``optimizer`` an
    optimizer (either may be None unless ``required``): the two passed in each other's place is
    the usual slip."""
    import torch

    if required and (model is None or optimizer is None):
        raise TypeError(f"{owner} needs a model and an optimizer, got model={type(model).__name__}, "
                        f"optimizer={type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        hint = (f" (an optimizer: pass the model first, {owner}(model, optimizer, ...))"
                if isinstance(model, torch.optim.Optimizer) else "")
        raise TypeError(f"{owner}'s model must be a torch.nn.Module, got {type(model).__name__}{hint}")
    if optimizer is not None and not (hasattr(optimizer, "state") and hasattr(optimizer, "register_step_pre_hook")):
        raise TypeError(f"{owner}'s optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def positive_int(text: str) -> int:
    """argparse ``type`` for counts (ranks, tokens): the int in ``text``. Raises
    argparse.ArgumentTypeError, which argparse turns into a usage error, for anything below 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


class StateDictMismatch(KeyError, RuntimeError):
    """A state dict whose names do not match the model's. A RuntimeError, as
    ``nn.Module.load_state_dict`` (and PyTorch's FSDP) raises for it, and a KeyError, as the names
    are what is wrong. The message is shown as written (a KeyError's would be quoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def incompatible_keys(missing: list[str], unexpected: list[str]):
    """``nn.Module.load_state_dict``'s return value: a named tuple ``(missing_keys, unexpected_keys)``."""
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(list(missing), list(unexpected))
