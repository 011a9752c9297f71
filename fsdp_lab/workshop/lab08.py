"""Checkers for lab 08 (QLoRA).

* ``check_nearest_code(nearest_code)``: the NF4 lookup, value in [-1, 1] -> index of the
  nearest code, an exact tie going to the lower code. Reference: ``fsdp_lab.qlora.nf4``'s
  ``nearest_nf4_code`` (checked against bitsandbytes' code book and tie rule in
  ``tests/test_nf4.py``) on random values, the 16 codes themselves and the 15 exact midpoints.
* ``check_lora_forward(lora_forward)``: one LoRA linear on a frozen NF4 weight,
  ``x Wᵀ + (alpha / rank) · x Aᵀ Bᵀ``, and its gradients. Reference: ``LoRALinear`` on the same
  tensors. B is random here, not zero as at initialisation: a zero B hides every mistake in the
  update.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.workshop.checking import checker, correct, mistake

TOLERANCE = 1e-5  # float32 sums in a different order


def nearest_code_cases() -> torch.Tensor:
    """The values every answer is tried on (float32): 10,000 uniform in [-1, 1], the 16 codes,
    and the 15 exact midpoints between neighbouring codes (the ties)."""
    from fsdp_lab.qlora.nf4 import NF4_CODEBOOK

    generator = torch.Generator().manual_seed(3)
    uniform = torch.rand(10_000, generator=generator) * 2 - 1
    return torch.cat([uniform, NF4_CODEBOOK, _midpoints()])


def _midpoints() -> torch.Tensor:
    from fsdp_lab.qlora.nf4 import NF4_CODEBOOK

    return (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2


@checker("nearest_code", hint="midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2; a value's code is "
                              "how many midpoints lie strictly below it")
def check_nearest_code(nearest_code):
    from fsdp_lab.qlora.nf4 import nearest_nf4_code

    values = nearest_code_cases()
    got = nearest_code(values.clone())
    if not isinstance(got, torch.Tensor) or got.shape != values.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return mistake("shape", f"for {values.numel()} values it returned {shape}; return one index per "
                                "value, same shape as the input")
    if got.is_floating_point():
        return mistake("float_codes", f"it returned {got.dtype} values; a code is an integer index 0..15 "
                                      "(uint8, so two fit in one byte)",
                       "return the count of midpoints below each value, as torch.uint8")
    got, want = got.long(), nearest_nf4_code(values).long()
    wrong = got != want
    if not wrong.any():
        return correct(f"all {values.numel():,} values agree with fsdp_lab's lookup, the 15 exact ties "
                       "included: each value goes to its nearest normal quantile, so the 16 codes are dense "
                       "near 0, where most weights are")
    ties = torch.isin(values, _midpoints())
    first = int(wrong.nonzero()[0])
    example = f"e.g. {values[first].item():+.6f} -> {got[first].item()}, want {want[first].item()}"
    if bool(ties[wrong].all()):
        if bool((got[ties] == want[ties] + 1).all()):
            return mistake("ties_up", f"only the {int(wrong.sum())} exact midpoints differ ({example}): a "
                                      "value halfway between two codes went to the upper one; bitsandbytes and "
                                      "torchao send it to the lower",
                           "count midpoints strictly below the value (`>`, not `>=`)")
        return mistake("tie_rounding", f"only exact midpoints differ ({example}): distances to two codes "
                                       "round differently in float32 at a tie, so argmin picks either side",
                       "compare each value with the 15 float32 midpoints instead of measuring distances")
    uniform = torch.round((values + 1) / 2 * 15).long()
    if torch.equal(got, uniform):
        return mistake("uniform", f"{int(wrong.sum())} values differ ({example}): that is an evenly spaced "
                                  "grid; NF4's codes are normal quantiles, closer together near 0",
                       "look the values up in NF4_CODEBOOK itself")
    if torch.equal(got, 15 - want):
        return mistake("reversed", f"every index is mirrored ({example}): code 0 is -1.0 and code 15 is +1.0")
    return mistake("wrong", f"{int(wrong.sum())} of {values.numel():,} values differ ({example})")


def lora_case(seed: int = 0) -> dict:
    """The tensors a LoRA forward is checked on: an NF4 weight (32 x 48), A (4 x 48) and B
    (32 x 4) both random, alpha 8, rank 4, and an input of shape (2, 3, 48)."""
    from fsdp_lab.qlora import to_nf4

    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, 3, 48, generator=g),
            "weight": to_nf4(torch.randn(32, 48, generator=g) * 0.1),
            "lora_a": torch.randn(4, 48, generator=g) * 0.1,
            "lora_b": torch.randn(32, 4, generator=g) * 0.1,
            "alpha": 8.0, "rank": 4}


def _reference(case: dict):
    """LoRALinear's output and its gradients for A and B (loss: the output's sum)."""
    from fsdp_lab.qlora import LoRALinear

    base = nn.Linear(48, 32, bias=False)
    base.weight = nn.Parameter(case["weight"], requires_grad=False)
    layer = LoRALinear(base, rank=case["rank"], alpha=case["alpha"])
    with torch.no_grad():
        layer.lora_a.copy_(case["lora_a"])
        layer.lora_b.copy_(case["lora_b"])
    out = layer(case["x"])
    out.sum().backward()
    return out.detach(), layer.lora_a.grad, layer.lora_b.grad


def _explain_lora(error: BaseException, text: str):
    if "cannot be multiplied" in text or "size mismatch" in text or "shape" in text and "mat" in text:
        return mistake("order", f"the shapes do not chain ({text.splitlines()[0]}): A is rank x in and B is "
                                "out x rank, so x goes through A first (in -> rank), then B (rank -> out)",
                       "update = F.linear(F.linear(x, lora_a), lora_b)")
    if "NF4Tensor" in text or "NF4" in text and "NotImplementedError" in text:
        return mistake("nf4_op", f"an NF4 weight supports few ops ({text.splitlines()[0]}); F.linear(x, weight) "
                                 "dequantizes it for you", "base = F.linear(x, weight)")
    return None


@checker("lora_forward", hint="the frozen weight's output (F.linear dequantizes an NF4 weight) plus x through "
                              "lora_a, then lora_b, times alpha / rank",
         explain=_explain_lora)
def check_lora_forward(lora_forward):
    case = lora_case()
    want, want_grad_a, want_grad_b = _reference(case)
    lora_a = case["lora_a"].clone().requires_grad_(True)
    lora_b = case["lora_b"].clone().requires_grad_(True)
    got = lora_forward(case["x"], case["weight"], lora_a, lora_b, case["alpha"], case["rank"])
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return mistake("shape", f"for x of shape {tuple(case['x'].shape)} it returned {shape}, want {tuple(want.shape)}")
    x, w, a, b = case["x"], case["weight"], case["lora_a"], case["lora_b"]
    base, update = F.linear(x, w), F.linear(F.linear(x, a), b)
    scaling = case["alpha"] / case["rank"]
    if not torch.allclose(got.detach(), want, atol=TOLERANCE, rtol=0):
        candidates = [("no_scaling", base + update, "the update was added unscaled"),
                      ("alpha_only", base + update * case["alpha"], "the update was scaled by alpha, not alpha / rank"),
                      ("inverted_scaling", base + update / scaling, "the update was scaled by rank / alpha"),
                      ("base_only", base, "only the frozen weight's output: the adapters were left out"),
                      ("update_only", update * scaling, "only the adapters' update: the frozen weight's output "
                                                        "x Wᵀ was left out")]
        for name, value, what in candidates:
            if torch.allclose(got.detach(), value, atol=TOLERANCE, rtol=0):
                return mistake(name, f"{what}; with alpha {case['alpha']:g} and rank {case['rank']} the update "
                                     f"is multiplied by {scaling:g}")
        error = (got.detach() - want).abs().max().item()
        return mistake("wrong", f"largest difference from LoRALinear: {error:.3g}")
    if not got.requires_grad:
        return mistake("detached", "the output carries no gradient: the update was computed under no_grad or "
                                   "detached, so A and B would never train",
                       "keep lora_a and lora_b in the autograd graph")
    got.sum().backward()
    if lora_a.grad is None or lora_b.grad is None:
        return mistake("detached", "lora_a or lora_b got no gradient; the update must use them directly")
    if not (torch.allclose(lora_a.grad, want_grad_a, atol=TOLERANCE, rtol=0)
            and torch.allclose(lora_b.grad, want_grad_b, atol=TOLERANCE, rtol=0)):
        return mistake("gradients", "the output is right but A's or B's gradient is not; compute the output "
                                    "from lora_a and lora_b themselves")
    return correct(f"output and gradients of A and B match LoRALinear (to {TOLERANCE:g}) with a random B: the "
                   f"frozen NF4 weight gets no gradient, the update is scaled by alpha / rank = {scaling:g}, "
                   "and only the r·(in + out) adapter values train")
