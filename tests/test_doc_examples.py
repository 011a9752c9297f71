"""The whole scripts in docs/fsdp1.md and docs/fsdp2.md run as printed, and their 2 ranks' mean loss
is one process's loss on the same 4 sequences (the script's first step, before any update)."""

import ast
import re
import subprocess
import sys

import pytest

from fsdp_lab.models import Llama, global_batch

from _launch_helpers import REPO


def _first_script(doc: str) -> str:
    text = (REPO / "docs" / doc).read_text()
    blocks = re.findall(r"```python\n(import torch\n.*?)```", text, flags=re.S)
    assert blocks, f"docs/{doc} should open with a whole script (a ```python block starting with import torch)"
    return blocks[0]


@pytest.mark.parametrize("doc", ["fsdp1.md", "fsdp2.md"])
def test_the_doc_s_script_runs_and_matches_one_process(doc):
    run = subprocess.run([sys.executable, "-"], input=_first_script(doc), capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(losses) == 2
    expected = Llama("cpu")(global_batch(512, 4, 16)).loss.item()  # both ranks hold 2 x 16 tokens
    assert abs(sum(losses) / 2 - expected) < 1e-5, (losses, expected)
