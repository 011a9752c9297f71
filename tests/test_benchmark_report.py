"""benchmarks/report.py: docs/benchmarks.md is laid out from the recorded JSON, and is current."""

import json

import pytest

from _benchmarks import BENCHMARKS, load_benchmark

REPO = BENCHMARKS.parent
report = load_benchmark("report")


def test_flatten_nested_results():
    tree = {"a": {"b": 1, "c": [1.5, 2]}, "runs": [{"x": 1}, {"x": 2}], "d": "text"}
    assert report.flatten(tree) == {"a.b": 1, "a.c": "1.5, 2", "runs.0.x": 1, "runs.1.x": 2, "d": "text"}


def test_section_puts_ratios_and_targets_first(tmp_path):
    result = tmp_path / "nf4_cpu.json"  # named like a real script, so its docstring heads the section
    result.write_text(json.dumps({"device": "cpu", "time_ratio": 1.23456, "targets": {"time_ratio_max": 1.1},
                                  "peak_bytes": 3 * 2**20}))
    text = report.section(result)
    headline, details = text.split("<details>")
    assert "| `time_ratio` | 1.235 |" in headline and "| `targets.time_ratio_max` | 1.1 |" in headline
    assert "| `peak_bytes` | 3145728 (3.00 MiB) |" in details
    assert "Recorded on: device cpu." in text
    assert "Run: `python benchmarks/nf4.py`" in text


def test_each_gpu_file_names_its_gpu_and_a_rerun_replaces_the_table(tmp_path):
    older = tmp_path / "fsdp2_vs_torch_cuda.json"
    older.write_text(json.dumps({"device": "cuda:0"}))
    assert "GPU NVIDIA H100 80GB HBM3 (recorded before the script wrote its name)" in report.section(older)
    rerun = {"device": "cuda:0", "gpu": "NVIDIA A100-SXM4-80GB"}
    assert report.gpu_context(older, rerun) == "GPU NVIDIA A100-SXM4-80GB"
    assert report.gpu_context(tmp_path / "memory_tracker_cuda_x.json", {"device": "NVIDIA H200"}) is None
    assert report.gpu_context(tmp_path / "nf4_cpu.json", {"device": "cpu"}) is None
    assert "not recorded" in report.gpu_context(tmp_path / "new_cuda.json", {"device": "cuda"})


def test_render_without_results_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="run a script in benchmarks/ first"):
        report.render(tmp_path)


def test_docs_benchmarks_md_is_current():
    assert (REPO / "docs" / "benchmarks.md").read_text() == report.render(), \
        "docs/benchmarks.md is out of date: run python benchmarks/report.py"


def soak_run(number: int, **fields) -> dict:
    """One run of a soak record as benchmarks/soak_labs.py writes it; ``fields`` override."""
    return {"run": number, "passed": 1, "failed": 0, "errors": 0, "skipped": 0, "seconds": 5.0,
            "load_average_1min": 2.0, "exit_code": 0, "failures": []} | fields


def soak_section(tmp_path, runs: list[dict], busy_loops: int = 2, **fields) -> str:
    """report.section of a soak record holding ``runs``, written where soak_labs.py names it."""
    result = tmp_path / "soak_labs_cpu.json"
    record = {"kind": "soak", "device": "cpu", "command": "python -m pytest --nbval labs/",
              "busy_loops": busy_loops, "runs_passed": sum(run["exit_code"] == 0 for run in runs),
              "runs_total": len(runs), "runs": runs} | fields
    result.write_text(json.dumps(record))
    return report.section(result)


def test_soak_section_says_how_many_runs_passed_and_lists_each_run(tmp_path):
    text = soak_section(tmp_path, [
        soak_run(1, passed=698, skipped=2, seconds=410.0, load_average_1min=3.9),
        soak_run(2, passed=697, failed=1, skipped=2, seconds=415.5, load_average_1min=4.2, exit_code=1,
                 failures=["labs/08.ipynb::Cell 10"])])
    assert "**1 of 2 runs passed**: `python -m pytest --nbval labs/`, 2 busy-loop processes" in text
    assert "`load_average_1min` is read as each run starts" in text
    assert "| 1 | 698 | 0 | 0 | 2 | 410 | 3.9 | none |" in text
    assert "| 2 | 697 | 1 | 0 | 2 | 415.5 | 4.2 | `labs/08.ipynb::Cell 10` |" in text
    assert "Run: `python benchmarks/soak_labs.py`" in text


def test_soak_stopped_early_says_how_many_runs_were_planned(tmp_path):
    text = soak_section(tmp_path, [soak_run(1, passed=378, seconds=800.0)], runs_planned=5)
    assert "**1 of 1 runs passed** (stopped after 1 of 5 planned runs)" in text


def test_soak_section_lists_each_notebooks_seconds_over_the_runs(tmp_path):
    runs = [soak_run(i + 1, passed=3, seconds=60.0 + i,
                     notebook_seconds={"labs/00_start_here.ipynb": 14.6 + i,
                                       "labs/solutions/00_start_here.ipynb": 20.2})
            for i in range(2)]
    text = soak_section(tmp_path, runs, busy_loops=0)
    assert "| `labs/00_start_here.ipynb` | 15 | 16 |" in text
    assert "read as each run starts." in text  # no busy loops to blame for the first run's low load
    assert "| `labs/solutions/00_start_here.ipynb` | 20 | 20 |" in text


def test_soak_record_without_notebook_times_has_no_notebook_table(tmp_path):
    assert "| notebook |" not in soak_section(tmp_path, [soak_run(1)])


def test_soak_with_simulated_cores_shows_each_runs_core_count(tmp_path):
    text = soak_section(tmp_path, [soak_run(1, simulated_cpus=6), soak_run(2, simulated_cpus=16)], busy_loops=0)
    assert "`simulated_cpus`: the run saw that many cores" in text
    assert "| 1 | 1 | 0 | 0 | 0 | 5 | 2 | 6 | none |" in text
    assert "| 2 | 1 | 0 | 0 | 0 | 5 | 2 | 16 | none |" in text
    assert "simulated_cpus" not in soak_section(tmp_path, [soak_run(1)])


def test_soak_recorded_with_arguments_says_how_to_run_it_again(tmp_path):
    text = soak_section(tmp_path, [soak_run(1)], arguments="--runs 1 --cpus 8")
    assert "Run: `python benchmarks/soak_labs.py --runs 1 --cpus 8`" in text


def test_soak_with_gc_modes_shows_each_runs_mode(tmp_path):
    text = soak_section(tmp_path, [soak_run(1, gc="never"), soak_run(2, gc="often")], busy_loops=0)
    assert "`gc`: Python's garbage collector in every process of the run" in text
    assert "| 1 | 1 | 0 | 0 | 0 | 5 | 2 | never | none |" in text
    assert "| 2 | 1 | 0 | 0 | 0 | 5 | 2 | often | none |" in text
