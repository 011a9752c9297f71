import os

import matplotlib

matplotlib.use("Agg")  # plots are tested headless

import pytest
import torch

# Two cores are shared by all ranks of a test; keep the parent process from competing.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
