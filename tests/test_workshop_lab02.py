"""Lab 02's checkers fed the shipped stub, the shipped solution and typical wrong answers.

Both checkers run in this process: the reference is ``MemoryTracker`` on the live CPU Llama
(after a real AdamW step; after a real bf16 forward), never the answer's own numbers.
"""

from __future__ import annotations

import torch

from fsdp_lab.workshop import lab02
from test_workshop_labs import Shipped

LAB02 = Shipped("02_memory_anatomy")


# ----------------------------------------------------------------------------- model states

def no_step_counters(model):
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params": nbytes, "grads": nbytes, "optimizer_state": 2 * nbytes}


def states_in_fp32(model):
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"params": nbytes, "grads": nbytes, "optimizer_state": 2 * 4 * sum(p.numel() for p in params)
            + 4 * len(params)}


def one_moment(model):
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"params": nbytes, "grads": nbytes, "optimizer_state": nbytes + 4 * len(params)}


def step_in_param_dtype(model):
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"params": nbytes, "grads": nbytes, "optimizer_state": 2 * nbytes + params[0].element_size() * len(params)}


def counted_elements(model):
    numel = sum(p.numel() for p in model.parameters())
    return {"params": numel, "grads": numel, "optimizer_state": 2 * numel}


def test_predict_model_states_verdicts():
    stub, solution = LAB02["predict_model_states"]
    assert lab02.check_predict_model_states(stub).mistake == "stub"
    right = lab02.check_predict_model_states(solution)
    # fp32: 4 + 4 + 8 B per parameter plus 4 B per tensor of 869,504 parameters in 39 tensors
    assert right.solved and "float32: 16.00 B per parameter" in right.message
    assert "bfloat16: 8.00 B per parameter" in right.message
    assert lab02.check_predict_model_states(no_step_counters).mistake == "no_step_counters"
    assert lab02.check_predict_model_states(one_moment).mistake == "one_moment"
    assert lab02.check_predict_model_states(counted_elements).mistake == "counted_elements"
    # correct in float32, wrong for the bf16 model
    assert lab02.check_predict_model_states(states_in_fp32).mistake == "states_in_fp32"
    step = lab02.check_predict_model_states(step_in_param_dtype)   # right in float32 only
    assert step.mistake == "step_in_param_dtype" and "39 x 4 B" in step.message


def test_model_states_reference_is_the_hand_count():
    _, measured = lab02.measured_model_states(torch.float32)
    # CPU Llama: 869,504 parameters in 3 + 4 * 9 = 39 tensors, float32
    assert measured == {"params": 869_504 * 4, "grads": 869_504 * 4, "optimizer_state": 2 * 869_504 * 4 + 39 * 4}


# ----------------------------------------------------------------------------- activations

def _formula(config, batch_size, seq_len, *, e=2, norm_fp32=4, norm_bf16=2, lse=True, log_softmax=True,
             ids=True, labels=True):
    T, d, f, h, V = batch_size * seq_len, config.dim, config.ffn_hidden, config.n_heads, config.vocab_size
    norm = norm_fp32 * T * d + norm_bf16 * e * T * d + 4 * T
    block = 2 * norm + 4 * e * T * d + (4 * T * h if lse else 0) + e * T * d + 4 * e * T * f
    return (config.n_layers * block + norm + (4 * T * V if log_softmax else 0) + (8 * T if ids else 0)
            + (8 * T if labels else 0))


def test_predict_activations_verdicts():
    stub, solution = LAB02["predict_activations"]
    assert lab02.check_predict_activations(stub).mistake == "stub"
    right = lab02.check_predict_activations(solution)
    assert right.solved and "for both shapes" in right.message
    check = lab02.check_predict_activations
    assert check(lambda c, b, s: _formula(c, b, s, log_softmax=False)).mistake == "no_log_softmax"
    assert check(lambda c, b, s: _formula(c, b, s, lse=False)).mistake == "no_logsumexp"
    # short by 2Td per norm: the float32 copy counted in bf16, or one of the two bf16 tensors left out
    for short in (dict(norm_fp32=2), dict(norm_bf16=1)):
        norm = check(lambda c, b, s: _formula(c, b, s, **short))
        assert norm.mistake == "norm_copy_in_bf16", norm
        assert "float32 copy counted at 2 bytes" in norm.message
        assert "normalised input cast back, or the norm's output" in norm.message
    for missing in (dict(ids=False), dict(labels=False)):
        one = check(lambda c, b, s: _formula(c, b, s, **missing))
        assert one.mistake == "no_ids_or_labels" and "input ids the embedding saves" in one.message
    neither = check(lambda c, b, s: _formula(c, b, s, ids=False, labels=False))
    assert neither.mistake == "no_int64_tokens" and "labels the loss keeps" in neither.message
    assert check(lambda c, b, s: _formula(c, b, s, e=4, norm_fp32=4)).mistake in ("wrong_scale", "wrong_total")
