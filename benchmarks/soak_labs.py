"""Soak: the labs under nbval several times in a row while busy loops load the CPU.

Run from the repository root:

    python benchmarks/soak_labs.py                          # 5 runs of pytest --nbval labs/
    python benchmarks/soak_labs.py --record                 # and write the JSON for report.py
    python benchmarks/soak_labs.py --runs 1 labs/00_start_here.ipynb
    python benchmarks/soak_labs.py --runs 1 --busy 0 --record \
        --out benchmarks/results/soak_labs_quiet_cpu.json   # each lab's run time, quiet machine
    python benchmarks/soak_labs.py --runs 3 --busy 0 --cpus 6 8 16 --record \
        --out benchmarks/results/soak_labs_more_cpus_cpu.json  # as on machines with more cores
    python benchmarks/soak_labs.py --runs 2 --busy 0 --gc never often --record \
        --out benchmarks/results/soak_labs_gc_cpu.json  # with the garbage collector off, then eager

Every output nbval compares must be the same on a quiet or a busy machine. This starts
``--busy`` processes that spin on the CPU (``python -c "while True: pass"``), runs
``python -m pytest --nbval -q PATHS`` ``--runs`` times in a row, prints each run's passes and
failures (by test id; a failing run's whole output goes to a log file it names) and a summary
line, and stops the busy loops and any pytest still running at the end, also on Ctrl-C or
SIGTERM. Exit status 0 when every run passed, 1 otherwise.
``--cpus N [N ...]`` runs each run as on a machine with the next of these core counts (cycled):
every Python process of the run (pytest, the notebook kernels, the fork server and the ranks)
sees ``os.cpu_count() == N`` and starts with N torch threads, so a kernel computes with N threads
and each of a launch's ranks with N // world_size, as they would there (a ``sitecustomize``
module on ``PYTHONPATH`` does it). A bigger machine changes the labs' arithmetic only through
how many threads split a parallel operation; this runs that arithmetic here, slower, since the
threads then share this machine's cores.
``--gc never|often [...]`` runs each run with Python's garbage collector switched off in every
process of the run (``never``: reference cycles are never collected) or made eager (``often``:
thresholds 20, 4, 4 instead of 700, 10, 10), the next mode for each run. No measured number may
depend on when the collector runs, so both must give the committed outputs.
``--record`` writes benchmarks/results/soak_labs_<device>.json (``--out`` elsewhere) after every
run, so a soak stopped early keeps the runs it finished, with each notebook's seconds (from
pytest's JUnit report: its cells' times, kernel start included); ``benchmarks/report.py`` lays
it out in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
_STOP_GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL for a pytest run being stopped
GC_MODES = ("never", "often")
# What a run can be made to see, as a run's record names it -> the variable that passes it on
CONDITIONS = {"simulated_cpus": "SOAK_SIMULATED_CPUS", "gc": "SOAK_GC"}
# Imported by every Python process of a ``--cpus`` or ``--gc`` run (it comes first on PYTHONPATH).
_SITECUSTOMIZE = f"""\
import gc
import os

_gc = os.environ.get("{CONDITIONS['gc']}")
if _gc == "never":
    gc.disable()
elif _gc == "often":
    gc.set_threshold(20, 4, 4)

_cpus = os.environ.get("{CONDITIONS['simulated_cpus']}")
if _cpus:
    _cpus = int(_cpus)
    os.cpu_count = lambda: _cpus
    if hasattr(os, "process_cpu_count"):
        os.process_cpu_count = lambda: _cpus

    import torch

    torch.set_num_threads(_cpus)
"""


def start_busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one core busy until stopped."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(process: subprocess.Popen, grace: float = _STOP_GRACE_S) -> None:
    """End ``process`` and everything in its session if it has one of its own (SIGTERM, then
    SIGKILL after ``grace`` seconds); reap it."""
    if process.poll() is None:
        _signal(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait()


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(process.pid) == process.pid:  # its own session: the kernels it started too
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
    except ProcessLookupError:
        pass


def run_pytest(paths: list[str], timeout: float, log: Path | None = None, conditions: dict | None = None) -> dict:
    """One ``pytest --nbval`` run over ``paths``; its counts, failing test ids and duration (s).
    ``log``: where pytest's whole output is written when the run fails (the diffs nbval shows).
    ``conditions``: ``{"simulated_cpus": N}`` runs as on a machine with N cores (``--cpus``),
    ``{"gc": "never" | "often"}`` with the garbage collector off or eager (``--gc``).

    pytest runs in a session of its own so that stopping it also stops the notebook kernels
    and ranks it started. Raises KeyboardInterrupt after stopping it on Ctrl-C.
    """
    with tempfile.TemporaryDirectory() as tmp:
        conditions = conditions or {}
        if conditions:
            Path(tmp, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        # kernels and ranks import this copy of fsdp_lab
        path = os.pathsep.join(p for p in (tmp if conditions else None, str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, **{CONDITIONS[key]: str(value) for key, value in conditions.items()})
        if "simulated_cpus" in conditions:  # ranks take N / world size threads, as on that machine (else
            env["OMP_NUM_THREADS"] = str(conditions["simulated_cpus"])  # nbval's plugin would set 1)
        report = Path(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "--nbval", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}", *paths]
        start = time.monotonic()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, encoding="utf-8", errors="replace",
                                   start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except BaseException:  # Ctrl-C or the timeout: nothing of this run may survive it
            stop(process)
            raise
        seconds = time.monotonic() - start
        counts = _junit_counts(report) if report.exists() else None
    if log is not None and process.returncode != 0:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output, encoding="utf-8")
    if counts is None:  # pytest ended before writing a report (crash)
        counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
                  "notebook_seconds": {}}
    if process.returncode != 0 and not counts["failures"]:  # e.g. no such path, nothing collected
        last = output.strip().splitlines()[-1:] or [""]
        counts["failures"].append(f"pytest exited with {process.returncode}: {last[0][-300:]}")
    return {**counts, "exit_code": process.returncode, "seconds": round(seconds, 1)}


def _junit_counts(report: Path) -> dict:
    """passed / failed / errors / skipped, the ids of failing tests and each notebook's seconds
    (``notebook_seconds``: the sum of its cells' times, kernel start included), from a JUnit
    XML file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "notebook_seconds": {}}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(outcome, "passed")
        counts[key] += 1
        notebook = notebook_path(case.get("classname", ""))
        if key in ("failed", "errors"):
            counts["failures"].append(f"{notebook}::{case.get('name', '')}")
        seconds = counts["notebook_seconds"]
        seconds[notebook] = seconds.get(notebook, 0.0) + float(case.get("time") or 0.0)
    counts["notebook_seconds"] = {name: round(s, 1) for name, s in counts["notebook_seconds"].items()}
    return counts


