"""``fsdp-lab doctor``: check that this machine can run the labs, and say what to fix.

Each check prints one line, ``OK``, ``WARN`` or ``FAIL``, and every FAIL (and WARN) says what
to do about it. The exit code is 0 when nothing FAILs. The checks, in order: platform (POSIX),
Python, torch (version and build), CUDA GPUs, NCCL, gloo, JupyterLab, ipykernel, ipywidgets and
its JupyterLab extension, nbval, pytest-xdist, a C++ toolchain (optional), matplotlib, and a 2-rank
``fsdp_lab.launch`` of an all-reduce.

    fsdp-lab doctor                 # all checks
    fsdp-lab doctor --no-launch     # skip starting two processes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import pathlib
import re
import socket
import sys
from typing import Callable, Iterator

MIN_PYTHON = (3, 11)  # pyproject.toml's requires-python (the lab extra's transformers needs it)
MIN_TORCH = (2, 6)
LAB_TORCH = (2, 13, 0)  # the release the labs' compared outputs are recorded with (README, "Which torch")
LAB_TORCH_ALSO = ((2, 14, 1), (2, 15, 0))  # releases the recorded outputs were checked to hold with
MIN_JUPYTERLAB = (4,)
MIN_IPYWIDGETS = (8,)
WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
LAB_EXTRA = 'pip install -e ".[lab]"  (from the fsdp_lab checkout)'


@dataclasses.dataclass
class Check:
    """One line of the report: ``status`` is "OK", "WARN" or "FAIL"; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<5} {self.name:<22} {self.detail}"
        return f"{text}\n      -> {self.fix}" if self.fix and self.status != "OK" else text


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "2.13.0+cpu" -> (2, 13, 0), "4.0.0rc1" -> (4, 0, 0)."""
    numbers = re.match(r"\d+(\.\d+)*", text.strip())
    if numbers is None:
        raise ValueError(f"not a version string: {text!r}")
    return tuple(int(part) for part in numbers.group(0).split("."))


def _as_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def installed_version(distribution: str) -> str | None:
    """Version of an installed pip distribution (e.g. "jupyterlab"), or None when it is absent."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_platform(platform: str = sys.platform) -> Check:
    """``launch`` needs a POSIX system; Linux is what fsdp_lab's own runs use."""
    from fsdp_lab.launch import require_posix
    try:
        require_posix(platform)
    except OSError:
        return Check("platform", "FAIL", f"{platform}: fsdp_lab.launch cannot start ranks here",
                     "run the labs inside WSL2 (Ubuntu) and repeat the README's set-up there")
    if platform.startswith("linux"):
        return Check("platform", "OK", platform)
    return Check("platform", "WARN", f"{platform}: POSIX, but fsdp_lab's tests run on Linux only",
                 "the 2-rank launch check below shows whether ranks start and talk here")


