"""The bf16 labs' compared outputs are the same whichever floating-point kernels the CPU has.

bf16 matrix products run on oneDNN's AMX or AVX-512 BF16 kernels where the CPU has them and on
PyTorch's own elsewhere, and the three round differently (README, "Which CPU"). This re-runs the
labs that train in bf16 under nbval with other kernels than this machine's defaults: PyTorch's
generic code path (``ATEN_CPU_CAPABILITY=default``) and oneDNN limited to AVX2. Their saved
outputs, recorded with the defaults of the machine that built them, must still compare equal.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BF16_LABS = ("labs/04_fsdp1_flat_parameters.ipynb", "labs/06_mixed_precision.ipynb")


def test_bf16_labs_compare_equal_with_other_cpu_kernels():
    pytest.importorskip("nbval")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="AVX2")
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "--nbval", "-q", "-p", "no:cacheprovider", *BF16_LABS],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
