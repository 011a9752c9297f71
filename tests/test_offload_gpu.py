"""CPU offload under both FSDPs, where it can be seen: on a GPU rank.

On CPU ranks offloading moves nothing (the compute device is the host), so the CPU tests that
train with offload cannot tell it from no offload. Here, on one CUDA rank, the sharded parameters,
their gradients and AdamW's state must live in host memory, the GPU must hold less than half the
model's parameter bytes after a step (nothing of the model but its buffers stays there), and three
steps must give one process's losses on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.models import Llama, TransformerBlock, global_batch

STEPS = 3


def _train(model, device) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    losses = []
    for step in range(STEPS):
        loss = model(global_batch(512, 8, 32, step=step).to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept, to see where they live
        losses.append(loss.item())
    state_devices = {t.device.type for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    return losses, state_devices


def _offloaded_runs():
    from fsdp_lab.fsdp1 import CPUOffload, FullyShardedDataParallel as FSDP, ModuleWrapPolicy
    from fsdp_lab.fsdp2 import CPUOffloadPolicy, fully_shard

    device = torch.device("cuda", torch.cuda.current_device())
    out = {"reference": _train(Llama("cpu", seed=0).to(device), device)[0]}
    whole_bytes = sum(p.numel() * p.element_size() for p in Llama("cpu", seed=0).parameters())
    for name in ("fsdp2", "fsdp1"):
        torch.cuda.synchronize()
        if name == "fsdp2":
            model = Llama("cpu", seed=0)
            for block in model.layers:
                fully_shard(block, offload_policy=CPUOffloadPolicy())
            fully_shard(model, offload_policy=CPUOffloadPolicy())
        else:
            model = FSDP(Llama("cpu", seed=0), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                         cpu_offload=CPUOffload(offload_params=True), device_id=device.index)
        before = torch.cuda.memory_allocated()
        losses, state_devices = _train(model, device)
        torch.cuda.synchronize()
        locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters())]
        out[name] = {"losses": losses, "param_devices": {p.device.type for p in locals_},
                     "grad_devices": {g.device.type for g in grads if g is not None}, "state_devices": state_devices,
                     "gpu_bytes_kept": torch.cuda.memory_allocated() - before, "whole_bytes": whole_bytes}
    return out


@pytest.mark.gpu
def test_cpu_offload_keeps_the_sharded_states_in_host_memory_and_trains_as_one_process():
    out = fsdp_lab.launch(_offloaded_runs, world_size=1, timeout=300)[0]
    reference = out["reference"]
    for name in ("fsdp2", "fsdp1"):
        run = out[name]
        assert run["param_devices"] == {"cpu"}, (name, run)
        assert run["grad_devices"] == {"cpu"}, (name, run)
        assert run["state_devices"] == {"cpu"}, (name, run)
        # nothing of the model stays on the GPU between steps (at most a freed block's cached bytes
        # are reused; allocated bytes count only live tensors)
        assert run["gpu_bytes_kept"] < run["whole_bytes"] // 2, (name, run)
        for a, b in zip(reference, run["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (name, reference, run["losses"])
