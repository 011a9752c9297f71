"""estimate() beside a measured step: the per-rank peak by formula and by MemoryTracker.

    python benchmarks/estimate_vs_measured.py          # the "cpu" Llama, batch 2 x 64 tokens
    python benchmarks/estimate_vs_measured.py --batch-size 4 --seq-len 128

Grid: DDP on one process and, on 2 real ranks (``fsdp_lab.launch``, rank 0's numbers), FSDP2
with resharding after forward on and off, FSDP1 FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; each in float32
and bfloat16 (parameters, gradients and AdamW state in that dtype) and as QLoRA in bfloat16 (NF4
block linears, rank-8 adapters), with and without activation checkpointing. ``measure_step`` takes a warm-up step and tracks the second. Per row: estimated
and measured peak bytes, their ratio, the estimate's peak phase and the tracker's label at its
peak; model states (parameters, NF4 bytes, optimizer state) must agree to the byte, and the script exits
non-zero where they do not. The 2-rank rows are measured once more as rank 0 of a simulated world of 2
(``fsdp_lab.simulated_world``: torch's fake group, whose collectives are native ones, as NCCL's are), so
without the scratch buffers of fsdp_lab's gloo reduce-scatter: ``simulated_bytes`` and
``estimate_over_simulated``. Writes benchmarks/results/estimate_vs_measured_<cpu|cuda>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

import torch

from fsdp_lab import launch, simulated_world
from fsdp_lab.dist import current_device
from fsdp_lab.memory.estimate import estimate
from fsdp_lab.memory.measure import measure_step

RESULTS = pathlib.Path(__file__).parent / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (dtype name, QLoRA) per row of a strategy
VARIANTS = [("float32", False), ("bfloat16", False), ("bfloat16", True)]
# (strategy, reshard_after_forward, world size)
STRATEGIES = [("ddp", True, 1), ("fsdp2", True, 2), ("fsdp2", False, 2),
              ("fsdp1_full_shard", True, 2), ("fsdp1_shard_grad_op", True, 2), ("fsdp1_no_shard", True, 2)]


def _grid(world_size: int) -> list[tuple[str, bool, str, bool, bool]]:
    return [(s, raf, dtype, qlora, ac) for s, raf, ws in STRATEGIES if ws == world_size
            for dtype, qlora in VARIANTS for ac in (False, True)]


def _measure_all(world_size: int, batch_size: int, seq_len: int) -> dict:
    """Every configuration of the grid for this world size, measured on this rank."""
    return {(s, raf, dtype, qlora, ac): measure_step("cpu", strategy=s, batch_size=batch_size, seq_len=seq_len,
                                                     param_dtype=DTYPES[dtype], activation_checkpointing=ac,
                                                     reshard_after_forward=raf, qlora=qlora)
            for s, raf, dtype, qlora, ac in _grid(world_size)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                                                    "estimate_vs_measured_<cpu|cuda>.json)")
    args = parser.parse_args(argv)

    measured = _measure_all(1, args.batch_size, args.seq_len)
    measured.update(launch(_measure_all, 2, args.batch_size, args.seq_len, world_size=2, timeout=600)[0])
    with simulated_world(2):
        simulated = _measure_all(2, args.batch_size, args.seq_len)
    device = current_device().type
    rows, mismatched = [], []
    print(f"{'strategy':<20}{'reshard':>8}{'dtype':>15}{'ckpt':>6}{'estimate':>12}{'measured':>12}"
          f"{'est/meas':>10}{'est/sim':>9}  estimate's phase / tracker's label at its peak")
    for s, raf, ws in STRATEGIES:
        for dtype, qlora in VARIANTS:
            for ac in (False, True):
                m = measured[(s, raf, dtype, qlora, ac)]
                est = estimate("cpu", world_size=ws, strategy=s, param_dtype=DTYPES[dtype],
                               batch_size=args.batch_size, seq_len=args.seq_len, activation_checkpointing=ac,
                               reshard_after_forward=raf, device=device, foreach=False, qlora=qlora)
                at_step = est.phases["optimizer_step"]
                states = [c for c in ("params", "sharded_params", "quantized", "optimizer_state")
                          if m.current[c] != at_step[c]]
                name = dtype + (" QLoRA" if qlora else "")
                if states:
                    mismatched.append(f"{s} {name} checkpointing={ac}: {', '.join(states)}")
                row = {"strategy": s, "reshard_after_forward": raf, "world_size": ws, "dtype": dtype,
                       "qlora": qlora, "activation_checkpointing": ac, "estimate_bytes": est.total,
                       "measured_bytes": m.peak_total, "estimate_over_measured": round(est.total / m.peak_total, 4),
                       "estimate_phase": est.phase, "measured_at": m.peak_label,
                       "model_states_exact": not states}
                sim = simulated.get((s, raf, dtype, qlora, ac))
                if sim is not None:
                    row.update(simulated_bytes=sim.peak_total,
                               estimate_over_simulated=round(est.total / sim.peak_total, 4))
                rows.append(row)
                print(f"{s:<20}{str(raf):>8}{name:>15}{'on' if ac else 'off':>6}{est.total:>12,}"
                      f"{m.peak_total:>12,}{row['estimate_over_measured']:>10.3f}"
                      f"{format(row['estimate_over_simulated'], '.3f') if sim else '-':>9}  {est.phase} / {m.peak_label}")
    ratios = [r["estimate_over_measured"] for r in rows]
    simulated_ratios = [r["estimate_over_simulated"] for r in rows if "estimate_over_simulated" in r]
    print(f"estimate/measured from {min(ratios):.3f} to {max(ratios):.3f} over {len(rows)} configurations; "
          f"model states exact in {sum(r['model_states_exact'] for r in rows)} of {len(rows)}")
    print(f"estimate/simulated (2 ranks, native collectives) from {min(simulated_ratios):.3f} to "
          f"{max(simulated_ratios):.3f} over {len(simulated_ratios)} configurations")
    for line in mismatched:
        print("model states differ:", line)
    result = {"device": device, "torch": torch.__version__, "when": datetime.date.today().isoformat(),
              "cpus": os.cpu_count(), "batch_size": args.batch_size, "seq_len": args.seq_len,
              "ratio_min": min(ratios), "ratio_max": max(ratios),
              "simulated_ratio_min": min(simulated_ratios), "simulated_ratio_max": max(simulated_ratios),
              "model_states_identical": not mismatched, "rows": rows}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    RESULTS.mkdir(exist_ok=True)
    out = pathlib.Path(args.out) if args.out else RESULTS / f"estimate_vs_measured_{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
