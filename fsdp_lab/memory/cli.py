"""``fsdp-lab estimate``: print the estimated per-rank memory breakdown of a Llama config.

    fsdp-lab estimate --model llama2-7b --world-size 8 --strategy fsdp2 --batch-size 1 --seq-len 4096 [--qlora] [--ac]
    fsdp-lab estimate --config path/to/your-model --world-size 8     # its Hugging Face config.json
"""

from __future__ import annotations

import argparse

import torch

from fsdp_lab.checks import positive_int
from fsdp_lab.memory.estimate import OPTIMIZERS, STRATEGIES, estimate, hybrid_shard_group_size
from fsdp_lab.memory.results import unit_scale
from fsdp_lab.models.llama import CONFIGS, LlamaConfig, count_parameters

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_SEQ_LEN = 4096


def parameter_count(n: int) -> str:
    """A parameter count as a model card writes it: "6.74 B", "12.5 M", "3 K" (powers of 1000)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        value = n / scale
        text = f"{value:.3g}" if value < 100 else f"{value:.0f}"
        if float(text) >= 1:  # decided after rounding: 999,999 is "1 M", not "1000 K"
            return f"{text} {suffix}"
    return str(n)


def add_estimate_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``estimate`` sub-command to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = subparsers.add_parser("estimate", help="estimate per-rank memory of one training step",
                              description="Estimate the per-rank memory (by category) of one training step.")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default="llama2-7b", choices=sorted(CONFIGS), help="named Llama config")
    which.add_argument("--config", default=None, metavar="PATH",
                       help="your own Llama, Mistral, Qwen2 or Qwen3 model: its folder or config.json "
                            "(Hugging Face format)")
    p.add_argument("--world-size", type=positive_int, default=8, help="number of ranks")
    p.add_argument("--strategy", default="fsdp2", choices=STRATEGIES)
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per rank")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's max_seq_len if shorter)")
    p.add_argument("--param-dtype", default="bfloat16", choices=DTYPES, help="parameter storage dtype")
    p.add_argument("--grad-dtype", default=None, choices=DTYPES, help="gradient dtype (default: param dtype)")
    p.add_argument("--compute-dtype", default=None, choices=DTYPES, help="activation dtype (default: param dtype)")
    p.add_argument("--shard-group-size", type=positive_int, default=None,
                   help="fsdp1_hybrid_shard: ranks per shard group, the GPUs of a node "
                        "(default: 8, or the world size if smaller)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--cpu-offload", action="store_true", help="sharded states in host memory")
    p.add_argument("--qlora", action="store_true", help="NF4 base weights with LoRA adapters")
    p.add_argument("--no-reshard-after-forward", action="store_true", help="FSDP2: keep blocks gathered")
    p.add_argument("--unit", default="GiB", choices=("MiB", "GiB", "MB", "GB"))
    # a combination estimate() refuses is reported like any bad argument: usage, message, exit 2
    p.set_defaults(func=run_estimate, usage_error=p.error)
    return p


# estimate()'s argument names, as this command spells them (longer names first)
_FLAGS = (("cpu_offload=False", "drop --cpu-offload"), ("cpu_offload", "--cpu-offload"),
          ("reshard_after_forward=False", "--no-reshard-after-forward"),
          ("reshard_after_forward", "--no-reshard-after-forward"), ("shard_group_size", "--shard-group-size"),
          ("world_size", "--world-size"), ("batch_size", "--batch-size"), ("seq_len", "--seq-len"))


def as_flags(message: str) -> str:
    """``message`` (an error of ``estimate()``) with its argument names replaced by this command's
    flags, so the fix it names is one the user can type."""
    for name, flag in _FLAGS:
        message = message.replace(name, flag)
    return message


def run_estimate(args: argparse.Namespace) -> str:
    """Run the estimate described by parsed ``args``; print and return the table (text).

    A combination ``estimate`` refuses (e.g. ``--cpu-offload`` with ``ddp``) ends as a usage
    error (SystemExit(2), the message on stderr) when ``args`` came from this parser; otherwise
    its ValueError propagates.
    """
    try:
        config = LlamaConfig.from_hf(args.config) if args.config else LlamaConfig.from_name(args.model)
        seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, config.max_seq_len)
        breakdown = estimate(
            config, world_size=args.world_size, strategy=args.strategy,
            param_dtype=getattr(torch, args.param_dtype),
            grad_dtype=getattr(torch, args.grad_dtype) if args.grad_dtype else None,
            compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype else None,
            optimizer=args.optimizer, batch_size=args.batch_size, seq_len=seq_len,
            activation_checkpointing=args.ac, cpu_offload=args.cpu_offload, qlora=args.qlora,
            reshard_after_forward=not args.no_reshard_after_forward,
            shard_group_size=args.shard_group_size)
    except (ValueError, FileNotFoundError) as error:
        usage_error = getattr(args, "usage_error", None)
        if usage_error is None:
            raise
        usage_error(as_flags(str(error)))
    header = (f"{config.name} ({parameter_count(count_parameters(config))} parameters), {args.strategy}, "
              f"world size {args.world_size}, batch {args.batch_size} x {seq_len} tokens per rank, "
              f"{args.param_dtype}{', QLoRA' if args.qlora else ''}{', checkpointing' if args.ac else ''}")
    if args.strategy == "fsdp1_hybrid_shard":
        header += f", shard groups of {hybrid_shard_group_size(args.world_size, args.shard_group_size)} ranks"
    scale = unit_scale(args.unit)
    lines = [header, breakdown.table(args.unit),
             f"{'model states':<18}{breakdown.model_states / scale:>12.3f} {args.unit}"]
    if seq_len > config.max_seq_len:
        lines.append(f"note: {seq_len} tokens per sequence is past this model's max_seq_len "
                     f"({config.max_seq_len}): a what-if, the model itself would refuse it")
    lines += [f"note: {n}" for n in breakdown.notes]
    text = "\n".join(lines)
    print(text)
    return text
