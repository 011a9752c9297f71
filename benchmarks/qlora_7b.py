"""QLoRA peak memory at Llama-2-7B scale, per rank, beside Answer.AI's published 4.98 GiB.

    PYTHONPATH=. python benchmarks/qlora_7b.py                  # CPU: estimator + fake-tensor run
                                                                # -> benchmarks/results/qlora_7b_estimate_cpu.json
    PYTHONPATH=. python benchmarks/qlora_7b.py --device cuda    # GPU: real random init, measured
                                                                # -> benchmarks/results/qlora_7b_cuda.json

The setting (Answer.AI fsdp_qlora benchmarks, FSDP1 + bitsandbytes on 2 x 24 GB GPUs, 4.98 GiB
peak per GPU): Llama-2-7B shapes, random weights (no download), QLoRA rank 8 on q, k, v, o,
gate, up, down (wq, wk, wv, wo, w1, w3, w2 here), AdamW on the adapters, batch 1, context 512,
gradient checkpointing, bf16 compute, a world of 2.

Without a GPU the script reports for rank 0: ``fsdp_lab.memory.estimate`` (shapes only) and a
run of two training steps of our FSDP2 and of our FSDP1 under ``FakeTensorMode`` in
``fsdp_lab.simulated_world(2)``, measured by ``MemoryTracker`` (fake tensors carry shapes,
dtypes and storage sizes but no data, so the tracker sees every allocation of the real step;
on the small CPU Llama the two agree to the byte with a real run). Both are estimates, labelled
as such in the JSON. The GPU path (real 7B random init on CUDA in a simulated world of 2,
``torch.cuda.max_memory_allocated`` over the second step, for our FSDP2 and FSDP1) ran on one
H100 (``benchmarks/gpu_all.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fsdp_lab  # noqa: E402
from fsdp_lab.memory.estimate import estimate  # noqa: E402
from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing  # noqa: E402
from fsdp_lab.qlora import apply_lora  # noqa: E402

GIB = 2**30
PUBLISHED_GIB = 4.98  # Answer.AI fsdp_qlora: Llama-2-7B, QLoRA, FSDP1 + bitsandbytes, 2 x 24 GB, bs 1, ctx 512
SETTING = dict(config="llama2-7b", world_size=2, lora_rank=8, batch_size=1, seq_len=512,
               activation_checkpointing=True, dtype="bfloat16", optimizer="adamw (adapters only)")


def build_model(device: str | torch.device, fake: bool) -> Llama:
    """Llama-2-7B in bf16 with QLoRA applied: NF4 base weights, rank-8 adapters, checkpointing.

    On a real device the model is built on meta and initialised in place (13.5 GB of bf16 before
    quantization, freed linear by linear as ``apply_lora`` replaces the weights)."""
    cfg = LlamaConfig.from_name("llama2-7b")
    if fake:  # .to(dtype) cannot swap fake parameters: build in bf16 directly
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Llama(cfg, seed=0)
        finally:
            torch.set_default_dtype(default)
    else:
        with torch.device("meta"):
            model = Llama(cfg, seed=0)
        model = model.to(torch.bfloat16).to_empty(device=device)
        model.init_weights(0, generator_device=device)
    torch.manual_seed(0)
    apply_lora(model, rank=SETTING["lora_rank"], alpha=16, quantize_base=True)
    apply_activation_checkpointing(model)
    return model


def train_two_steps(model, device, strategy: str, measure):
    """Shard with ``strategy`` ("fsdp2" or "fsdp1"), run one step, then one step under ``measure``."""
    if strategy == "fsdp2":
        from fsdp_lab.fsdp2 import fully_shard
        from fsdp_lab.fsdp2.fully_shard import _default_mesh

        mesh = _default_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from fsdp_lab.fsdp1 import FullyShardedDataParallel, ModuleWrapPolicy
        from fsdp_lab.models.llama import TransformerBlock

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (SETTING["batch_size"], SETTING["seq_len"]), generator=g).to(device)

    def step():
        model(ids, ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with measure(model, optimizer) as result:
        step()
    return result


def fake_run(strategy: str) -> dict:
    """Rank 0 of a simulated world of 2, every tensor fake; MemoryTracker over the second step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_lab.fsdp2.fully_shard import _default_mesh
    from fsdp_lab.memory.tracker import MemoryTracker

    @contextlib.contextmanager
    def tracked(model, optimizer):
        out = {}
        with MemoryTracker(model, optimizer) as tracker:
            yield out
        r = tracker.result()
        out.update(peak_bytes=r.peak_total, peak_by_category=r.peak)

    with fsdp_lab.simulated_world(SETTING["world_size"]):
        _default_mesh()  # the mesh is built from real tensors, before fake mode
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = build_model("cpu", fake=True)
            return train_two_steps(model, "cpu", strategy, tracked)


