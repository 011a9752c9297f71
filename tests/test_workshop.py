"""Workshop mode, the machinery: exercise markers and the two notebooks built from one source,
checker verdicts (stubs, errors, hangs), lab files shared by both copies, `fsdp-lab lab`.

The checkers of each lab, fed stubs, solutions and wrong answers on real ranks, are in
tests/test_workshop_labs.py.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import sys
import time
from queue import Empty

import pytest

from fsdp_lab.launch import LaunchError, LaunchTimeout
from fsdp_lab.workshop import checking, files
from fsdp_lab.workshop.checking import checker, correct, mistake

REPO = pathlib.Path(__file__).resolve().parents[1]
LABS = REPO / "labs"
sys.path.insert(0, str(LABS / "src"))
import nbbuild  # noqa: E402

# every lab whose source has exercise cells (a lab gains exercises without touching this file)
LABS_WITH_EXERCISES = [p.stem for p in sorted((LABS / "src").glob("[0-9][0-9]_*.py"))
                       if nbbuild.has_exercises(nbbuild.load_cells(p))]


# ----------------------------------------------------------------------------- markers


MARKED = '''
def f(x):
    y = x + 1
    ### BEGIN SOLUTION
    return y * 2
    ### END SOLUTION
    ### STUB raise NotImplementedError("double y")
'''


def test_markers_split_into_stub_and_solution():
    student, solution = nbbuild.split_markers(MARKED)
    assert student.splitlines() == ["def f(x):", "    y = x + 1", '    raise NotImplementedError("double y")']
    assert solution.splitlines() == ["def f(x):", "    y = x + 1", "    return y * 2"]


def test_multiline_stub_keeps_its_own_indentation():
    text = ('def g():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n'
            '    ### STUB raise NotImplementedError("a "\n    ### STUB                           "b")\n')
    student, _ = nbbuild.split_markers(text)
    assert student.splitlines()[1:] == ['    raise NotImplementedError("a "',
                                        '                              "b")']


@pytest.mark.parametrize("text, problem", [
    ("x = 1\n", "needs at least one"),
    ("### BEGIN SOLUTION\nx = 1\n", "without ### END"),
    ("### END SOLUTION\n", "without ### BEGIN"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
    ("### BEGIN SOLUTION\n### STUB x = 1\n### END SOLUTION\n", "inside a solution block"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n", "student version is not valid"),
])
def test_bad_markers_are_refused_with_the_reason(text, problem):
    with pytest.raises(ValueError, match=problem):
        nbbuild.split_markers(text)


def test_a_lab_without_exercises_builds_one_notebook_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(nbbuild, "LABS", tmp_path)
    monkeypatch.setattr(nbbuild, "SOLUTIONS", tmp_path / "solutions")
    path = nbbuild.build("99_plain.py", [nbbuild.md("# hi"), nbbuild.code("x = 1")], execute=False,
                         versions=("student", "solution"))
    assert path == tmp_path / "99_plain.ipynb" and path.exists()
    assert not (tmp_path / "solutions").exists()
    nb = json.loads(path.read_text())
    assert [c["id"] for c in nb["cells"]] == ["99-00", "99-01"]


def test_a_lab_with_exercises_builds_both_copies_from_one_source(tmp_path, monkeypatch):
    monkeypatch.setattr(nbbuild, "LABS", tmp_path)
    monkeypatch.setattr(nbbuild, "SOLUTIONS", tmp_path / "solutions")
    cells = [nbbuild.md("# lab"), nbbuild.exercise(MARKED), nbbuild.code("print(1)")]
    nbbuild.build("98_ex.py", cells, execute=False, versions=("student", "solution"))
    student = json.loads((tmp_path / "98_ex.ipynb").read_text())
    solution = json.loads((tmp_path / "solutions" / "98_ex.ipynb").read_text())
    assert "NotImplementedError" in "".join(student["cells"][1]["source"])
    assert "return y * 2" not in "".join(student["cells"][1]["source"])
    assert "return y * 2" in "".join(solution["cells"][1]["source"])
    assert student["cells"][1]["metadata"]["tags"] == ["exercise"]
    assert [c["id"] for c in student["cells"]] == [c["id"] for c in solution["cells"]]
    assert cells[2].get("outputs") == []  # building copies cells: the source list is untouched


def test_the_first_labs_have_exercises():
    assert {"00_start_here", "01_collectives", "03_zero_by_hand"} <= set(LABS_WITH_EXERCISES)


@pytest.mark.parametrize("lab", LABS_WITH_EXERCISES)
def test_every_exercise_has_a_real_stub_and_a_solution(lab):
    exercises = nbbuild.exercises(nbbuild.load_cells(LABS / "src" / f"{lab}.py"))
    assert len(exercises) >= 2, f"{lab}: the lesson allows two exercises or more"
    for ex in exercises:
        assert "NotImplementedError" in ex.student or "..." in ex.student
        assert "NotImplementedError" not in ex.solution and "###" not in ex.solution


@pytest.mark.parametrize("lab", LABS_WITH_EXERCISES)
def test_committed_notebooks_keep_solutions_apart(lab):
    exercises = nbbuild.exercises(nbbuild.load_cells(LABS / "src" / f"{lab}.py"))
    student = json.loads((LABS / f"{lab}.ipynb").read_text())
    solution = json.loads((LABS / "solutions" / f"{lab}.ipynb").read_text())
    sources = lambda nb: ["".join(c["source"]) for c in nb["cells"]]  # noqa: E731
    for ex in exercises:
        assert ex.student in sources(student) and ex.solution not in sources(student)
        assert ex.solution in sources(solution)
    # every code cell has run in both copies
    for nb in (student, solution):
        assert all(c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code")


def _compared_outputs(path: pathlib.Path) -> list[tuple[str, str]]:
    """(source, printed text) of each code cell whose output nbval compares."""
    cells = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code" or "nbval-ignore-output" in cell["metadata"].get("tags", []):
            continue
        text = "".join("".join(o["text"]) if "text" in o else "".join(o.get("data", {}).get("text/plain", ""))
                       for o in cell.get("outputs", []))
        cells.append(("".join(cell["source"]), text))
    return cells


@pytest.mark.parametrize("lab", LABS_WITH_EXERCISES)
def test_both_copies_print_the_same_outside_the_exercises(lab):
    """A learner's copy and the solution differ only in the exercise cells and their checks'
    verdicts: every other compared cell prints the same in both (a path that works from labs/
    but not from labs/solutions/ shows up here)."""
    student = _compared_outputs(LABS / f"{lab}.ipynb")
    solution = _compared_outputs(LABS / "solutions" / f"{lab}.ipynb")
    assert len(student) == len(solution)
    for (source, printed), (solution_source, solution_printed) in zip(student, solution):
        if source == solution_source and ".check_" not in source:
            assert printed == solution_printed, f"{lab}: the copies print differently after\n{source}"


@pytest.mark.parametrize("lab", LABS_WITH_EXERCISES)
def test_at_least_three_quarters_of_code_cells_are_compared(lab):
    for path in (LABS / f"{lab}.ipynb", LABS / "solutions" / f"{lab}.ipynb"):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        ignored = [c for c in cells if "nbval-ignore-output" in c["metadata"].get("tags", [])]
        assert len(ignored) <= len(cells) / 4, f"{path.name}: {len(ignored)} of {len(cells)} ignored"


def test_every_cell_that_compiles_is_tagged_for_machines_without_a_compiler():
    """The nbval plugin skips a ``needs-cpp-compiler`` cell where torch.compile cannot build C++;
    an untagged cell that compiles would fail ``pytest --nbval`` on such a machine."""
    from fsdp_lab.workshop.nbval_plugin import NEEDS_COMPILER
    compiling = 0
    for path in sorted(LABS.glob("[0-9][0-9]_*.ipynb")) + sorted(LABS.glob("solutions/[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code" and "torch.compile(" in "".join(cell["source"]):
                compiling += 1
                assert NEEDS_COMPILER in cell["metadata"].get("tags", []), f"{path.name}: untagged torch.compile"
    assert compiling >= 2  # lab 08's, in both copies


def test_lab_08_runs_on_past_its_compile_cells_without_a_compiler(monkeypatch):
    """JupyterLab's Run All stops at a cell that raises: where inductor cannot build C++, lab 08's
    ``needs-cpp-compiler`` cells say what is missing and time the eager forms instead."""
    import nbformat

    lab = nbformat.read(LABS / "08_qlora.ipynb", as_version=4)
    code_cells = [c for c in lab.cells if c.cell_type == "code"]
    tagged = [c for c in code_cells if "needs-cpp-compiler" in c.metadata.get("tags", [])]
    assert len(tagged) == 2
    cells = [nbformat.v4.new_code_cell(c.source) for c in [code_cells[0], *tagged]]
    notebook = nbformat.v4.new_notebook(cells=cells)
    monkeypatch.setenv("CXX", "no-such-c++")          # the compiler inductor calls, not on PATH
    monkeypatch.delenv(files.BUILD_ENV, raising=False)
    nbbuild.LabClient(notebook, timeout=300, kernel_name="python3",
                      resources={"metadata": {"path": str(LABS)}}).execute()   # raises if a cell raises
    compile_out, timing_out = ("".join(o.get("text", "") for o in c.outputs) for c in cells[1:])
    assert "not compiled here: torch.compile on CPU needs a C++ compiler ('no-such-c++' is not on PATH" in compile_out
    assert "eager (element-wise form)'s:" in timing_out and "compiled" not in timing_out


@pytest.mark.parametrize("notebook", sorted(LABS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_the_first_cell_starts_the_fork_server_after_importing_fsdp_lab(notebook):
    """docs/workshop.md: the server that forks the ranks loads torch while the first cells run."""
    first = next(c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code")
    lines = "".join(first["source"]).splitlines()
    assert "import fsdp_lab" in lines, f"{notebook.name}: the first cell does not import fsdp_lab"
    assert lines[lines.index("import fsdp_lab") + 1].startswith("fsdp_lab.start_fork_server("), (
        f"{notebook.name}: call fsdp_lab.start_fork_server() right after `import fsdp_lab`")


# ----------------------------------------------------------------------------- verdicts


@checker("double", hint="return twice x")
def check_double(fn):
    if fn(2) == 4:
        return correct("2 doubled is 4")
    if fn(2) == 2:
        return mistake("unchanged", "x came back unchanged")
    return mistake("wrong", f"got {fn(2)}", "multiply by 2")


def test_a_stub_is_not_solved_and_nothing_runs():
    calls = []

    def double(x):
        calls.append(x)
        raise NotImplementedError("return twice x")

    verdict = check_double(double)
    assert (verdict.status, verdict.mistake, calls) == (checking.NOT_SOLVED, "stub", [])
    assert "`double` still raises NotImplementedError" in repr(verdict)
    assert "hint: return twice x" in repr(verdict) and "Traceback" not in repr(verdict)


def test_verdicts_for_right_and_wrong_answers():
    right = check_double(lambda x: 2 * x)
    assert right.solved and repr(right) == "[double] correct: 2 doubled is 4"
    unchanged = check_double(lambda x: x)
    assert (unchanged.status, unchanged.mistake) == (checking.WRONG, "unchanged")
    assert unchanged.hint == "return twice x"           # the exercise's hint by default
    assert check_double(lambda x: x + 5).hint == "multiply by 2"


def test_an_error_is_one_line_and_a_placeholder_is_not_solved():
    def broken(x):
        return {}[x]

    verdict = check_double(broken)
    assert (verdict.mistake, verdict.message) == ("raised", "your code raised KeyError: 2")
    assert check_double(lambda x: ... + 1).status == checking.NOT_SOLVED


def test_a_stub_left_in_one_method_of_a_class_is_named():
    class Stage:
        def ready(self):
            return 1

        def todo(self):
            raise NotImplementedError

    assert checking.unfinished_parts(Stage) == ["Stage.todo"]
    assert checking.unfinished_parts(lambda: 1) == []


def test_failing_ranks_and_hangs_become_verdicts():
    @checker("ranks", hint="h")
    def check_ranks(error):
        raise error

    tb = 'Traceback (most recent call last):\n  File "x", line 1\nValueError: bad shard\n'
    failed = check_ranks(LaunchError("rank 1 raised ValueError: bad shard\n--- traceback ---\n" + tb,
                                     rank=1, traceback=tb))
    assert failed.message == "rank 1 raised ValueError: bad shard"
    stub = check_ranks(LaunchError("rank 0 raised NotImplementedError: write it", rank=0, traceback="x"))
    assert stub.status == checking.NOT_SOLVED
    hang = check_ranks(LaunchTimeout("timed out", ["all_reduce #2 (16 B)", "all_gather #2 (32 B)"]))
    assert hang.mistake == "hang" and "rank 1: all_gather #2 (32 B)" in hang.message
    # a rank returned before a collective its peer waited in: gloo closes the pair
    left = check_ranks(LaunchError("rank 1 raised RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                                   "Connection closed by peer [127.0.0.1]:41577", rank=1, traceback="x"))
    assert left.mistake == "peer_left" and "did not call the same collectives" in left.message


def test_error_line_leaves_out_the_failing_rank_and_gloo_s_addresses():
    shard = LaunchError("rank 2 raised ValueError: bad shard\n--- traceback ---\nx", rank=2, traceback="x")
    assert checking.error_line(shard) == "ValueError: bad shard"
    closed = LaunchError("rank 1 raised RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                         "Connection closed by peer [127.0.0.1]:41577", rank=1, traceback="x")
    assert checking.error_line(closed) == "RuntimeError: a collective failed: gloo lost its connection to another rank"
    assert checking.error_line(KeyError("w1")) == "KeyError: 'w1'"
    size = LaunchError("rank 0 raised RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 "
                       "(expected (2, 5), got (10))", rank=0, traceback="x")
    assert checking.error_line(size).endswith("invalid tensor size at index 0 (expected (2, 5), got (10))")


# ----------------------------------------------------------------------------- files


def test_both_copies_of_a_lab_use_the_same_figures_folder(tmp_path, monkeypatch):
    (tmp_path / "solutions").mkdir()
    for building, folder in (("1", "figures"), ("0", "my_figures")):
        monkeypatch.setenv(files.BUILD_ENV, building)
        learner = files.lab_files("07_x", cwd=tmp_path)
        solution = files.lab_files("07_x", cwd=tmp_path / "solutions")
        assert learner.figures == solution.figures == tmp_path / folder / "07_x"
        assert (learner.solution, solution.solution) == (False, True)


def test_only_the_lab_build_writes_the_committed_figures(tmp_path, monkeypatch):
    (tmp_path / "figures" / "07_x").mkdir(parents=True)
    (tmp_path / "figures" / "07_x" / "fig.txt").write_text("committed")
    monkeypatch.delenv(files.BUILD_ENV, raising=False)
    learner = files.lab_files("07_x", cwd=tmp_path)          # a learner's run, or nbval's
    learner.save("fig.txt", lambda path: pathlib.Path(path).write_text("learner"))
    assert (tmp_path / "figures" / "07_x" / "fig.txt").read_text() == "committed"
    assert (tmp_path / "my_figures" / "07_x" / "fig.txt").read_text() == "learner"


def test_the_solution_copy_never_overwrites_a_figure(tmp_path, monkeypatch):
    monkeypatch.setenv(files.BUILD_ENV, "1")
    (tmp_path / "solutions").mkdir()
    learner = files.lab_files("07_x", cwd=tmp_path)
    solution = files.lab_files("07_x", cwd=tmp_path / "solutions")
    write = lambda text: lambda path: pathlib.Path(path).write_text(text)  # noqa: E731
    solution.save("new.txt", write("from the solution"))      # missing: written
    learner.save("fig.txt", write("learner"))
    solution.save("fig.txt", write("solution"))               # present: left alone
    learner.save("new.txt", write("learner again"))           # the learner's copy always writes
    assert (learner.figures / "fig.txt").read_text() == "learner"
    assert (learner.figures / "new.txt").read_text() == "learner again"
    with pytest.raises(ValueError, match="NN_name"):
        files.lab_files("figures")


def test_a_figure_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.delenv(files.BUILD_ENV, raising=False)
    learner = files.lab_files("07_x", cwd=tmp_path)
    target = learner.figures / "fig.txt"
    target.write_text("earlier run")

    def write_seen_midway(path):
        pathlib.Path(path).write_text("half")
        assert target.read_text() == "earlier run"   # a reader mid-write still sees the whole old file
        pathlib.Path(path).write_text("half and the rest")

    learner.save("fig.txt", write_seen_midway)
    assert target.read_text() == "half and the rest"

    def fail_midway(path):
        pathlib.Path(path).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        learner.save("fig.txt", fail_midway)
    assert target.read_text() == "half and the rest"
    assert sorted(p.name for p in learner.figures.iterdir()) == ["fig.txt"]   # no partial file left


# ----------------------------------------------------------------------------- fsdp-lab lab


@pytest.fixture
def labs_copy(tmp_path):
    """A copy of labs/src and lab 00's notebooks, for commands that write."""
    labs = tmp_path / "labs"
    shutil.copytree(LABS / "src", labs / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (labs / "solutions").mkdir()
    shutil.copy(LABS / "00_start_here.ipynb", labs)
    shutil.copy(LABS / "solutions" / "00_start_here.ipynb", labs / "solutions")
    yield labs
    sys.modules["nbbuild"] = nbbuild  # the command loaded the copy's; lab sources import by name


class UnwokenWaits:
    """A shell channel's ``get_msg`` whose message is there from the start but whose first
    ``misses`` waits are not woken by it: each runs to its timeout, as the real one did."""

    def __init__(self, misses: int | None):
        self.misses, self.timeouts = misses, []

    async def get_msg(self, timeout=None):
        self.timeouts.append(timeout)
        if self.misses is not None and len(self.timeouts) > self.misses:
            return {"msg_type": "execute_reply"}
        await asyncio.sleep(timeout)
        raise Empty


def test_lab_client_reads_a_reply_whose_wait_was_not_woken_within_a_slice(monkeypatch):
    monkeypatch.setattr(nbbuild, "SHELL_WAIT_SLICE_S", 0.05)
    channel = UnwokenWaits(misses=2)
    reply = asyncio.run(nbbuild._sliced(channel.get_msg)(timeout=600))
    assert reply == {"msg_type": "execute_reply"} and channel.timeouts == [0.05, 0.05, 0.05]
    # a cell's own timeout still ends the wait, with the error nbclient expects
    channel = UnwokenWaits(misses=None)
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(nbbuild._sliced(channel.get_msg)(timeout=0.2))
    assert time.monotonic() - start >= 0.19 and all(t <= 0.05 for t in channel.timeouts)
    # no timeout: slices until a message comes
    channel = UnwokenWaits(misses=3)
    assert asyncio.run(nbbuild._sliced(channel.get_msg)(timeout=None)) == {"msg_type": "execute_reply"}


def test_lab_reset_brings_the_stubs_back_and_keeps_a_backup(labs_copy, capsys):
    from fsdp_lab import cli

    notebook = labs_copy / "00_start_here.ipynb"
    edited = json.loads(notebook.read_text())
    solved = json.loads((labs_copy / "solutions" / "00_start_here.ipynb").read_text())
    edited["cells"] = solved["cells"]                        # the learner solved everything
    notebook.write_text(json.dumps(edited))
    assert cli.main(["lab", "--labs", str(labs_copy), "reset", "0"]) == 0
    out = capsys.readouterr().out
    assert "00_start_here.ipynb: back to the learner's copy" in out
    reset_cells = json.loads(notebook.read_text())["cells"]
    shipped = json.loads((LABS / "00_start_here.ipynb").read_text())["cells"]
    assert [c["source"] for c in reset_cells] == [c["source"] for c in shipped]
    assert all(not c.get("outputs") for c in reset_cells if c["cell_type"] == "code")
    backups = list((labs_copy / ".backup").glob("00_start_here-*.ipynb"))
    assert len(backups) == 1 and json.loads(backups[0].read_text())["cells"] == solved["cells"]


def test_lab_reset_execute_writes_the_learner_s_figures_not_the_shipped_ones(labs_copy, capsys, monkeypatch):
    from fsdp_lab import cli

    monkeypatch.setenv("FSDP_LAB_BUILD", "1")  # even after a build in the same shell
    assert cli.main(["lab", "--labs", str(labs_copy), "reset", "0", "--execute"]) == 0
    assert "with fresh outputs" in capsys.readouterr().out
    assert (labs_copy / "my_figures" / "00_start_here" / "all_reduce_4_ranks.png").is_file()
    assert not (labs_copy / "figures").exists()  # the committed figures' folder is never written


def test_lab_solution_and_list_say_where_things_are(labs_copy, capsys):
    from fsdp_lab import cli

    assert cli.main(["lab", "list", "--labs", str(labs_copy)]) == 0  # after the action, too
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["00_start_here"] == ["2", "labs/solutions/00_start_here.ipynb"]
    assert rows["02_memory_anatomy"] == ["2", "-"] and rows["03_zero_by_hand"] == ["4", "-"]
    without = [lab for lab in rows if rows[lab][0] == "0"]  # labs not yet in workshop mode, if any

    assert cli.main(["lab", "--labs", "/no/such/labs", "solution", "start_here", "--labs", str(labs_copy)]) == 0
    assert f"jupyter lab {labs_copy / 'solutions' / '00_start_here.ipynb'}" in capsys.readouterr().out
    if without:
        assert cli.main(["lab", "--labs", str(labs_copy), "solution", without[0][:2]]) == 1
        assert f"{without[0]} has no exercises" in capsys.readouterr().out
    assert cli.main(["lab", "--labs", str(labs_copy), "reset", "42"]) == 2
    assert "no lab named '42'; the labs are: 00_start_here" in capsys.readouterr().err
