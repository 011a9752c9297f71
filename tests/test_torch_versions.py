"""The version-counter helpers both FSDPs use through an all-gather's refill, on the torch
installed (CI's takes tuples; torch 2.6 one tensor at a time: the per-tensor path is checked
here too where this torch still accepts a single tensor)."""

import pytest
import torch

from fsdp_lab import torch_versions


@pytest.mark.parametrize("tuples", [True, False])
def test_versions_kept_undoes_the_refills_count(monkeypatch, tuples):
    if tuples and not torch_versions._TUPLES:
        pytest.skip(f"torch {torch.__version__} keeps one tensor's counter per context only")
    monkeypatch.setattr(torch_versions, "_TUPLES", tuples)
    a, b = torch.zeros(3), torch.zeros(2)
    a.add_(1)
    before = (a._version, b._version)
    with torch_versions.versions_kept([a, b]):
        a.copy_(torch.ones(3))
        b.copy_(torch.ones(2))
        assert a._version > before[0] and b._version > before[1]
    assert (a._version, b._version) == before
    assert a.tolist() == [1.0] * 3 and b.tolist() == [1.0] * 2  # the refill itself stays


def test_set_version_sets_the_counter_autograd_checks():
    weight = torch.zeros(4, requires_grad=True)
    full = torch.ones(4)
    saved_at = full._version
    loss = (weight * full).sum()  # autograd saves ``full`` for weight's gradient
    full.copy_(torch.full((4,), 2.0))  # written in place after it was saved: autograd refuses it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(retain_graph=True)
    torch_versions.set_version(full, saved_at)
    loss.backward()
    assert weight.grad.tolist() == [2.0] * 4  # it reads the storage as it is now
