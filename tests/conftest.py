import os

import matplotlib

matplotlib.use("Agg")  # plots are tested headless

import pytest
import torch

from _torch_reference import torch_fsdp2_reference  # noqa: F401 - a fixture, for every test module

# Two cores are shared by all ranks of a test; keep the parent process from competing.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Where GPUs exist, tests not marked `gpu` still run their ranks and tensors on CPU, as CI runs
# them: their references are single-process CPU runs, often compared to the last bit. Set for
# the whole session, before any module-scoped fixture launches ranks; `gpu` tests unset it.
CPU_FORCED_FOR_TESTS = torch.cuda.is_available() and "FSDP_LAB_DEVICE" not in os.environ
if CPU_FORCED_FOR_TESTS:
    os.environ["FSDP_LAB_DEVICE"] = "cpu"


@pytest.fixture(autouse=True)
def _gpu_tests_see_the_gpus(request, monkeypatch):
    if CPU_FORCED_FOR_TESTS and "gpu" in request.keywords:
        monkeypatch.delenv("FSDP_LAB_DEVICE")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
