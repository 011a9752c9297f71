"""The fsdp-lab command line: env, bench, argument errors, and the list of subcommands."""

import datetime
import json
import pathlib
import platform
import shutil
import sys
import types

import pytest
import torch

from fsdp_lab import bandwidth, cli
from fsdp_lab import dist as fdist
from fsdp_lab.workshop import cli as workshop_cli


def test_env_reports_versions_devices_backends_and_a_working_launch(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    lines = {line[:24].strip(): line[25:] for line in out.splitlines()}
    assert lines["python"] == platform.python_version()
    assert lines["torch"] == torch.__version__
    n_gpus = torch.cuda.device_count()
    assert lines["CUDA"] == (f"available, {n_gpus} device(s)" if n_gpus else "not available")
    assert lines["gloo"] == "yes"
    if fdist.cpu_forced():  # conftest sets it where GPUs exist
        assert lines["auto backend, 2 ranks"] == "gloo on CPU (FSDP_LAB_DEVICE=cpu)"
    elif n_gpus >= 2:
        assert lines["auto backend, 2 ranks"] == "nccl, one GPU per rank"
    elif n_gpus == 0:
        assert lines["auto backend, 2 ranks"] == "gloo on CPU"
    assert lines["launch"].startswith("2 ranks, all_reduce of ones -> [2.0, 2.0]: ok in ")


def test_parse_sizes():
    assert cli.parse_sizes("1K,1M,16M") == [1024, 2**20, 16 * 2**20]
    assert cli.parse_sizes("4096, 2g, 3KiB") == [4096, 2 * 2**30, 3 * 1024]


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "--op", "all_to_all"], "argument --op: invalid choice: 'all_to_all'"),
    (["bench", "--sizes", "1K,12Q"], "bad size '12Q': use positive byte counts"),
    (["bench", "--sizes", "0"], "bad size '0'"),
    (["bench", "--world-size", "0"], "argument --world-size: expected an integer >= 1, got '0'"),
    (["env", "--world-size", "two"], "expected an integer >= 1, got 'two'"),
])
def test_argument_errors_exit_2_with_usage(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fsdp-lab") and message in err


def test_bench_passes_arguments_through_and_prints_a_table(capsys, monkeypatch):
    calls = []

    def fake_benchmark(op, sizes, world_size):
        calls.append((op, sizes, world_size))
        return [{"op": "all_gather", "bytes": 2**20, "world_size": world_size, "time_s": 0.002,
                 "algbw_GBps": 0.524288, "busbw_GBps": 0.393216}]

    monkeypatch.setattr(bandwidth, "benchmark", fake_benchmark)
    assert cli.main(["bench", "--op", "all_gather", "--sizes", "1M", "--world-size", "4"]) == 0
    assert calls == [("all_gather", [2**20], 4)]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["op", "size", "time"]
    assert table[1].split() == ["all_gather", "1", "MiB", "2000.0", "0.524", "0.393"]


def test_bench_runs_for_real(capsys):
    assert cli.main(["bench", "--op", "all_reduce", "--sizes", "4K,3", "--world-size", "2"]) == 0
    *rows, note = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    # 3 bytes is less than one float32 per rank: one each is measured (8 B), and the table says so
    assert [row[:3] for row in rows] == [["all_reduce", "4", "KiB"], ["all_reduce", "8", "B"]]
    assert " ".join(note) == "(sizes rounded to whole float32 elements per rank, a multiple of 8 B: 3 B -> 8 B)"
    time_us, algbw, busbw = map(float, rows[0][3:])
    # nccl-tests: algbw = S / t, busbw = algbw * 2(n-1)/n = algbw for n = 2 (rounded to 3 places)
    assert algbw == pytest.approx(4096 / (time_us * 1e-6) / 1e9, abs=1e-3)
    assert busbw == algbw


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage == "usage: fsdp-lab [-h] {env,bench,estimate,doctor,lab} ..."


def test_other_modules_add_subcommands(capsys, monkeypatch):
    def add_hello_parser(subparsers):
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("--times", type=int, default=1)
        parser.set_defaults(func=lambda args: print("hello " * args.times) or 3)

    module = types.ModuleType("hello_module")
    module.add_hello_parser = add_hello_parser
    monkeypatch.setitem(sys.modules, "hello_module", module)
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, "hello_module:add_hello_parser"])
    assert cli.main(["hello", "--times", "2"]) == 3
    assert capsys.readouterr().out == "hello hello \n"