def cuda_run(strategy: str) -> dict:
    """Rank 0 of a simulated world of 2 on one GPU: peak of torch.cuda.max_memory_allocated."""

    @contextlib.contextmanager
    def peak(model, optimizer):
        out = {}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), steady_bytes=base)

    gc.collect()
    torch.cuda.empty_cache()
    with fsdp_lab.simulated_world(SETTING["world_size"]):
        model = build_model("cuda", fake=False)
        return train_two_steps(model, "cuda", strategy, peak)


def estimated(strategy: str) -> dict:
    b = estimate("llama2-7b", world_size=2, strategy=strategy, param_dtype=torch.bfloat16, qlora=True,
                 lora_rank=8, batch_size=1, seq_len=512, activation_checkpointing=True)
    return {"peak_bytes": b.total, "peak_gib": round(b.total / GIB, 3), "phase": b.phase,
            "by_category": {k: v for k, v in b.bytes.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    result = {"setting": SETTING, "published_gib": PUBLISHED_GIB,
              "published_source": "Answer.AI fsdp_qlora benchmarks: FSDP1 + bitsandbytes, 2x24GB GPUs",
              "torch": torch.__version__, "machine": platform.machine(),
              "estimate": {s: estimated(s) for s in ("fsdp2", "fsdp1_full_shard")}}
    if args.device == "cpu":
        for strategy in ("fsdp2", "fsdp1"):
            t0 = time.perf_counter()
            fake = fake_run(strategy)
            fake["peak_gib"] = round(fake["peak_bytes"] / GIB, 3)
            fake["seconds"] = round(time.perf_counter() - t0, 1)
            result[f"fake_tensor_run_{strategy}"] = fake
        result["gpu"] = "not run: no CUDA device here; run with --device cuda on a GPU machine"
        name = "qlora_7b_estimate_cpu.json"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA device")
        result["gpu"] = torch.cuda.get_device_name()
        result["measured"] = {}
        for strategy in ("fsdp2", "fsdp1"):
            try:
                r = cuda_run(strategy)
                r["peak_gib"] = round(r["peak_bytes"] / GIB, 3)
            except (NotImplementedError, TypeError, ValueError) as exc:
                r = {"error": f"{type(exc).__name__}: {exc}"}
            result["measured"][strategy] = r
        name = "qlora_7b_cuda.json"

    print(f"Llama-2-7B QLoRA, rank 0 of 2, bs 1, ctx 512, checkpointing, bf16 (published: {PUBLISHED_GIB} GiB)")
    for s, e in result["estimate"].items():
        print(f"  estimate ({s:17s}) {e['peak_gib']:6.2f} GiB  ratio to published {e['peak_gib'] / PUBLISHED_GIB:.2f}")
    for strategy in ("fsdp2", "fsdp1"):
        f = result.get(f"fake_tensor_run_{strategy}")
        if f:
            print(f"  fake-tensor run ({strategy})     {f['peak_gib']:6.2f} GiB  ratio to published "
                  f"{f['peak_gib'] / PUBLISHED_GIB:.2f}  ({f['seconds']} s)")
    if args.device == "cpu":
        print("  GPU measurement: not run here (no CUDA device); use --device cuda on a GPU")
    for s, m in result.get("measured", {}).items():
        print(f"  measured ({s}) " + (f"{m['peak_gib']:.2f} GiB" if "peak_gib" in m else m["error"]))
    path = os.path.join(os.path.dirname(__file__), "results", name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
