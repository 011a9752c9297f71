"""benchmarks/soak_labs.py: a JUnit report becomes counts, failing ids and seconds per notebook."""

from _benchmarks import load_benchmark

soak_labs = load_benchmark("soak_labs")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="labs.00_start_here.ipynb" name="Cell 0" time="2.849" />
<testcase classname="labs.00_start_here.ipynb" name="Cell 1" time="0.016"><failure message="x" /></testcase>
<testcase classname="labs.solutions.00_start_here.ipynb" name="Cell 0" time="3.25" />
<testcase classname="labs.solutions.00_start_here.ipynb" name="Cell 1" time="0.1"><skipped /></testcase>
</testsuite></testsuites>
"""


def test_junit_report_gives_counts_failures_and_seconds_per_notebook(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    counts = soak_labs._junit_counts(report)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (2, 1, 0, 1)
    assert counts["failures"] == ["labs/00_start_here.ipynb::Cell 1"]  # as pytest names it
    assert counts["notebook_seconds"] == {"labs/00_start_here.ipynb": 2.9,          # 2.849 + 0.016
                                          "labs/solutions/00_start_here.ipynb": 3.4}  # 3.25 + 0.1


def test_notebook_path_turns_a_class_name_back_into_the_path_pytest_ran():
    assert soak_labs.notebook_path("labs.solutions.03_zero_by_hand.ipynb") == "labs/solutions/03_zero_by_hand.ipynb"
    assert soak_labs.notebook_path("labs.08_qlora.ipynb") == "labs/08_qlora.ipynb"


def test_a_failing_run_writes_its_whole_output_to_the_log_and_a_passing_run_writes_none(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_fails():\n    assert 1 == 2, 'the diff to see'\n\n"
                                          "def test_passes():\n    pass\n")
    log = tmp_path / "logs" / "run_1.log"  # its folder does not exist yet
    run = soak_labs.run_pytest([str(tmp_path / "test_one.py")], timeout=120, log=log)
    assert (run["passed"], run["failed"]) == (1, 1)
    assert "the diff to see" in log.read_text()
    quiet_log = tmp_path / "logs" / "run_2.log"
    run = soak_labs.run_pytest([str(tmp_path / "test_one.py") + "::test_passes"], timeout=120, log=quiet_log)
    assert run["passed"] == 1 and not quiet_log.exists()


def test_cpus_makes_every_process_of_the_run_see_that_many_cores(tmp_path):
    # what a rank computes with comes from os.cpu_count() (launch) and a kernel's from torch's threads
    (tmp_path / "test_cores.py").write_text(
        "import os, subprocess, sys, torch\n\n"
        "def test_cores():\n"
        "    assert os.cpu_count() == 7 and torch.get_num_threads() == 7 and os.environ['OMP_NUM_THREADS'] == '7'\n"
        "    child = subprocess.run([sys.executable, '-c', 'import os, torch; print(os.cpu_count(), "
        "torch.get_num_threads())'], capture_output=True, text=True, timeout=120)\n"
        "    assert child.stdout.split() == ['7', '7'], child.stderr\n")
    run = soak_labs.run_pytest([str(tmp_path / "test_cores.py")], timeout=300, log=tmp_path / "log",
                               conditions={"simulated_cpus": 7})
    assert (run["passed"], run["failed"]) == (1, 0), (tmp_path / "log").read_text() if (tmp_path / "log").exists() else run


def test_gc_mode_reaches_every_process_of_the_run(tmp_path):
    (tmp_path / "test_gc.py").write_text(
        "import gc, subprocess, sys\n\n"
        "def test_gc():\n"
        "    assert not gc.isenabled()\n"
        "    child = subprocess.run([sys.executable, '-c', 'import gc; print(gc.isenabled())'],\n"
        "                           capture_output=True, text=True, timeout=120)\n"
        "    assert child.stdout.split() == ['False'], child.stderr\n")
    run = soak_labs.run_pytest([str(tmp_path / "test_gc.py")], timeout=300, log=tmp_path / "log",
                               conditions={"gc": "never"})
    assert (run["passed"], run["failed"]) == (1, 0), (tmp_path / "log").read_text() if (tmp_path / "log").exists() else run
    (tmp_path / "test_often.py").write_text("import gc\n\ndef test_often():\n    assert gc.get_threshold() == (20, 4, 4)\n")
    run = soak_labs.run_pytest([str(tmp_path / "test_often.py")], timeout=300, log=tmp_path / "log2",
                               conditions={"gc": "often"})
    assert (run["passed"], run["failed"]) == (1, 0), run
