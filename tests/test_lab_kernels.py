"""The bf16 labs' compared outputs are the same whichever floating-point kernels the CPU has.

bf16 matrix products run on oneDNN's AMX or AVX-512 BF16 kernels where the CPU has them and on
PyTorch's own elsewhere, and the three round differently (README, "Which CPU"). This re-runs the
labs that train in bf16 under nbval with other kernels than this machine's defaults: PyTorch's
generic code path (``ATEN_CPU_CAPABILITY=default``), oneDNN limited to AVX2, and MKL's float32
products on its compatible code path (``MKL_CBWR=COMPATIBLE``, which changes their last bits
here). Their saved outputs, recorded with the defaults of the machine that built them, must still
compare equal.
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
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", ONEDNN_MAX_CPU_ISA="AVX2", MKL_CBWR="COMPATIBLE")
    env.pop("PYTEST_ADDOPTS", None)
    # one pytest per lab, side by side: each spends much of its time waiting on its ranks
    runs = {lab: subprocess.Popen([sys.executable, "-m", "pytest", "--nbval", "-q", "-p", "no:cacheprovider", lab],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for lab in BF16_LABS}
    outputs = {}
    try:
        for lab, run in runs.items():
            outputs[lab] = run.communicate(timeout=900)[0]
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    for lab, run in runs.items():
        tail = outputs[lab][-4000:]
        assert run.returncode == 0, f"{lab}:\n{tail}"
        assert " passed" in tail and "failed" not in tail, f"{lab}:\n{tail}"
