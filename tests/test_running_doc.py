"""docs/running.md: the torchrun script in the doc runs as printed, and trains like one process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from fsdp_lab import dist as fdist
from fsdp_lab.models import Llama, global_batch
from fsdp_lab.models.llama import LlamaConfig

REPO = Path(__file__).resolve().parents[1]


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


def test_torchrun_script_in_docs_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "train_fsdp.py"
    script.write_text(_script_from_doc())
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop(fdist.DEVICE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"step \d loss (\d+\.\d+)", proc.stdout)]
    assert len(printed) == 3, proc.stdout
    reference = _single_process_losses()
    assert all(abs(a - b) < 2e-3 for a, b in zip(printed, reference)), (printed, reference)
    assert printed[-1] < printed[0]
