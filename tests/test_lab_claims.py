"""The labs' prose: measured numbers are computed in the run, and corrected claims stay corrected.

A lab's markdown cells are typed once and never re-run, so a measured figure written there goes
stale the moment the engine changes (the MemoryTracker fix moved several by a shard). Measured
numbers belong in outputs printed from live values. A number with a unit may still appear in
markdown when it is quoted from a source or worked by hand, and then its line says so.

The second test keeps sentences that were found false (and corrected against PyTorch's source or
the material they cite) from coming back, in the labs and in ``docs/``.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))

# a number followed by a unit of bytes, time or a percentage: "3.82 MiB", "60.6 ms", "44 %"
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:[KMG]iB|[KMG]B(?!/s)|ms|µs|%)(?![\w/])")
# a line that quotes a source or works an example by hand may carry such numbers
CITED = re.compile(r"https?://|\]\(|published|reports?\b|datasheet|the talk|paper|REFERENCES|by hand|"
                   r"e\.g\.|for example|in 16-bit terms|formula", re.IGNORECASE)


def _markdown_paragraphs(notebook: pathlib.Path):
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] == "markdown":
            for paragraph in re.split(r"\n\s*\n|\n(?=\s*[|*#-] )", "".join(cell["source"])):
                yield index, " ".join(paragraph.split())


def test_lab_notebooks_exist():
    assert len(NOTEBOOKS) >= 10, [n.name for n in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT / "labs")))
def test_measured_numbers_are_not_typed_into_markdown(notebook):
    typed = [f"cell {index}: {text}" for index, text in _markdown_paragraphs(notebook)
             if MEASURED.search(text) and not CITED.search(text)]
    assert not typed, ("numbers with units typed into markdown: print them from the run's live values "
                       "(or cite their source in the same paragraph):\n" + "\n".join(typed))


# (pattern, why it is false) — each was once in a lab or a doc page
FALSE_CLAIMS = [
    (r"FSDP never all-reduces", "NO_SHARD and HYBRID_SHARD / HSDP all-reduce gradients"),
    (r"8 bits of mantissa", "bf16 stores 7 mantissa bits (8 with the implicit leading one)"),
    (r"~\s?0\.27 of bf16", "NF4 with double quantization is 4.127 / 16 = 0.26 of bf16"),
    (r"3\.9\s?× the NF4 bytes", "a QLoRA unit's all-gather is about 2.4× its NF4 bytes"),
    (r"PyTorch's FSDP1 makes an fp32 copy per parameter",
     "PyTorch's FSDP1 casts one flat gradient; per-parameter fp32 copies were fairscale's"),
    (r"caps [^.]* at 2", "limit_all_gathers is PyTorch's rate limiter, not a cap of two"),
    (r"a measured busbw stays below them", "an all-reduce run with NVLink SHARP passes the link's one-way peak"),
    (r"Mixed dtypes and `requires_grad` in one group",
     "PyTorch's fully_shard refuses trainable parameters of different dtypes in one group"),
    (r"where FSDP1 needs one flat parameter per dtype",
     "PyTorch's FSDP1 refuses mixed dtypes; one flat parameter per dtype is fsdp_lab's FSDP1"),
    (r"PyTorch's behaviour: that of\s+FSDP1", "PyTorch's FSDP1 keeps a no_sync gradient in param_dtype"),
    (r"gradients exist \(under `no_sync`", "fairscale's optimize_backward_concat concatenates only in the "
                                           "backward that syncs"),
    (r"rank 0 quantizes the model layer by layer",
     "every rank of Answer.AI's script quantizes on its GPU; rank 0 keeps the result on the CPU"),
    (r"max_memory_allocated` on a GPU partly includes", "the CUDA context is outside the caching allocator"),
]


@pytest.mark.parametrize("pattern,why", FALSE_CLAIMS, ids=[p for p, _ in FALSE_CLAIMS])
def test_corrected_claims_stay_corrected(pattern, why):
    texts = list((ROOT / "labs" / "src").glob("*.py")) + list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    found = [str(path.relative_to(ROOT)) for path in texts if re.search(pattern, path.read_text())]
    assert not found, f"{found}: {why}"


# an absolute path in a saved output differs on every machine, so nbval fails wherever the
# repository sits anywhere else than where the lab was built
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:work|root|home|tmp|usr|opt|check|Users)/\S+")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_saved_outputs_hold_no_machine_path(notebook):
    found = []
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            text = output.get("text", "")
            text = text if isinstance(text, str) else "".join(text)
            text += "".join("".join(v) if isinstance(v, list) else str(v)
                            for k, v in output.get("data", {}).items() if k.startswith("text/"))
            found += [(index, m.group(0)) for m in MACHINE_PATH.finditer(text)]
    assert not found, f"outputs that name a path on the building machine (cell, path): {found[:5]}"