def notebook_path(classname: str) -> str:
    """The path pytest ran for a JUnit class name: ``labs.solutions.03_zero_by_hand.ipynb``
    becomes ``labs/solutions/03_zero_by_hand.ipynb`` (lab names hold no dot)."""
    stem, dot, suffix = classname.rpartition(".")
    return stem.replace(".", "/") + dot + suffix if stem else classname


def run_passed(run: dict) -> bool:
    """A run passes when pytest exited 0 with no failure and no error."""
    return run["exit_code"] == 0 and run["failed"] == 0 and run["errors"] == 0


def describe(run: dict) -> str:
    """One line for a run: its counts, duration and the failing test ids."""
    text = (f"{run['passed']} passed, {run['failed']} failed, {run['errors']} errors, "
            f"{run['skipped']} skipped in {run['seconds']:.0f} s (load at its start {run['load_average_1min']:.1f}"
            + "".join(f", {key} {run[key]}" for key in CONDITIONS if key in run) + ")")
    if run["failures"]:
        text += "; failing: " + ", ".join(run["failures"])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["labs/"],
                        help="what pytest --nbval runs (default: labs/)")
    parser.add_argument("--runs", type=int, default=5, help="runs in a row (default 5)")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes (default 2)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per run")
    parser.add_argument("--cpus", type=int, nargs="+", default=None, metavar="N",
                        help="run each run as on a machine with N cores (the next N for each run)")
    parser.add_argument("--gc", nargs="+", choices=GC_MODES, default=None, metavar="MODE",
                        help="run each run with the garbage collector off (never) or eager (often), "
                             "the next mode for each run")
    parser.add_argument("--record", action="store_true",
                        help="write the result as JSON for benchmarks/report.py")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path for --record (default benchmarks/results/soak_labs_<device>.json)")
    args = parser.parse_args(argv)
    args.arguments = shlex.join(sys.argv[1:] if argv is None else argv)  # recorded: how to run it again
    if args.runs < 1 or args.busy < 0:
        parser.error("--runs must be >= 1 and --busy >= 0")
    if args.cpus is not None and min(args.cpus) < 1:
        parser.error("--cpus takes core counts >= 1, e.g. --cpus 8 or --cpus 6 8 16")

    # Ctrl-C, and SIGTERM alike, end the soak through KeyboardInterrupt so that the finally
    # below stops what was started; SIGINT is set explicitly because a shell starting a job in
    # the background leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs = []
    # a failing run's output, to see why (the folder is made only when a run fails)
    logs = Path(tempfile.gettempdir()) / f"soak_labs_{os.getpid()}"
    # what each run is made to see (--cpus, --gc): each option's values in turn, one per run
    options = {key: values for key, values in (("simulated_cpus", args.cpus), ("gc", args.gc)) if values}
    busy = start_busy_loops(args.busy)
    print(f"soak: {args.runs} run(s) of pytest --nbval {' '.join(args.paths)} "
          f"with {args.busy} busy loop(s)" + "".join(f", {key} {'/'.join(map(str, values))}"
                                                     for key, values in options.items()), flush=True)
    try:
        for i in range(args.runs):
            load = os.getloadavg()[0]
            log = logs / f"run_{i + 1}.log"
            conditions = {key: values[i % len(values)] for key, values in options.items()}
            run = {"run": i + 1, "load_average_1min": round(load, 2), **conditions,
                   **run_pytest(args.paths, args.timeout, log, conditions)}
            runs.append(run)
            verdict = "PASS" if run_passed(run) else f"FAIL (pytest's output: {log})"
            print(f"run {i + 1}/{args.runs}: {verdict}: {describe(run)}", flush=True)
            if args.record:  # after every run: a soak stopped early keeps what it measured
                _record(args, runs, sum(run_passed(r) for r in runs))
    except KeyboardInterrupt:
        print(f"\ninterrupted after {len(runs)} run(s); busy loops stopped", flush=True)
        return 130
    finally:
        for process in busy:
            stop(process, grace=2.0)

    passed = sum(run_passed(r) for r in runs)
    print(f"soak summary: {passed} of {len(runs)} runs passed "
          f"(pytest --nbval {' '.join(args.paths)}, {args.busy} busy loops)")
    return 0 if passed == len(runs) else 1


def _record(args, runs: list[dict], passed: int) -> None:
    import torch  # only for the version and device recorded

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or RESULTS / f"soak_labs_{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "kind": "soak",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "device": device, "command": f"python -m pytest --nbval {' '.join(args.paths)}", "arguments": args.arguments,
        "busy_loops": args.busy, "runs_passed": passed, "runs_total": len(runs), "runs_planned": args.runs,
        "runs": runs,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
