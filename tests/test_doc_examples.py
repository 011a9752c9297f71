"""The whole scripts in docs/fsdp1.md, docs/fsdp2.md and docs/huggingface.md run as printed, and
each gives one process's losses on the same data: every step of the FSDP scripts (so the updates
count too), the first step of the Hugging Face one."""

import ast
import re
import subprocess
import sys

import pytest
import torch

from fsdp_lab.models import Llama, global_batch

from _launch_helpers import REPO


def _first_script(doc: str) -> str:
    text = (REPO / "docs" / doc).read_text()
    blocks = re.findall(r"```python\n(import torch.*?)```", text, flags=re.S)
    assert blocks, f"docs/{doc} should hold a whole script (a ```python block starting with import torch)"
    return blocks[0]


def _run(doc: str) -> list:
    run = subprocess.run([sys.executable, "-"], input=_first_script(doc), capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(losses) == 2
    return losses


@pytest.mark.parametrize("doc", ["fsdp1.md", "fsdp2.md"])
def test_the_fsdp_doc_s_script_matches_one_process(doc):
    per_rank = _run(doc)
    model = Llama("cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = []
    for step in range(3):  # the whole batch in one process: both ranks' 2 x 16 tokens
        loss = model(global_batch(512, 4, 16, step=step)).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        expected.append(loss.item())
    got = [sum(step) / 2 for step in zip(*per_rank)]
    assert len(got) == 3 and all(abs(g - e) < 1e-5 for g, e in zip(got, expected)), (per_rank, expected)


def test_the_hugging_face_doc_s_qlora_script_matches_one_process():
    transformers = pytest.importorskip("transformers")
    from fsdp_lab.qlora import apply_lora

    losses = _run("huggingface.md")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = apply_lora(transformers.LlamaForCausalLM(config), rank=8, alpha=16)
    for rank, loss in enumerate(losses):
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
        assert abs(loss - model(input_ids=ids, labels=ids).loss.item()) < 1e-5, (rank, losses)
