"""The ``fsdp-lab`` command: ``fsdp-lab env | bench | estimate | doctor | lab``.

Each subcommand is a function ``add_<name>_parser(subparsers)`` that adds its parser to
argparse's ``subparsers`` and sets ``func=run(args)`` as a default; ``run`` returns the exit
status (anything but an int means 0). ``env`` and ``bench`` live here; other modules'
subcommands are listed in ``SUBCOMMANDS`` as "module:function" and imported when the parser
is built. To add one::

    def add_demo_parser(subparsers):
        parser = subparsers.add_parser("demo", help="train a few steps on N ranks")
        parser.add_argument("--world-size", type=int, default=2)
        parser.set_defaults(func=run_demo)

and list "fsdp_lab.demo:add_demo_parser" in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import re
import os
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

import fsdp_lab
from fsdp_lab import bandwidth, collectives
from fsdp_lab.checks import positive_int
from fsdp_lab.dist import choose_backend, cpu_forced, current_device
from fsdp_lab.launch import launch

# Subcommands defined outside this module, as "module:add_parser_function".
SUBCOMMANDS: list[str] = [
    "fsdp_lab.memory.cli:add_estimate_parser",
    "fsdp_lab.doctor:add_doctor_parser",
    "fsdp_lab.workshop.cli:add_lab_parser",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``fsdp-lab`` argument parser with every subcommand (imports their modules)."""
    parser = argparse.ArgumentParser(
        prog="fsdp-lab", description="Learn, measure and debug Fully Sharded Data Parallel.")
    subparsers = parser.add_subparsers(dest="command", title="commands", required=True)
    adders: list[Callable] = [add_env_parser, add_bench_parser]
    for spec in SUBCOMMANDS:
        module, _, name = spec.partition(":")
        adders.append(getattr(importlib.import_module(module), name))
    for add in adders:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp-lab`` with ``argv`` (default: the command line); return the exit status.

    Raises SystemExit(2) with a usage message on bad arguments or no subcommand.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
    except BrokenPipeError:  # `fsdp-lab lab list | head`: the reader left; stop quietly, as a pipe expects
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # what a shell reports for a process ended by SIGPIPE
    return status if isinstance(status, int) else 0


# ---------------------------------------------------------------------------- env


def _all_reduce_ones() -> float:
    """Per-rank body of the launch check: all-reduce a 1 from every rank."""
    t = torch.ones(1, device=current_device())
    collectives.all_reduce(t)
    return t.item()


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _describe_auto(world_size: int) -> str:
    backend, n_gpus = choose_backend(world_size), torch.cuda.device_count()
    if cpu_forced():
        return "gloo on CPU (FSDP_LAB_DEVICE=cpu)"
    if backend == "nccl":
        return "nccl, one GPU per rank"
    if n_gpus:
        return (f"gloo, {_ranks(world_size)} share {n_gpus} GPU(s) "
                "(CUDA tensors staged through host memory)")
    return "gloo on CPU"


def _env(args: argparse.Namespace) -> int:
    rows = [("fsdp_lab", fsdp_lab.__version__),
            ("python", platform.python_version()),
            ("torch", torch.__version__)]
    n_gpus = torch.cuda.device_count()
    rows.append(("CUDA", f"available, {n_gpus} device(s)" if n_gpus else "not available"))
    for i in range(n_gpus):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"  cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    yes_no = {True: "yes", False: "no"}
    rows.append(("gloo", yes_no[dist.is_gloo_available()]))
    rows.append(("nccl", yes_no[dist.is_nccl_available()]))
    rows.append((f"auto backend, {_ranks(args.world_size)}", _describe_auto(args.world_size)))
    for name, value in rows:
        print(f"{name:<24} {value}")

    start = time.perf_counter()
    try:
        sums = launch(_all_reduce_ones, world_size=args.world_size, timeout=120)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer to "does it work?"
        report = str(exc) or type(exc).__name__
        print(f"{'launch':<24} FAILED: " + report.replace("\n", "\n" + " " * 25))
        return 1
    seconds = time.perf_counter() - start
    ok = sums == [float(args.world_size)] * args.world_size
    verdict = "ok" if ok else f"WRONG (expected {float(args.world_size)} on every rank)"
    print(f"{'launch':<24} {_ranks(args.world_size)}, all_reduce of ones -> {sums}: {verdict} "
          f"in {seconds:.2f} s")
    return 0 if ok else 1


def add_env_parser(subparsers) -> argparse.ArgumentParser:
    """``fsdp-lab env``: versions, devices, backends, and a timed 2-rank launch."""
    parser = subparsers.add_parser("env", help="versions, devices, backends, and a test launch")
    parser.add_argument("--world-size", type=positive_int, default=2,
                        help="ranks for the launch check (default 2)")
    parser.set_defaults(func=_env)
    return parser


# ---------------------------------------------------------------------------- bench

_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_sizes(text: str) -> list[int]:
    """"1K,1M,16M" -> [1024, 1048576, 16777216] (bytes; K/M/G are powers of 1024).
    Raises argparse.ArgumentTypeError on anything else."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", item, flags=re.IGNORECASE)
        if not match or int(match.group(1)) == 0:
            raise argparse.ArgumentTypeError(
                f"bad size {item.strip()!r}: use positive byte counts like 4096, 64K, 1M, 2G")
        sizes.append(int(match.group(1)) * _UNITS[match.group(2).upper()])
    return sizes


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
    return f"{nbytes:g} GiB"


def _bench(args: argparse.Namespace) -> int:
    rows = bandwidth.benchmark(args.op, args.sizes, world_size=args.world_size)
    print(f"{'op':<16}{'size':>12}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"
          f"   ({_ranks(args.world_size)})")
    for row in rows:
        print(f"{row['op']:<16}{_human(row['bytes']):>12}{row['time_s'] * 1e6:>12.1f}"
              f"{row['algbw_GBps']:>14.3f}{row['busbw_GBps']:>14.3f}")
    measured = {row["bytes"] for row in rows}
    rounded = [f"{_human(asked)} -> {_human(bandwidth.measured_bytes(asked, args.world_size))}"
               for asked in dict.fromkeys(args.sizes) if asked not in measured]
    if rounded:
        print(f"(sizes rounded to whole float32 elements per rank, a multiple of "
              f"{4 * args.world_size} B: {', '.join(rounded)})")
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """``fsdp-lab bench``: a bandwidth table from ``fsdp_lab.bandwidth.benchmark``."""
    parser = subparsers.add_parser(
        "bench", help="collective bandwidth table (algbw, busbw as nccl-tests define them)")
    parser.add_argument("--op", choices=_OPS, default="all",
                        help="collective to measure (default: all)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1K,1M,16M"),
                        help="comma-separated collective sizes in bytes, K/M/G = KiB/MiB/GiB "
                             "(default 1K,1M,16M)")
    parser.add_argument("--world-size", type=positive_int, default=2,
                        help="number of ranks (default 2)")
    parser.set_defaults(func=_bench)
    return parser


if __name__ == "__main__":
    sys.exit(main())