def test_output_into_a_pipe_closed_early_ends_quietly():
    """`python -m fsdp_lab lab list | head -1` (the `fsdp-lab` command run as a module): the reader
    is gone before the command writes; no traceback."""
    import subprocess

    from _launch_helpers import env_with_repo

    command = subprocess.Popen([sys.executable, "-m", "fsdp_lab", "lab", "list"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_with_repo())
    command.stdout.close()  # the reader leaves at once
    _, err = command.communicate(timeout=120)
    assert command.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()



LABS = pathlib.Path(__file__).resolve().parents[1] / "labs"
LEARNER_CELL = {"cell_type": "code", "execution_count": None, "id": "learner-work", "metadata": {},
                "outputs": [], "source": "my_answer = 42  # the learner's own cell"}


@pytest.fixture
def learner_labs(tmp_path, monkeypatch):
    """A copy of labs/src with labs 00 and 03 as a learner left them (a cell of their own added)."""
    labs = tmp_path / "labs"
    shutil.copytree(LABS / "src", labs / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for stem in ("00_start_here", "03_zero_by_hand"):
        notebook = json.loads((LABS / f"{stem}.ipynb").read_text())
        notebook["cells"].append(LEARNER_CELL)
        (labs / f"{stem}.ipynb").write_text(json.dumps(notebook))
    # the command imports the copy's nbbuild under that name; put back whatever was there
    monkeypatch.delitem(sys.modules, "nbbuild", raising=False)
    return labs


def freeze_clock(monkeypatch):
    """Every backup stamp of `fsdp-lab lab reset` falls in the same second."""
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 5, 6, 7, 8, 9)

    monkeypatch.setattr(workshop_cli, "datetime", types.SimpleNamespace(datetime=Frozen))


def backups(labs, stem) -> list[list[dict]]:
    """The cells of every backup of lab ``stem``."""
    return [json.loads(p.read_text())["cells"] for p in sorted((labs / ".backup").glob(f"{stem}-*.ipynb"))]


def test_lab_reset_of_one_lab_named_twice_resets_it_once_and_keeps_the_learner_s_cell(learner_labs, capsys,
                                                                                     monkeypatch):
    freeze_clock(monkeypatch)
    assert cli.main(["lab", "--labs", str(learner_labs), "reset", "03", "3", "03_zero_by_hand"]) == 0
    assert capsys.readouterr().out.count("03_zero_by_hand.ipynb: back to the learner's copy") == 1
    kept = backups(learner_labs, "03_zero_by_hand")
    assert len(kept) == 1 and kept[0][-1]["source"] == LEARNER_CELL["source"]
    assert LEARNER_CELL["id"] not in [c.get("id") for c in
                                      json.loads((learner_labs / "03_zero_by_hand.ipynb").read_text())["cells"]]


def test_two_resets_in_the_same_second_keep_both_backups(learner_labs, capsys, monkeypatch):
    freeze_clock(monkeypatch)
    for _ in range(2):
        assert cli.main(["lab", "--labs", str(learner_labs), "reset", "03"]) == 0
    out = capsys.readouterr().out
    first, second = sorted((learner_labs / ".backup").glob("03_zero_by_hand-*.ipynb"))
    assert first.name == "03_zero_by_hand-20250506-070809.ipynb"
    assert second.name == "03_zero_by_hand-20250506-070809_2.ipynb" and str(second) in out
    learner, fresh = backups(learner_labs, "03_zero_by_hand")
    assert learner[-1]["source"] == LEARNER_CELL["source"] and learner != fresh
    assert LEARNER_CELL["source"] not in [c["source"] for c in fresh]


def test_lab_reset_with_an_unknown_lab_resets_none(learner_labs, capsys):
    before = (learner_labs / "00_start_here.ipynb").read_text()
    assert cli.main(["lab", "--labs", str(learner_labs), "reset", "00", "99"]) == 2
    out, err = capsys.readouterr()
    assert "no lab named '99'; the labs are: 00_start_here, 01_collectives" in err
    assert "back to the learner's copy" not in out
    assert (learner_labs / "00_start_here.ipynb").read_text() == before  # the learner's cell is still there
    assert not (learner_labs / ".backup").exists()
