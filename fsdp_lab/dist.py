"""Process-group plumbing: which backend, which device, torchrun, and a simulated world.

Three ways a rank comes to life:

* ``fsdp_lab.launch`` starts the ranks itself (see launch.py) and uses
  :func:`choose_backend` and :func:`device_for_rank` from here;
* ``torchrun`` starts them, :func:`init_distributed` reads its environment and
  :func:`exit_distributed` ends each rank (see its docstring for why a plain exit can abort);
* :func:`simulated_world` makes one process rank ``r`` of ``N`` on torch's fake process
  group, where memory is real and collectives return without exchanging data.

Backend "auto": NCCL with one GPU per rank when there are at least as many GPUs as ranks
(per node); when ranks must share GPUs, gloo, with CUDA tensors staged through host memory
by ``fsdp_lab.collectives`` (see :func:`comm_needs_host_staging`); with no GPU, gloo on CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import socket
import sys
from typing import Iterator, NoReturn

import torch
import torch.distributed as dist

from fsdp_lab.checks import check_positive_int

BACKENDS = ("auto", "gloo", "nccl")

# The device current_device() answers. launch sets it in each rank (so no process-group query
# is needed there); set to "cpu" by a user, it keeps ranks and current_device() on the CPU on a
# machine with GPUs (a CPU workshop's outputs, the CPU test suite).
DEVICE_ENV = "FSDP_LAB_DEVICE"
# launch sets this in each rank: the rank ends itself when fn returns.
IN_LAUNCH_ENV = "FSDP_LAB_IN_LAUNCH"


def cpu_forced() -> bool:
    """True when ``FSDP_LAB_DEVICE=cpu`` asks for CPU ranks and a CPU ``current_device()``
    even where GPUs are visible. Raises ValueError for a value that is not a device."""
    forced = _forced_device()
    return forced is not None and forced.type == "cpu"


def _forced_device() -> torch.device | None:
    """The device ``FSDP_LAB_DEVICE`` names ("cpu"; ``launch`` sets "cuda:i" in its GPU ranks),
    None when unset. Raises ValueError for another value, naming the variable."""
    value = os.environ.get(DEVICE_ENV)
    if not value:
        return None
    index = value.removeprefix("cuda:") if value.startswith("cuda:") else ""
    if value not in ("cpu", "cuda") and not index.isdigit():
        raise ValueError(f"{DEVICE_ENV}={value!r} is not a device fsdp_lab runs on: set it to cpu (CPU ranks and "
                         f"a CPU current_device() where GPUs are visible), or unset it")
    return torch.device(value)


def _visible_gpus() -> int:
    """GPUs ranks may use: none while ``FSDP_LAB_DEVICE=cpu``."""
    return 0 if cpu_forced() else torch.cuda.device_count()

SIMULATED_NOTE = (
    "communication is simulated: collectives return without exchanging data; memory is real"
)


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """Return the process-group backend ("nccl" or "gloo") for ``world_size`` ranks on this node.

    "auto" picks NCCL when NCCL is available and there is one GPU per rank, else gloo (ranks
    share GPUs when there are some, or run on CPU). Looks at GPUs without initialising CUDA.
    With ``FSDP_LAB_DEVICE=cpu`` in the environment no GPU counts: "auto" is gloo on CPU.

    Raises:
        ValueError: ``world_size`` < 1, an unknown backend, or ``backend="nccl"`` with fewer
            GPUs than ranks, without NCCL in this torch build, or under ``FSDP_LAB_DEVICE=cpu``.
    """
    check_positive_int("world_size", world_size)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "nccl" and cpu_forced():
        raise ValueError(f"backend='nccl' runs on GPUs, but {DEVICE_ENV}=cpu is set in the environment "
                         f"(CPU ranks only); unset it, or use backend='gloo' (or 'auto')")
    n_gpus = _visible_gpus()
    nccl_ok = dist.is_nccl_available() and n_gpus > 0
    if backend == "auto":
        return "nccl" if nccl_ok and n_gpus >= world_size else "gloo"
    if backend == "nccl":
        if not nccl_ok:
            raise ValueError(
                "backend='nccl' needs CUDA GPUs and a torch build with NCCL; this machine has "
                f"{n_gpus} GPU(s){'' if dist.is_nccl_available() else ' and no NCCL'}. "
                "Use backend='gloo' (or 'auto')."
            )
        if n_gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                f"{n_gpus} GPU(s) are visible. Use world_size<={n_gpus}, or backend='gloo' "
                "(or 'auto') to let ranks share GPUs over gloo."
            )
    return backend


def nccl_with_gloo_for_cpu(backend: str) -> str:
    """The backend string to initialise a process group with: NCCL groups also get gloo for CPU
    tensors ("cpu:gloo,cuda:nccl", as PyTorch's own default), so code that builds CPU tensors runs
    unchanged on a GPU machine; gloo stays "gloo"."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def backend_for(device_type: str, group=None) -> str:
    """The backend ("gloo", "nccl", "fake") that runs ``group``'s collectives on tensors of
    ``device_type`` ("cpu" or "cuda"). A group made with a per-device string such as
    "cpu:gloo,cuda:nccl" answers per device; a single-backend group answers its backend.
    Raises ValueError (from torch) when ``group`` is not initialised."""
    config = str(dist.get_backend(group)).lower()
    if ":" not in config:
        return config
    per_device = dict(part.split(":", 1) for part in config.split(","))
    return per_device.get(device_type, next(iter(per_device.values())))


def device_for_rank(local_rank: int, backend: str) -> torch.device:
    """The device rank ``local_rank`` computes on: cuda:local_rank under NCCL,
    cuda:(local_rank % n_gpus) under gloo when GPUs exist (shared GPUs), cpu otherwise (and
    under ``FSDP_LAB_DEVICE=cpu``)."""
    n_gpus = _visible_gpus()
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if n_gpus > 0:
        return torch.device("cuda", local_rank % n_gpus)
    return torch.device("cpu")


def current_device() -> torch.device:
    """The device this rank computes on (cpu, or cuda:i).

    Inside ``launch`` it is the device launch assigned; under torchrun it follows LOCAL_RANK
    and the backend; outside any process group it is cuda:current when a GPU exists, else cpu.
    """
    forced = _forced_device()
    if forced is not None:
        return forced
    if dist.is_initialized() and not is_simulated():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return device_for_rank(local_rank, backend_for("cuda"))
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_needs_host_staging() -> bool:
    """True when the process group is gloo and this rank computes on a GPU (ranks sharing
    GPUs): gloo cannot take CUDA tensors for every collective, so they go through host memory."""
    return (
        dist.is_initialized()
        and backend_for("cuda") == "gloo"
        and current_device().type == "cuda"
    )


def is_simulated() -> bool:
    """True inside :func:`simulated_world` (torch's fake process group)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def get_rank() -> int:
    """Rank in the default process group, 0 when there is none."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Size of the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_initialized() else 1


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface ("lo" on Linux, "lo0" on macOS),
    or None when the system lists neither."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def check_gloo_interface() -> None:
    """Check that ``GLOO_SOCKET_IFNAME``, where set, names network interfaces this machine has
    (gloo takes a comma-separated list). Raises ValueError naming the variable, the interfaces it
    lacks and those it has; gloo itself would fail later, in every rank, naming only the interface."""
    value = os.environ.get("GLOO_SOCKET_IFNAME")
    if not value:
        return
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # the system cannot list them: leave it to gloo
        return
    unknown = [name for name in value.split(",") if name not in names]
    if unknown:
        raise ValueError(
            f"GLOO_SOCKET_IFNAME={value!r} names no network interface of this machine "
            f"({', '.join(unknown)}; it has {', '.join(names)}): unset it (on one machine ranks "
            f"connect over loopback, {loopback_interface() or 'lo'}) or name one of those")


def bind_gloo_to_loopback() -> None:
    """Have gloo, in this process, connect its ranks over the loopback interface (sets
    ``GLOO_SOCKET_IFNAME``; a value already set is kept). Call it only where every rank of the
    group runs on this machine. Left to itself gloo binds to the address the host name resolves
    to: where it does not resolve (common on laptops and in containers) gloo falls back to
    loopback after printing a warning at every start, and a network address goes away with the
    network."""
    loopback = loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)


