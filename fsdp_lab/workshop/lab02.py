"""Checkers for lab 02 (memory anatomy).

* ``check_predict_model_states(predict_model_states)``: ``predict_model_states(model)`` returns
  the bytes of the parameters, gradients and AdamW state a model holds after an optimizer step,
  ``{"params", "grads", "optimizer_state"}``. Reference: ``MemoryTracker`` on the live model
  after a real step (the CPU Llama in float32 and in bfloat16), in this process.
* ``check_predict_activations(predict_activations)``: ``predict_activations(config,
  batch_size, seq_len)`` returns the bytes the bfloat16 CPU Llama saves for backward in one
  forward. Reference: ``MemoryTracker``'s ``activations`` after a real forward, for two shapes.
"""

from __future__ import annotations

import torch

from fsdp_lab.workshop.checking import checker, correct, is_placeholder, mistake, placeholder_left

KEYS = ("params", "grads", "optimizer_state")
ACTIVATION_SHAPES = ((2, 64), (3, 40))  # (batch, seq) the activation check measures
SCALARS = 16  # bytes of 0-d tensors (the loss's) the formula leaves out


def measured_model_states(dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, int]]:
    """A fresh CPU Llama in ``dtype`` and what ``MemoryTracker`` counts for it after one AdamW
    step (gradients kept): bytes of params, grads and optimizer_state."""
    from fsdp_lab.memory import MemoryTracker
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with MemoryTracker(model, opt) as mt:
        model(global_batch(model.config.vocab_size, 2, 16)).loss.backward()
        opt.step()
        now = mt.current()
    return model, {k: now[k] for k in KEYS}


@checker("predict_model_states", hint="params: sum of p.numel() * p.element_size(); grads: the same; "
                                      "AdamW: exp_avg and exp_avg_sq in the parameter's dtype plus a "
                                      "4-byte float32 step per parameter tensor")
def check_predict_model_states(predict_model_states):
    """Compare with MemoryTracker after a real AdamW step, float32 and bfloat16."""
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        model, measured = measured_model_states(dtype)
        got = predict_model_states(model)
        if is_placeholder(got) or (isinstance(got, dict) and any(v is Ellipsis for v in got.values())):
            return placeholder_left("predict_model_states")
        if not isinstance(got, dict) or set(KEYS) - set(got):
            return mistake("not_a_dict", f"return a dict with the keys {', '.join(KEYS)}")
        name = str(dtype).replace("torch.", "")
        params = list(model.parameters())
        numel, tensors = sum(p.numel() for p in params), len(params)
        e = params[0].element_size()
        for key in ("params", "grads"):
            if got[key] != measured[key]:
                if got[key] == numel:
                    return mistake("counted_elements", f"{key}: you gave {got[key]:,}, the number of "
                                                       f"elements; {name} takes {e} bytes each")
                return mistake(f"wrong_{key}", f"{key} of the {name} model: you gave {got[key]:,} B, "
                                               f"measured {measured[key]:,} B")
        opt = got["optimizer_state"]
        if opt != measured["optimizer_state"]:
            if opt == 2 * numel * e:
                return mistake("no_step_counters", f"{name}: {opt:,} B is exp_avg + exp_avg_sq only; AdamW "
                                                   f"also keeps a float32 `step` tensor per parameter "
                                                   f"({tensors} tensors x 4 B)")
            if opt in (numel * e, numel * e + 4 * tensors):
                return mistake("one_moment", f"{name}: {opt:,} B counts one moment; AdamW keeps two "
                                             "(exp_avg and exp_avg_sq), each the size of the parameter")
            if e != 4 and opt == 2 * numel * e + e * tensors:
                return mistake("step_in_param_dtype", f"{name}: you counted each `step` in the parameter's "
                                                      f"dtype ({e} bytes); AdamW keeps it as a float32 "
                                                      f"tensor whatever the parameters are: {tensors} x 4 B")
            if e != 4 and opt in (2 * numel * 4, 2 * numel * 4 + 4 * tensors):
                return mistake("states_in_fp32", f"{name}: you counted the moments in float32; "
                                                 "torch.optim.AdamW creates them with zeros_like(param), "
                                                 f"in the parameter's dtype ({e} bytes)")
            return mistake("wrong_optimizer_state", f"optimizer_state of the {name} model: you gave "
                                                    f"{opt:,} B, measured {measured['optimizer_state']:,} B")
        per = (measured["params"] + measured["grads"] + measured["optimizer_state"]) / numel
        lines.append(f"{name}: {per:.2f} B per parameter")
    return correct("the bytes MemoryTracker counts after a real AdamW step, to the byte ("
                   + "; ".join(lines) + "): two moments the size of the parameters, in their dtype, "
                   "plus one 4-byte step per tensor")


