"""Write docs/benchmarks.md from the JSON files the benchmarks leave in benchmarks/results/.

    python benchmarks/report.py              # rewrite docs/benchmarks.md
    python benchmarks/report.py --check      # exit 1 if docs/benchmarks.md is out of date

Each benchmark script saves one JSON per device (``<name>_cpu.json``, ``<name>_cuda.json``).
This script does not run anything: it lays the recorded numbers out, one section per file,
headed by the first line of the script's docstring. The headline rows are the ratios and
overheads the benchmark was written to check, beside their targets; every other number
follows in a folded table. A soak result (``"kind": "soak"``, from ``soak_labs.py``) is laid
out as "N of M runs passed", one row per run and one row per notebook (its seconds). Re-run a benchmark, then this script, and
commit both.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
HEADLINE_WORDS = ("ratio", "overhead", "target", "identical")
CONTEXT_KEYS = ("device", "world_size", "torch", "when", "load_average_1min", "cpus", "threads")
# GPU files recorded before their scripts wrote the GPU's name; a re-run's own name replaces these
GPU_OF_UNNAMED_FILES = {"launch_and_collectives_cuda": "NVIDIA H200",
                        **dict.fromkeys(("fsdp1_flat_grad_cuda", "fsdp1_vs_fsdp2_cuda", "fsdp2_vs_torch_cuda",
                                         "nf4_compile_cuda"), "NVIDIA H100 80GB HBM3")}


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """Nested dicts as ``{"a.b.c": leaf}``; lists of numbers or strings become one text cell,
    lists of dicts are flattened item by item (``runs.0.dtype``)."""
    flat: dict[str, object] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(tree, list) and any(isinstance(x, (dict, list)) for x in tree):
        for index, value in enumerate(tree):
            flat.update(flatten(value, f"{prefix}.{index}"))
    elif isinstance(tree, list):
        flat[prefix] = ", ".join(format_value(x) for x in tree)
    else:
        flat[prefix] = tree
    return flat


def format_value(value) -> str:
    """Floats with four significant figures, everything else as Python prints it."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(key: str, value) -> str:
    text = format_value(value)
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in key and value >= 2**20:
        text += f" ({value / 2**20:.2f} MiB)"
    return text.replace("|", "\\|")


def script_for(result: pathlib.Path) -> pathlib.Path | None:
    """The benchmark script whose name is the longest prefix of the result's file name."""
    candidates = [p for p in HERE.glob("*.py") if result.stem.startswith(p.stem + "_") and p.name != "report.py"]
    return max(candidates, key=lambda p: len(p.stem)) if candidates else None


def _summary(script: pathlib.Path | None) -> str:
    if script is None:
        return "(no benchmark script of this name)"
    text = script.read_text(encoding="utf-8")
    for quote in ('"""', "'''"):
        if quote in text:
            doc = text.split(quote)[1].strip()
            return doc.splitlines()[0] if doc else ""
    return ""


def gpu_context(result: pathlib.Path, data: dict) -> str | None:
    """"GPU <name>" for a ``*_cuda*`` results file: the name its script wrote (``gpu``), else the
    one in ``GPU_OF_UNNAMED_FILES``, said to be so; None for a CPU file and where ``device``
    already holds the name."""
    if "_cuda" not in result.stem:
        return None
    device = str(data.get("device", ""))
    if device.split(":")[0].lower() not in ("", "cpu", "cuda", "gpu"):
        return None
    if data.get("gpu"):
        return f"GPU {data['gpu']}"
    return f"GPU {GPU_OF_UNNAMED_FILES.get(result.stem, 'not recorded')} (recorded before the script wrote its name)"