def init_distributed(backend: str = "auto", timeout: float = 1800.0) -> tuple[int, int]:
    """Initialise the default process group from the environment torchrun sets.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (LOCAL_WORLD_SIZE, when
    set, decides "auto": NCCL needs one GPU per local rank). Under NCCL it also sets the CUDA
    device to LOCAL_RANK. When every rank is on this machine (LOCAL_WORLD_SIZE equals
    WORLD_SIZE), gloo connects them over loopback (:func:`bind_gloo_to_loopback`) unless
    ``GLOO_SOCKET_IFNAME`` is set. ``timeout`` (seconds) bounds every collective. If a process
    group already exists it is kept. Returns ``(rank, world_size)``.

    Raises:
        RuntimeError: the torchrun variables are missing, or one is not an integer in its range.
        ValueError: as :func:`choose_backend`, or as :func:`check_gloo_interface`.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in needed if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed() needs the torchrun environment ({', '.join(missing)} not set): "
            "run under torchrun (torchrun --nproc-per-node N script.py) or use "
            "fsdp_lab.launch(fn, world_size=N) from a notebook or script."
        )
    world_size = _int_from_env("WORLD_SIZE", at_least=1)
    rank = _int_from_env("RANK", at_least=0, below=world_size, below_name="WORLD_SIZE")
    local_world_size = _int_from_env("LOCAL_WORLD_SIZE", world_size, at_least=1)
    local_rank = _int_from_env("LOCAL_RANK", rank % local_world_size, at_least=0, below=local_world_size,
                               below_name="LOCAL_WORLD_SIZE")
    backend = choose_backend(local_world_size, backend)
    check_gloo_interface()
    if "LOCAL_WORLD_SIZE" in os.environ and local_world_size == world_size:
        bind_gloo_to_loopback()  # every rank is on this node (torchrun --standalone or --nnodes 1)
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", local_rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        nccl_with_gloo_for_cpu(backend),
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device_id,
    )
    return rank, world_size


def _int_from_env(name: str, default: int | None = None, *, at_least: int, below: int | None = None,
                  below_name: str = "") -> int:
    """The integer environment variable ``name`` (``default`` when unset). Raises RuntimeError,
    naming the variable, for a value that is not an integer, under ``at_least``, or not under
    ``below`` (the value of ``below_name``)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    problem = None
    try:
        value = int(raw)
    except ValueError:
        problem = "is not an integer"
    else:
        if value < at_least:
            problem = f"is below {at_least}"
        elif below is not None and value >= below:
            problem = f"is not below {below_name}={below}"
    if problem:
        raise RuntimeError(f"{name}={raw!r} {problem}: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and "
                           f"LOCAL_WORLD_SIZE itself; where you set them by hand, each rank needs "
                           f"0 <= RANK < WORLD_SIZE and 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
    return value


def exit_distributed(code: int = 0) -> NoReturn:
    """End a torchrun rank: wait for every rank, then leave the process at once with exit status
    ``code`` (after flushing stdout/stderr and running ``atexit`` handlers), without destroying the
    process groups and without Python's interpreter teardown. Call it as the script's last line.

    Why: ``destroy_process_group()`` only forgets the groups. A group something still refers to
    (a sharded model, DTensor's caches inside torch) lives on, and so do gloo's worker threads.
    During interpreter teardown such a thread may still free the last tensor of a finished
    collective (or run a completion callback); taking the GIL then ends the thread inside a C++
    destructor, and the process aborts with "terminate called without an active exception"
    (SIGABRT), more often on a loaded machine. Leaving without the teardown, as the ranks of
    ``fsdp_lab.launch`` do, cannot race. Nor are the groups destroyed first: a group that nothing
    else holds is freed by that call, on this thread and holding the GIL, and freeing a gloo group
    waits for its worker threads, one of which may be waiting for the GIL to free such a tensor
    (with torch 2.6 a rank hung there forever). The process leaves right after, so nothing is lost.
    Files you wrote should be closed before (``with``).

    Raises:
        RuntimeError: called inside ``fsdp_lab.launch``, whose ranks end by themselves when
            ``fn`` returns (return instead).
    """
    if os.environ.get(IN_LAUNCH_ENV):
        raise RuntimeError("exit_distributed() ends a torchrun script; inside fsdp_lab.launch, "
                           "return from fn instead (launch ends its ranks itself)")
    if dist.is_initialized() and not is_simulated():
        dist.barrier()  # no rank tears down its connections while a peer still uses them
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


@dataclasses.dataclass(frozen=True)
class SimulatedWorld:
    """What :func:`simulated_world` yields: this process's place in the simulated world."""

    rank: int
    world_size: int
    note: str = SIMULATED_NOTE


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[SimulatedWorld]:
    """Run this process as rank ``rank`` of ``world_size`` on torch's fake process group.

    Tensors and memory are real; collectives return at once without exchanging data (an
    all-reduce of ones stays ones). Use it for memory questions bigger than the machine; say
    ``world.note`` wherever results are shown. The group is destroyed on exit, also on error.

    Raises:
        ValueError: world_size < 1 or rank outside [0, world_size).
        RuntimeError: a process group (real or simulated) is already initialised.
    """
    check_positive_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        if is_simulated():
            raise RuntimeError("simulated_world() cannot be nested: leave the outer one first")
        raise RuntimeError(
            "simulated_world() needs a process without a process group, but a real one "
            f"({dist.get_backend()}, world size {dist.get_world_size()}) is initialised: "
            "use it from the notebook kernel, not inside launch() or torchrun"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield SimulatedWorld(rank=rank, world_size=world_size)
    finally:
        dist.destroy_process_group()