def check_python(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    """Python must be at least MIN_PYTHON."""
    if tuple(version[:2]) >= MIN_PYTHON:
        return Check("Python", "OK", _as_text(version))
    return Check("Python", "FAIL", f"{_as_text(version)} is older than {_as_text(MIN_PYTHON)}",
                 f"use Python >= {_as_text(MIN_PYTHON)} (e.g. `conda env create -f environment.yml`)")


def check_torch() -> Check:
    """torch must import and be at least MIN_TORCH; the line names its build (CPU, CUDA, ROCm).
    A release the labs' outputs were not checked with (``LAB_TORCH``, ``LAB_TORCH_ALSO``) is a
    WARN: the package works, but ``pytest --nbval labs/`` may report a loss or a byte count."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as error:
        return Check("torch", "FAIL", f"cannot import torch ({error})",
                     "pip install 'torch>=2.6' (CPU only: add --index-url "
                     "https://download.pytorch.org/whl/cpu)")
    build = (f"CUDA {torch.version.cuda} build" if torch.version.cuda
             else f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None)
             else "CPU build")
    version = torch.__version__
    if parse_version(version)[:2] < MIN_TORCH:
        return Check("torch", "FAIL", f"{version} ({build}) is older than {_as_text(MIN_TORCH)}",
                     f"pip install --upgrade 'torch>={_as_text(MIN_TORCH)}'")
    if parse_version(version)[:3] not in (LAB_TORCH, *LAB_TORCH_ALSO):
        also = " and ".join(map(_as_text, LAB_TORCH_ALSO))
        return Check("torch", "WARN",
                     f"{version} ({build}): the labs' compared outputs are recorded with "
                     f"{_as_text(LAB_TORCH)} (and held with {also}); with this release a loss or a "
                     "byte count can differ, and `pytest --nbval labs/` then reports the cell",
                     f"for a workshop: pip install torch=={_as_text(LAB_TORCH)}  (CPU only: add "
                     "--index-url https://download.pytorch.org/whl/cpu)")
    return Check("torch", "OK", f"{version} ({build})")


def check_cuda() -> Check:
    """GPUs torch can use: how many, their names and memory. None is fine (labs run on CPU)."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check("CUDA GPUs", "WARN", "not checked: torch is missing", "install torch first")
    if not torch.version.cuda and not getattr(torch.version, "hip", None):
        return Check("CUDA GPUs", "OK", "none (CPU build of torch): the labs run on CPU with gloo")
    if not torch.cuda.is_available():
        return Check("CUDA GPUs", "WARN", "torch has CUDA but sees no GPU: the labs will run on CPU",
                     "check `nvidia-smi`, the driver version, and CUDA_VISIBLE_DEVICES; on a machine "
                     "without a GPU torch's CPU build (README) is the smaller install and the one CI tests")
    gpus = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(f"{index}: {properties.name} {properties.total_memory / 2**30:.1f} GiB")
    return Check("CUDA GPUs", "OK", f"{len(gpus)} GPU(s): " + "; ".join(gpus))


def check_nccl() -> Check:
    """NCCL, the GPU backend; only needed when there are GPUs."""
    try:
        torch = importlib.import_module("torch")
        dist = importlib.import_module("torch.distributed")
    except ImportError:
        return Check("NCCL", "WARN", "not checked: torch is missing", "install torch first")
    gpus = torch.cuda.device_count() if torch.version.cuda else 0
    if not dist.is_available() or not dist.is_nccl_available():
        if gpus:
            return Check("NCCL", "WARN", f"not in this torch build, yet {gpus} GPU(s) are present: "
                         "ranks will use gloo", "install a CUDA build of torch from pytorch.org")
        return Check("NCCL", "OK", "not available (not needed without GPUs)")
    version = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "present"
    return Check("NCCL", "OK", f"{version}" + ("" if gpus else " (unused without GPUs)"))


def check_gloo() -> Check:
    """gloo, the CPU backend every lab can fall back to."""
    try:
        dist = importlib.import_module("torch.distributed")
    except ImportError:
        return Check("gloo", "FAIL", "torch.distributed cannot be imported", "install torch first")
    if dist.is_available() and dist.is_gloo_available():
        return Check("gloo", "OK", "available")
    return Check("gloo", "FAIL", "this torch build has no gloo backend (needed for CPU ranks)",
                 "install an official torch wheel from pytorch.org (they include gloo)")


def _check_package(name: str, distribution: str, minimum: tuple[int, ...] | None,
                   fix: str, status_if_missing: str = "FAIL", why: str = "") -> Check:
    version = installed_version(distribution)
    if version is None:
        return Check(name, status_if_missing, f"not installed{why}", fix)
    if minimum and parse_version(version)[:len(minimum)] < minimum:
        return Check(name, status_if_missing, f"{version} is older than {_as_text(minimum)}{why}",
                     f"pip install --upgrade '{distribution}>={_as_text(minimum)}'")
    return Check(name, "OK", version)


def check_jupyterlab() -> Check:
    """JupyterLab 4 or later, where the labs are opened."""
    return _check_package("JupyterLab", "jupyterlab", MIN_JUPYTERLAB,
                          f"pip install 'jupyterlab>=4'  (or {LAB_EXTRA})")


def check_ipykernel() -> Check:
    """ipykernel, the Python kernel JupyterLab runs the notebooks in."""
    return _check_package("ipykernel", "ipykernel", None, f"pip install ipykernel  (or {LAB_EXTRA})")


def check_ipywidgets() -> Check:
    """ipywidgets 8 or later (the Python side of every lab's widgets)."""
    return _check_package("ipywidgets", "ipywidgets", MIN_IPYWIDGETS, "pip install 'ipywidgets>=8'")


def check_nbval() -> Check:
    """nbval, which checks the notebooks' outputs; only needed to test the labs."""
    return _check_package("nbval", "nbval", None, f"pip install nbval  (or {LAB_EXTRA})",
                          status_if_missing="WARN", why=" (needed only for `pytest --nbval labs/`)")


def check_pytest_xdist() -> Check:
    """pytest-xdist, which the README's test command uses to run two workers."""
    return _check_package("pytest-xdist", "pytest-xdist", None, f"pip install pytest-xdist  (or {LAB_EXTRA})",
                          status_if_missing="WARN",
                          why=" (needed only for the test command's `-n 2`; without it, leave `-n 2 "
                              "--dist loadfile` out)")


def check_cpp_toolchain() -> Check:
    """A C++ compiler, ninja and Python's headers, which ``MemoryTracker(source="allocator")``
    builds its allocation log with at first use; the compiler and the headers are what lab 08's
    two ``torch.compile`` cells need (inductor writes C++ on CPU). Optional: the default tracker
    needs none of it, and ``pytest --nbval`` skips those cells without it."""
    from fsdp_lab.toolchain import missing_for_extension, missing_for_torch_compile
    for_extension, for_compile = missing_for_extension(), missing_for_torch_compile()
    if for_extension is None and for_compile is None:
        return Check("C++ toolchain", "OK", "compiler, ninja and Python's headers found "
                                            "(MemoryTracker(source='allocator'), torch.compile on CPU in lab 08)")
    missing = f"missing {for_extension}" if for_extension == for_compile else "; ".join(
        f"{what}: missing {m}" for what, m in (("MemoryTracker(source='allocator')", for_extension),
                                               ("torch.compile on CPU", for_compile)) if m)
    return Check("C++ toolchain", "WARN", missing,
                 "needed only for MemoryTracker(source='allocator') and its tests and for lab 08's two "
                 "torch.compile cells; all are skipped under pytest without it, and the default "
                 "source='dispatch' needs no compiler")


def labextension_dirs() -> list[pathlib.Path]:
    """The folders JupyterLab loads prebuilt extensions from (jupyter_core's search path)."""
    try:
        from jupyter_core.paths import jupyter_path
    except ImportError:
        return [pathlib.Path(sys.prefix) / "share" / "jupyter" / "labextensions"]
    return [pathlib.Path(p) for p in jupyter_path("labextensions")]


def disabled_labextensions() -> set[str]:
    """Names of the JupyterLab extensions switched off in Jupyter's page_config.json files."""
    try:
        from jupyterlab_server.config import get_static_page_config
    except ImportError:
        return set()
    disabled = get_static_page_config(level="all").get("disabledExtensions", {})
    if isinstance(disabled, dict):
        return {name for name, off in disabled.items() if off}
    return set(disabled)


def check_widgets_extension() -> Check:
    """ipywidgets' JupyterLab extension (package jupyterlab_widgets) where JupyterLab finds it.

    Without it JupyterLab shows every widget as a line of text such as "HBox(children=...)".
    """
    fix = ("pip install 'jupyterlab_widgets>=3' (it comes with ipywidgets>=8), "
           "then restart JupyterLab and reload the browser tab")
    for folder in labextension_dirs():
        package = folder / WIDGETS_EXTENSION / "package.json"
        if package.is_file():
            try:
                version = json.loads(package.read_text(encoding="utf-8")).get("version", "?")
            except (OSError, ValueError):
                version = "unreadable package.json"
            if WIDGETS_EXTENSION in disabled_labextensions():
                return Check("widgets extension", "FAIL", f"{WIDGETS_EXTENSION} {version} is "
                             "installed but disabled: widgets would show as text",
                             f"jupyter labextension enable {WIDGETS_EXTENSION}, then restart JupyterLab")
            return Check("widgets extension", "OK", f"{WIDGETS_EXTENSION} {version} in {folder}")
    if installed_version("jupyterlab_widgets") is None:
        return Check("widgets extension", "FAIL", "jupyterlab_widgets is not installed: "
                     "widgets would show as text", fix)
    return Check("widgets extension", "FAIL", f"jupyterlab_widgets is installed but {WIDGETS_EXTENSION} "
                 "is not in JupyterLab's extension folders: widgets would show as text",
                 "pip install --force-reinstall jupyterlab_widgets, then restart JupyterLab "
                 "(`jupyter labextension list` must show it enabled)")


def check_matplotlib() -> Check:
    """matplotlib imports and has a backend; notebooks use ``%matplotlib inline`` regardless."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        backend = matplotlib.get_backend()
    except Exception as error:  # a broken MPLBACKEND raises from get_backend()
        return Check("matplotlib", "FAIL", f"{type(error).__name__}: {error}",
                     "pip install matplotlib; unset MPLBACKEND if it names a backend that is missing")
    return Check("matplotlib", "OK", f"{matplotlib.__version__}, backend {backend} "
                 "(notebooks use %matplotlib inline)")


def _all_reduce_probe() -> float:
    """Run on each rank: all-reduce (rank + 1) and return the sum, which is 3.0 on 2 ranks."""
    import torch
    import torch.distributed as dist

    from fsdp_lab.dist import backend_for, current_device

    device = current_device() if backend_for("cuda") == "nccl" else torch.device("cpu")
    value = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(value)
    return float(value.item())


def _interface_names() -> list[str]:
    """This machine's network interfaces ("lo", "eth0", ...); empty when the system cannot list them."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def launch_setting_problem() -> Check | None:
    """The 2-rank launch's FAIL, with its fix, for a setting in the environment ``launch`` refuses
    before starting any rank: ``FSDP_LAB_DEVICE`` naming no device, ``GLOO_SOCKET_IFNAME`` naming
    an interface this machine lacks. None when neither is wrong. Raises nothing: it reports them."""
    from fsdp_lab import dist as fdist
    try:
        fdist.cpu_forced()
    except ValueError:
        value = os.environ.get(fdist.DEVICE_ENV)
        return Check("2-rank launch", "FAIL", f"{fdist.DEVICE_ENV}={value!r} is not a device fsdp_lab runs on",
                     f"unset {fdist.DEVICE_ENV} (`unset {fdist.DEVICE_ENV}`: ranks use the GPUs if there are "
                     f"some, else the CPU), or set it to cpu (`export {fdist.DEVICE_ENV}=cpu`: CPU ranks even "
                     "where GPUs are visible)")
    try:
        fdist.check_gloo_interface()
    except ValueError:
        value = os.environ.get("GLOO_SOCKET_IFNAME", "")
        names = _interface_names()
        unknown = [name for name in value.split(",") if name not in names]
        return Check("2-rank launch", "FAIL", f"GLOO_SOCKET_IFNAME={value!r}: this machine has no network "
                     f"interface {', '.join(unknown)}",
                     f"unset GLOO_SOCKET_IFNAME (`unset GLOO_SOCKET_IFNAME`: on one machine ranks connect over "
                     f"loopback, {fdist.loopback_interface() or 'lo'}), or set it to interfaces this machine "
                     f"has: {', '.join(names) or '(this system does not list them)'}")
    return None


def check_launch(timeout: float = 120.0) -> Check:
    """Start 2 ranks with ``fsdp_lab.launch`` and all-reduce across them (``timeout`` seconds).
    A FAIL's fix follows its cause: a wrong setting in the environment, too little time, or
    (cause unknown) local connections or processes that cannot start."""
    problem = launch_setting_problem()
    if problem is not None:
        return problem
    try:
        from fsdp_lab.dist import choose_backend
        from fsdp_lab.launch import launch
        backend = choose_backend(2)
        results = launch(_all_reduce_probe, world_size=2, timeout=timeout)
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        if type(error).__name__ == "LaunchTimeout":
            return Check("2-rank launch", "FAIL", f"LaunchTimeout: {first_line}",
                         f"two ranks did not finish one all-reduce in {timeout:g} s: on a busy or slow machine "
                         f"give them longer (--launch-timeout SECONDS); else see the full report with "
                         f"`python -c 'import fsdp_lab; fsdp_lab.launch(print, 1, world_size=2)'`")
        if isinstance(error, ValueError):
            # launch checks its settings before it starts a rank, and its message names the fix
            return Check("2-rank launch", "FAIL", f"ValueError: {first_line}",
                         "change the setting this message names (no rank was started), then run "
                         "`fsdp-lab doctor` again")
        return Check("2-rank launch", "FAIL", f"{type(error).__name__}: {first_line}",
                     "make sure 127.0.0.1 (loopback) accepts local TCP connections and child "
                     "processes may start; see the full error with "
                     "`python -c 'import fsdp_lab; fsdp_lab.launch(print, 1, world_size=2)'`")
    if results != [3.0, 3.0]:
        return Check("2-rank launch", "FAIL", f"all-reduce of 1+2 gave {results}, expected [3.0, 3.0]",
                     "the collective backend is broken: reinstall torch")
    return Check("2-rank launch", "OK", f"all-reduce of 1 and 2 on 2 ranks over {backend} gives 3.0")


# Each check is looked up here by name when the doctor runs, so a test can replace one.
CHECKS: list[str] = [
    "check_platform", "check_python", "check_torch", "check_cuda", "check_nccl", "check_gloo",
    "check_jupyterlab", "check_ipykernel", "check_ipywidgets", "check_widgets_extension", "check_nbval",
    "check_pytest_xdist", "check_cpp_toolchain", "check_matplotlib",
]


def positive_seconds(text: str) -> float:
    """argparse ``type`` for a timeout: the finite number of seconds above 0 in ``text``. Raises
    argparse.ArgumentTypeError, which argparse turns into a usage error, for anything else."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text!r}")
    return value


def iter_checks(launch: bool = True, launch_timeout: float = 120.0) -> Iterator[Check]:
    """Run every check in turn (the 2-rank launch too unless ``launch`` is False), yielding results.

    A check that crashes is reported as a FAIL instead of stopping the others.
    """
    module = sys.modules[__name__]
    steps: list[tuple[str, Callable[[], Check]]] = [(n, getattr(module, n)) for n in CHECKS]
    if launch:
        steps.append(("check_launch", lambda: module.check_launch(launch_timeout)))
    for name, step in steps:
        try:
            yield step()
        except Exception as error:
            yield Check(name.removeprefix("check_"), "FAIL",
                        f"the check itself crashed: {type(error).__name__}: {error}",
                        "report this with the output of `fsdp-lab doctor`")


def add_doctor_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``doctor`` sub-command to an argparse ``subparsers``; returns its parser.

    The parser's default ``func`` is :func:`run_doctor`.
    """
    parser = subparsers.add_parser(
        "doctor", help="check this machine for the labs and say what to fix",
        description="Check Python, torch, GPUs, JupyterLab, ipywidgets and a 2-rank launch; "
                    "one line per check (OK/WARN/FAIL). Exit code 0 when nothing FAILs.")
    parser.add_argument("--no-launch", action="store_true",
                        help="skip the 2-rank launch check (it starts two Python processes)")
    parser.add_argument("--launch-timeout", type=positive_seconds, default=120.0, metavar="SECONDS",
                        help="time limit for the 2-rank launch check (default: %(default)s)")
    parser.set_defaults(func=run_doctor)
    return parser


def run_doctor(args: argparse.Namespace) -> int:
    """Print one line per check and what to fix; return 0 when no check FAILs, else 1."""
    print("fsdp-lab doctor: can this machine run the labs?")
    checks = []
    for check in iter_checks(launch=not getattr(args, "no_launch", False),
                             launch_timeout=getattr(args, "launch_timeout", 120.0)):
        print(check.line(), flush=True)
        checks.append(check)
    failed = [c.name for c in checks if c.status == "FAIL"]
    warned = [c.name for c in checks if c.status == "WARN"]
    if failed:
        print(f"{len(failed)} FAIL ({', '.join(failed)}), {len(warned)} WARN: "
              "fix the FAIL lines as shown, then run `fsdp-lab doctor` again.")
        return 1
    print(f"Ready for the labs ({len(warned)} WARN). Start with: jupyter lab labs/")
    return 0