def section(result: pathlib.Path) -> str:
    """The Markdown section for one results file."""
    data = json.loads(result.read_text(encoding="utf-8"))
    flat = flatten(data)
    script = script_for(result)
    lines = [f"## {result.stem}", "", _summary(script), ""]
    if script is not None and result.stem.endswith("_cpu"):
        arguments = f" {data['arguments']}" if data.get("arguments") else ""
        lines += [f"Run: `python benchmarks/{script.name}{arguments}`; recorded in `benchmarks/results/{result.name}`.", ""]
    elif script is not None:  # GPU files come from gpu_all.sh, which names each run's arguments
        lines += [f"Run on a GPU by `bash benchmarks/gpu_all.sh` (`{script.name}`, arguments there); "
                  f"recorded in `benchmarks/results/{result.name}`.", ""]
    context = [f"{k} {format_value(flat[k])}" for k in CONTEXT_KEYS if k in flat]
    gpu = gpu_context(result, data)
    context += [gpu] if gpu else []
    if context:
        lines += ["Recorded on: " + "; ".join(context) + ".", ""]
    if data.get("kind") == "soak":
        return "\n".join(lines + soak_lines(data))
    headline = {k: v for k, v in flat.items() if any(w in k.rsplit(".", 1)[-1] for w in HEADLINE_WORDS)}
    if headline:
        lines += ["| headline | value |", "|---|---|"]
        lines += [f"| `{k}` | {_cell(k, v)} |" for k, v in headline.items()]
        lines.append("")
    rest = {k: v for k, v in flat.items() if k not in headline and k not in CONTEXT_KEYS}
    if rest:
        lines += ["<details><summary>every recorded number</summary>", "", "| key | value |", "|---|---|"]
        lines += [f"| `{k}` | {_cell(k, v)} |" for k, v in rest.items()]
        lines += ["", "</details>", ""]
    return "\n".join(lines)


SOAK_COLUMNS = ("run", "passed", "failed", "errors", "skipped", "seconds", "load_average_1min")
# a column each, for records whose runs were made to see them (soak_labs.py --cpus, --gc)
SOAK_CONDITIONS = {
    "simulated_cpus": "`simulated_cpus`: the run saw that many cores (`--cpus`): `os.cpu_count()` and torch's "
                      "threads in every process, so each rank computed with that many divided by the world size.",
    "gc": "`gc`: Python's garbage collector in every process of the run (`--gc`): `never` switched off, "
          "`often` run at thresholds 20, 4, 4.",
}


def soak_lines(data: dict) -> list[str]:
    """A soak result: the runs that passed out of all, then one table row per run (the failing
    test ids, if any, in the last column)."""
    planned = data.get("runs_planned", data["runs_total"])
    stopped = f" (stopped after {data['runs_total']} of {planned} planned runs)" if planned > data["runs_total"] else ""
    conditions = [key for key in SOAK_CONDITIONS if any(key in run for run in data["runs"])]
    columns = SOAK_COLUMNS + tuple(conditions)
    lines = [f"**{data['runs_passed']} of {data['runs_total']} runs passed**{stopped}: `{data['command']}`, "
             f"{data['busy_loops']} busy-loop processes loading the CPU. `load_average_1min` is read as "
             "each run starts" + (", so the first run's is low: the busy loops have only just started."
                                  if data["busy_loops"] else ".")
             + "".join(" " + SOAK_CONDITIONS[key] for key in conditions), "",
             "| " + " | ".join(columns) + " | failing tests |",
             "|" + "---|" * (len(columns) + 1)]
    for run in data["runs"]:
        cells = [_cell(key, run.get(key)) for key in columns]
        failing = ", ".join(f"`{name}`" for name in run.get("failures", [])) or "none"
        lines.append("| " + " | ".join(cells + [failing.replace("|", "\\|")]) + " |")
    return lines + [""] + notebook_time_lines(data["runs"])


def notebook_time_lines(runs: list[dict]) -> list[str]:
    """Each notebook's seconds in a soak's runs (the sum of its cells' times in pytest's JUnit
    report, kernel start included): one row per notebook, the shortest and longest run. Empty
    for a record made before notebooks were timed."""
    seconds: dict[str, list[float]] = {}
    for run in runs:
        for notebook, value in run.get("notebook_seconds", {}).items():
            seconds.setdefault(notebook, []).append(value)
    if not seconds:
        return []
    lines = ["| notebook | seconds (shortest run) | seconds (longest run) |", "|---|---|---|"]
    lines += [f"| `{name}` | {min(values):.0f} | {max(values):.0f} |" for name, values in seconds.items()]
    return lines + [""]


def render(results_dir: pathlib.Path = RESULTS) -> str:
    """The whole of docs/benchmarks.md as text.

    Raises FileNotFoundError when ``results_dir`` holds no JSON file (run a benchmark first).
    """
    files = sorted(results_dir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no results in {results_dir}: run a script in benchmarks/ first")
    head = ["# Benchmarks", "",
            "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand.",
            "Each benchmark runs fsdp_lab and its reference side by side in one process and records "
            "the ratio; `_cpu` files come from a 2-core machine under gloo, `_cuda` files from one GPU with torch 2.11 (each section names it). "
            "Timings on a shared CPU move with its load (the load average is recorded where it matters).",
            "", "Files: " + ", ".join(f"[{f.stem}](#{f.stem})" for f in files), ""]
    return "\n".join(head) + "\n" + "\n".join(section(f) for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is out of date: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
