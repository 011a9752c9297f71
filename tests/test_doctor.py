"""`fsdp-lab doctor`: each check reports OK on this machine and names the fix when it fails."""

import argparse
import importlib
import json

import pytest
import torch

from fsdp_lab import doctor


def run(capsys, *flags) -> tuple[int, str]:
    """Parse ``doctor *flags`` as the CLI does and run it; returns (exit code, printed text)."""
    parser = argparse.ArgumentParser(prog="fsdp-lab")
    doctor.add_doctor_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *flags])
    code = args.func(args)
    return code, capsys.readouterr().out


def line_of(output: str, name: str) -> str:
    """The report line of check ``name`` plus its "->" fix line, if any."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line[6:].startswith(name):
            fix = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].lstrip().startswith("->") else ""
            return f"{line}\n{fix}"
    raise AssertionError(f"no line for {name!r} in:\n{output}")


def pretend_missing(monkeypatch, *distributions):
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda name: None if name in distributions else real(name))


@pytest.mark.parametrize("text, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("2.6.0", (2, 6, 0)), ("4.0.0rc1", (4, 0, 0)), ("8", (8,)),
])
def test_parse_version(text, expected):
    assert doctor.parse_version(text) == expected


def test_parse_version_orders_two_digit_minors():
    assert doctor.parse_version("2.10.1")[:2] >= doctor.MIN_TORCH  # 10 > 6, not "1" < "6"
    assert doctor.parse_version("2.5.1")[:2] < doctor.MIN_TORCH


def test_parse_version_rejects_garbage():
    with pytest.raises(ValueError, match="not a version"):
        doctor.parse_version("unknown")


def test_python_version_boundary():
    assert doctor.check_python((3, 11, 0)).status == "OK"
    old = doctor.check_python((3, 10, 13))
    assert old.status == "FAIL" and "3.10.13" in old.detail and "Python >= 3.11" in old.fix


def test_minimum_python_is_pyprojects():
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=" + ".".join(map(str, doctor.MIN_PYTHON))


def test_platform_check_fails_on_windows_and_only_warns_off_linux():
    assert doctor.check_platform("linux").status == "OK"
    windows = doctor.check_platform("win32")
    assert windows.status == "FAIL" and "win32" in windows.detail and "WSL2" in windows.fix
    mac = doctor.check_platform("darwin")
    assert mac.status == "WARN" and "2-rank launch" in mac.fix


def test_this_machine_passes_without_launch(capsys):
    code, out = run(capsys, "--no-launch")
    assert code == 0, out
    assert "2-rank launch" not in out
    for name in ("platform", "Python", "torch", "gloo", "JupyterLab", "ipykernel", "ipywidgets",
                 "widgets extension", "matplotlib"):
        assert line_of(out, name).startswith("OK"), out
    assert f"{torch.__version__} (CPU build)" in out or "CUDA" in out


def test_missing_jupyterlab_fails_and_names_the_install(monkeypatch, capsys):
    pretend_missing(monkeypatch, "jupyterlab")
    code, out = run(capsys, "--no-launch")
    assert code == 1
    line = line_of(out, "JupyterLab")
    assert line.startswith("FAIL") and "not installed" in line
    assert "pip install 'jupyterlab>=4'" in line and '.[lab]' in line
    assert "fix the FAIL lines" in out


def test_old_ipywidgets_fails_with_upgrade_command(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda name: "7.8.1" if name == "ipywidgets" else real(name))
    check = doctor.check_ipywidgets()
    assert check.status == "FAIL" and "7.8.1 is older than 8" in check.detail
    assert check.fix == "pip install --upgrade 'ipywidgets>=8'"


def test_missing_nbval_only_warns(monkeypatch, capsys):
    pretend_missing(monkeypatch, "nbval")
    code, out = run(capsys, "--no-launch")
    assert code == 0
    assert line_of(out, "nbval").startswith("WARN") and "pip install nbval" in line_of(out, "nbval")


def test_missing_pytest_xdist_only_warns_and_says_how_to_test_without_it(monkeypatch, capsys):
    pretend_missing(monkeypatch, "pytest-xdist")
    code, out = run(capsys, "--no-launch")
    line = line_of(out, "pytest-xdist")
    assert code == 0 and line.startswith("WARN")
    assert "pip install pytest-xdist" in line and "leave `-n 2 --dist loadfile` out" in line


def test_missing_cpp_toolchain_only_warns_and_names_the_default_source(monkeypatch, capsys):
    import shutil

    real = shutil.which
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "no-such-c++" else real(name, *a, **k))
    code, out = run(capsys, "--no-launch")
    line = line_of(out, "C++ toolchain")
    assert code == 0 and line.startswith("WARN")
    assert "'no-such-c++' is not on PATH" in line and "source='dispatch'" in line
    assert "lab 08's two torch.compile cells" in line


def test_missing_python_headers_warn_once_for_both_builds(monkeypatch):
    import torch.utils.cpp_extension

    from fsdp_lab import toolchain
    monkeypatch.setattr(toolchain, "compiler_missing", lambda names: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(toolchain, "python_headers_missing", lambda: "Python's C headers (no Python.h in /x)")
    check = doctor.check_cpp_toolchain()
    assert (check.status, check.detail) == ("WARN", "missing Python's C headers (no Python.h in /x)")
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    check = doctor.check_cpp_toolchain()  # ninja is the extension's alone
    assert check.detail == ("MemoryTracker(source='allocator'): missing ninja (`pip install ninja`) and Python's "
                            "C headers (no Python.h in /x); torch.compile on CPU: missing Python's C headers "
                            "(no Python.h in /x)")


def test_widgets_extension_missing_from_jupyterlab_paths(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "labextension_dirs", lambda: [tmp_path])
    check = doctor.check_widgets_extension()
    assert check.status == "FAIL" and "widgets would show as text" in check.detail
    assert "jupyterlab_widgets" in check.fix and "restart JupyterLab" in check.fix

    pretend_missing(monkeypatch, "jupyterlab_widgets")
    check = doctor.check_widgets_extension()
    assert check.status == "FAIL" and "jupyterlab_widgets is not installed" in check.detail
    assert "pip install 'jupyterlab_widgets>=3'" in check.fix


def test_widgets_extension_found_in_a_labextensions_folder(monkeypatch, tmp_path):
    package = tmp_path / "@jupyter-widgets" / "jupyterlab-manager" / "package.json"
    package.parent.mkdir(parents=True)
    package.write_text(json.dumps({"name": "@jupyter-widgets/jupyterlab-manager", "version": "5.0.99"}))
    monkeypatch.setattr(doctor, "labextension_dirs", lambda: [tmp_path / "elsewhere", tmp_path])
    check = doctor.check_widgets_extension()
    assert check.status == "OK" and "5.0.99" in check.detail and str(tmp_path) in check.detail


def test_disabled_widgets_extension_fails_with_enable_command(monkeypatch):
    monkeypatch.setattr(doctor, "disabled_labextensions", lambda: {doctor.WIDGETS_EXTENSION})
    check = doctor.check_widgets_extension()
    assert check.status == "FAIL" and "disabled" in check.detail
    assert check.fix.startswith("jupyter labextension enable @jupyter-widgets/jupyterlab-manager")


def test_old_torch_fails(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    check = doctor.check_torch()
    assert check.status == "FAIL" and "2.5.1+cpu" in check.detail
    assert "torch>=2.6" in check.fix


@pytest.mark.parametrize("version, status", [
    ("2.13.0+cpu", "OK"), ("2.13.0+cu128", "OK"), ("2.14.1", "OK"), ("2.15.0+cpu", "OK"),
    ("2.12.0+cpu", "WARN"), ("2.13.1", "WARN"), ("2.16.0", "WARN"), ("2.6.0", "WARN"),
])
def test_a_torch_the_labs_were_not_checked_with_warns_and_names_the_pin(monkeypatch, version, status):
    monkeypatch.setattr(torch, "__version__", version)
    check = doctor.check_torch()
    assert check.status == status, check
    if status == "WARN":
        assert version in check.detail and "recorded with 2.13.0" in check.detail
        assert "pip install torch==2.13.0" in check.fix


def test_the_labs_torch_is_the_one_ci_installs_and_the_readme_names():
    import pathlib
    import re

    repo = pathlib.Path(__file__).parents[1]
    pinned = re.findall(r"pip install --quiet torch==([\d.]+)", (repo / ".ci" / "run").read_text())
    assert pinned == [".".join(map(str, doctor.LAB_TORCH))]
    readme = (repo / "README.md").read_text()
    assert f"**Which torch a workshop uses: {pinned[0]}.**" in readme
    assert all(".".join(map(str, v)) in readme for v in doctor.LAB_TORCH_ALSO)


def test_cuda_build_without_a_visible_gpu_warns(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check = doctor.check_cuda()
    assert check.status == "WARN" and "nvidia-smi" in check.fix and "CPU build" in check.fix


def test_missing_gloo_fails(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    check = doctor.check_gloo()
    assert check.status == "FAIL" and "pytorch.org" in check.fix


def test_a_crashing_check_is_a_fail_not_a_crash(monkeypatch, capsys):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "check_matplotlib", broken)
    code, out = run(capsys, "--no-launch")
    assert code == 1
    assert line_of(out, "matplotlib").startswith("FAIL") and "crashed: RuntimeError: boom" in out


def test_failed_launch_names_the_fix(monkeypatch):
    launch_module = importlib.import_module("fsdp_lab.launch")

    def refuse(*args, **kwargs):
        raise launch_module.LaunchError("rank 1 died without reporting (exit code -9)")

    monkeypatch.setattr(launch_module, "launch", refuse)
    check = doctor.check_launch(timeout=5)
    assert check.status == "FAIL" and "rank 1 died" in check.detail
    assert "127.0.0.1" in check.fix and "fsdp_lab.launch(print, 1, world_size=2)" in check.fix


def test_a_launch_that_runs_out_of_time_asks_for_more_time(monkeypatch):
    launch_module = importlib.import_module("fsdp_lab.launch")

    def slow(*args, **kwargs):
        raise launch_module.LaunchTimeout("launch timed out after 0.5 s; ranks still running: 0, 1", [])

    monkeypatch.setattr(launch_module, "launch", slow)
    check = doctor.check_launch(timeout=0.5)
    assert check.status == "FAIL" and "did not finish one all-reduce in 0.5 s" in check.fix
    assert "--launch-timeout SECONDS" in check.fix and "loopback" not in check.fix


def test_a_gloo_interface_the_machine_lacks_fails_with_its_interfaces_not_loopback_advice(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    check = doctor.check_launch(timeout=5)  # refused before any rank starts
    assert check.status == "FAIL" and "GLOO_SOCKET_IFNAME='bogus0'" in check.detail and "bogus0" in check.detail
    assert "unset GLOO_SOCKET_IFNAME" in check.fix and "interfaces this machine has: lo, eth0" in check.fix
    assert "127.0.0.1" not in check.fix


def test_fsdp_lab_device_that_is_no_device_fails_with_unset_or_cpu_not_loopback_advice(monkeypatch):
    monkeypatch.setenv("FSDP_LAB_DEVICE", "gpu")
    check = doctor.check_launch(timeout=5)  # refused before any rank starts
    assert check.status == "FAIL" and "FSDP_LAB_DEVICE='gpu' is not a device" in check.detail
    assert "unset FSDP_LAB_DEVICE" in check.fix and "export FSDP_LAB_DEVICE=cpu" in check.fix
    assert "127.0.0.1" not in check.fix


def test_another_setting_launch_refuses_gets_its_own_message_not_loopback_advice(monkeypatch):
    launch_module = importlib.import_module("fsdp_lab.launch")

    def refuse(*args, **kwargs):
        raise ValueError("FSDP_LAB_LAUNCH_START must be 'fork' or 'spawn', got 'sideways'")

    monkeypatch.setattr(launch_module, "launch", refuse)
    check = doctor.check_launch(timeout=5)
    assert check.status == "FAIL" and "FSDP_LAB_LAUNCH_START must be 'fork' or 'spawn'" in check.detail
    assert "change the setting this message names" in check.fix and "127.0.0.1" not in check.fix


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_launch_timeout_that_is_no_time_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as info:
        run(capsys, "--launch-timeout", value)
    assert info.value.code == 2
    assert f"--launch-timeout: expected a number of seconds above 0, got '{value}'" in capsys.readouterr().err


def test_real_two_rank_all_reduce_sums_one_plus_two(capsys):
    code, out = run(capsys, "--launch-timeout", "120")
    assert code == 0, out
    assert line_of(out, "2-rank launch").startswith("OK") and "gives 3.0" in out
