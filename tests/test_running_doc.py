"""docs/running.md: the torchrun script in the doc runs as printed, and trains like one process."""

import re
import subprocess
import sys

import pytest
import torch

from fsdp_lab.models import Llama, global_batch
from fsdp_lab.models.llama import LlamaConfig

from _launch_helpers import REPO, torchrun_env


def _script_from_doc() -> str:
    text = (REPO / "docs" / "running.md").read_text()
    blocks = re.findall(r"```python\n(# train_fsdp\.py\n.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "docs/running.md should hold one ```python block starting with # train_fsdp.py"
    return blocks[0]


def _single_process_losses(steps=3, world_size=2):
    """The same model and data in one process: the global batch of every step at once."""
    model = Llama(LlamaConfig.from_name("cpu", n_layers=2), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = global_batch(model.config.vocab_size, 4 * world_size, 32, step=step)
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


TEARDOWN_RACE = """
import time

import torch
import torch.distributed as dist

import fsdp_lab


class SlowTeardown:
    def __del__(self):
        time.sleep(2.0)  # interpreter teardown would still run when the late peer joins


rank, world_size = fsdp_lab.init_distributed(timeout=60)
tensor = torch.ones(1 << 16)
work = dist.all_reduce(tensor, async_op=True)
if rank == 1:
    time.sleep(0.5)
del tensor, work  # rank 0's gloo worker holds the last reference until rank 1 joins
slow = SlowTeardown()
print(f"rank {rank} done", flush=True)
fsdp_lab.exit_distributed()
print("never printed")
"""


def _torchrun(script, tmp_path, timeout=300):
    """``script`` under torchrun on 2 CPU ranks. Past ``timeout`` seconds torchrun is sent SIGTERM,
    which it passes on to its ranks (each in a session of its own: killing torchrun alone would
    leave a hung rank running), and the test fails."""
    env = torchrun_env(tmp_path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout} s and was stopped; its stderr ends:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_exit_distributed_ends_ranks_whose_gloo_threads_outlive_the_group(tmp_path):
    # Ending this script without exit_distributed() aborts rank 0 most of the time ("terminate
    # called without an active exception"): its gloo thread frees the tensor during teardown.
    script = tmp_path / "teardown_race.py"
    script.write_text(TEARDOWN_RACE)
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert sorted(proc.stdout.split("\n"))[-2:] == ["rank 0 done", "rank 1 done"]


def test_torchrun_script_in_docs_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "train_fsdp.py"
    script.write_text(_script_from_doc())
    assert script.read_text().rstrip().splitlines()[-1].startswith("fsdp_lab.exit_distributed()")
    proc = _torchrun(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"step \d loss (\d+\.\d+)", proc.stdout)]
    assert len(printed) == 3, proc.stdout
    reference = _single_process_losses()
    assert all(abs(a - b) < 2e-3 for a, b in zip(printed, reference)), (printed, reference)
    assert printed[-1] < printed[0]