def _measured_activations(batch_size: int, seq_len: int) -> int:
    from fsdp_lab.memory import MemoryTracker
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0).to(torch.bfloat16)
    x = global_batch(model.config.vocab_size, batch_size, seq_len)
    with MemoryTracker(model) as t:
        out = model(x)
        measured = t.current()["activations"]
    del out
    return measured


@checker("predict_activations", hint="per block: 2 norms x (4Td + 2eTd + 4T) + attention 4eTd + 4Th "
                                     "+ wo's input eTd + SwiGLU 4eTf; then the final norm, the "
                                     "float32 log-softmax 4TV and the int64 labels 8T the loss keeps, "
                                     "and the int64 input ids the embedding saves 8T")
def check_predict_activations(predict_activations):
    """Compare with MemoryTracker's activations after a real bf16 forward, two shapes."""
    from fsdp_lab.models.llama import LlamaConfig

    cfg = LlamaConfig.from_name("cpu")
    d, h, V, L = cfg.dim, cfg.n_heads, cfg.vocab_size, cfg.n_layers
    shown = []
    for batch_size, seq_len in ACTIVATION_SHAPES:
        measured = _measured_activations(batch_size, seq_len)
        got = predict_activations(cfg, batch_size, seq_len)
        if is_placeholder(got):
            return placeholder_left("predict_activations")
        if not isinstance(got, (int, float)):
            return mistake("not_a_number", "return the number of bytes")
        T = batch_size * seq_len
        diff = got - measured
        where = f"batch {batch_size} x seq {seq_len}: you predicted {int(got):,} B, measured {measured:,} B"
        near = lambda x: abs(diff - x) <= SCALARS  # noqa: E731
        if near(0):
            shown.append(f"{T} tokens: {measured / 2**20:.3f} MiB")
            continue
        if near(-4 * T * V):
            return mistake("no_log_softmax", f"{where}: short by 4TV, the float32 log-softmax the "
                                             "loss saves")
        if near(-4 * T * h * L):
            return mistake("no_logsumexp", f"{where}: short by 4Th per block, the float32 log-sum-exp "
                                           "per head and token that fused attention saves")
        if near(-2 * T * d * (2 * L + 1)):
            return mistake("norm_copy_in_bf16", f"{where}: short by 2Td per RMSNorm, which is either "
                                                "its input's float32 copy counted at 2 bytes (the norm "
                                                "upcasts its input to float32, 4 bytes, even in a bf16 "
                                                "model) or one of its two bf16 tensors left out (the "
                                                "normalised input cast back, or the norm's output): "
                                                "each norm saves 4Td + 2eTd + 4T")
        if near(-16 * T):
            return mistake("no_int64_tokens", f"{where}: short by 16T, the int64 input ids the embedding "
                                              "saves (to scatter its weight's gradient) and the int64 "
                                              "labels the loss keeps, 8 bytes a token each")
        if near(-8 * T):
            return mistake("no_ids_or_labels", f"{where}: short by 8T, the int64 input ids the embedding "
                                               "saves or the int64 labels the loss keeps: both count")
        if got == 2 * measured or abs(diff) > 0.5 * measured:
            return mistake("wrong_scale", f"{where}; e = 2 bytes in bfloat16, T = batch x seq")
        return mistake("wrong_total", where)
    return correct("for both shapes, to within the few bytes of scalars the loss keeps (" + ", ".join(shown)
                   + "): everything this Llama saves is linear in the tokens T, nothing is T x T "
                   "because attention is fused")
