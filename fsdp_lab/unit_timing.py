"""Compute spans per unit that keep FSDP's own hooks outside them, for honest overlap numbers.

``Timeline.attach`` times a unit with module backward hooks, and those fire before a sharded
module's own pre-backward hook: a blocking all-gather issued there would sit inside the unit's
backward span and count as hidden under compute. ``attach_units`` instead

* starts a forward span in a forward pre-hook registered after FSDP's (so after the all-gather)
  and ends it in a forward hook;
* starts a backward span from a gradient hook on the unit's outputs registered after FSDP's
  (hooks on one tensor run in the order registered: FSDP's all-gather comes first);
* ends it in an identity autograd function wrapped around the unit's inputs, whose backward
  runs as soon as the input gradients exist, before FSDP's post-backward reduce-scatter.

A unit whose inputs need no gradient (token ids into the embedding) ends its backward span
after its output's own autograd node.
"""

from __future__ import annotations

import torch

from fsdp_lab.passthrough import call_after_input_grads
from fsdp_lab.precision import tensors_in

__all__ = ["attach_units"]


def attach_units(timeline, model, units) -> list:
    """Record "<name> forward" / "<name> backward" compute events on ``timeline`` for each
    (name, module) in ``units`` (call after sharding, inside ``with timeline:``).

    FSDP1 units are found inside their wrappers (``_fsdp_wrapped_module``); the output hook
    goes on the wrapper, whose forward registers FSDP1's own hooks. Returns the hook handles
    (``handle.remove()`` each when done).
    """
    outer = {}  # FSDP1 wraps a unit in a module whose forward issues the collectives
    for m in model.modules():
        inner = m._modules.get("_fsdp_wrapped_module")
        if inner is not None:
            outer[id(inner)] = m
    handles = []
    for name, module in units:
        handles += _time_unit(timeline, name, module, outer.get(id(module), module))
    return handles


def _time_unit(tl, name, module, outer) -> list:
    state = {}

    def close_backward(*_):
        if "bwd" in state:
            tl._add_raw("compute", f"{name} backward", 0, state.pop("bwd"), tl._clock.mark(), "compute",
                        {"phase": "backward", "module": name})

    def pre_forward(_m, args, kwargs):
        state["fwd"] = tl._clock.mark()
        state["inputs"] = False
        if torch.is_grad_enabled():
            # an identity whose backward runs as soon as the unit's input gradients exist,
            # before any hook other code put on those inputs
            args, kwargs, state["inputs"] = call_after_input_grads(close_backward, args, kwargs)
        return args, kwargs

    def post_forward(_m, _args, _kwargs, output):
        if "fwd" in state:
            tl._add_raw("compute", f"{name} forward", 0, state.pop("fwd"), tl._clock.mark(), "compute",
                        {"phase": "forward", "module": name})

    def outer_post_forward(_m, _args, _kwargs, output):
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        opened = []

        def open_backward(grad):
            if not opened:
                opened.append(True)
                state["bwd"] = tl._clock.mark()
            return grad

        for t in outputs:
            t.register_hook(open_backward)
        if not state.pop("inputs", None) and outputs and outputs[0].grad_fn is not None:
            # no input needs a gradient (token ids): the span ends after the output's own backward node
            outputs[0].grad_fn.register_hook(close_backward)

    return [module.register_forward_pre_hook(pre_forward, with_kwargs=True),
            module.register_forward_hook(post_forward, with_kwargs=True),
            outer.register_forward_hook(outer_post_forward, with_kwargs=True)]
