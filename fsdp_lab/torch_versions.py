"""What differs between the torch releases fsdp_lab runs on (pyproject: torch >= 2.6), kept here
so the FSDPs read as if there were one.

Both FSDPs refill storage that autograd may have saved in forward (an all-gather into the
unsharded parameters). That refill is not a change to the values autograd saw, so the version
counters autograd checks at backward must read as before it. Newer releases take a tuple of
tensors for that (2.11, 2.13 and 2.14 checked); torch 2.6 takes one tensor at a time. Which form
this torch takes is tried once, at import.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["set_version", "versions_kept"]


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Set ``tensor``'s autograd version counter to ``version`` (an int, as ``tensor._version``)."""
    if _TUPLES:
        torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))
    else:
        torch._C._autograd._unsafe_set_version_counter(tensor, version)


def versions_kept(tensors: list[torch.Tensor]):
    """A context manager after which every tensor of ``tensors`` has the version counter it had
    when the context was made. Under ``torch.inference_mode`` it does nothing: nothing this pass
    makes is saved for a backward, and an inference tensor has no version counter."""
    if torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    if _TUPLES:
        return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))
    stack = contextlib.ExitStack()
    for tensor in tensors:
        stack.enter_context(torch.autograd._unsafe_preserve_version_counter(tensor))
    return stack


def _takes_tuples() -> bool:
    probe = torch.empty(0)
    try:
        torch._C._autograd._unsafe_set_version_counter((probe,), (probe._version,))
        return True
    except TypeError:  # torch 2.6: (tensor, version) only
        return False


_TUPLES = _takes_tuples()
