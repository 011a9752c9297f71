"""Lab 08's checkers (QLoRA) on the shipped stubs, the shipped solutions and typical wrong answers.

References: the nearest-code lookup against a brute-force search over the code book worked here
in float64 (ties to the lower code) and fsdp_lab's ``nearest_nf4_code``; the LoRA forward against
the formula written out here and against ``LoRALinear``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F

from fsdp_lab.qlora import NF4_CODEBOOK
from fsdp_lab.qlora.nf4 import nearest_nf4_code
from fsdp_lab.workshop import lab08
from _launch_helpers import env_with_repo
from test_workshop_labs import Shipped

LAB08 = Shipped("08_qlora", {"F": F, "NF4_CODEBOOK": NF4_CODEBOOK})


def brute_force_code(values: torch.Tensor) -> torch.Tensor:
    """Nearest code by distance in float64; argmin takes the first (lower) code of a tie."""
    distances = (values.double()[:, None] - NF4_CODEBOOK.double()[None, :]).abs()
    return distances.argmin(dim=1)


def test_reference_lookup_is_the_nearest_code():
    values = lab08.nearest_code_cases()
    ties = torch.isin(values, (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2)
    assert int(ties.sum()) == 15
    # away from the float32 midpoints, nearest by distance is unambiguous
    assert torch.equal(nearest_nf4_code(values[~ties]).long(), brute_force_code(values[~ties]))
    # at a midpoint, the lower of the two neighbours
    assert nearest_nf4_code(values[ties]).long().tolist() == list(range(15))


def test_nearest_code_checker():
    stub, solution = LAB08["nearest_code"]
    assert lab08.check_nearest_code(stub).mistake == "stub"
    assert lab08.check_nearest_code(solution).solved
    midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
    ties_up = lambda v: (v[..., None] >= midpoints).sum(-1).to(torch.uint8)  # noqa: E731
    assert lab08.check_nearest_code(ties_up).mistake == "ties_up"
    by_distance = lambda v: (v[..., None] - NF4_CODEBOOK).abs().argmin(-1)  # noqa: E731
    assert lab08.check_nearest_code(by_distance).mistake == "tie_rounding"
    float64_midpoints = (NF4_CODEBOOK.double()[:-1] + NF4_CODEBOOK.double()[1:]) / 2
    wide_midpoints = lambda v: (v.double()[..., None] > float64_midpoints).sum(-1).to(torch.uint8)  # noqa: E731
    assert lab08.check_nearest_code(wide_midpoints).mistake in ("tie_rounding", None)
    uniform = lambda v: torch.round((v + 1) / 2 * 15).to(torch.uint8)  # noqa: E731
    assert lab08.check_nearest_code(uniform).mistake == "uniform"
    assert lab08.check_nearest_code(lambda v: torch.round((v + 1) / 2 * 15)).mistake == "float_codes"
    mirrored = lambda v: 15 - nearest_nf4_code(v)  # noqa: E731
    assert lab08.check_nearest_code(mirrored).mistake == "reversed"
    flattened = lambda v: (v.reshape(-1, 1) > midpoints).sum(1).to(torch.uint8)  # noqa: E731
    kept = lab08.check_nearest_code(flattened)
    assert kept.mistake == "not_shape_kept" and "a (100, 100) input gave shape (10000,)" in kept.message
    assert lab08.check_nearest_code(lambda v: torch.bucketize(v, midpoints).to(torch.uint8)).solved


def formula(x, weight, lora_a, lora_b, alpha, rank):
    """x Wᵀ + (alpha / rank) · x Aᵀ Bᵀ, with W dequantized by hand."""
    w = weight.dequantize(torch.float32)
    return x @ w.T + (x @ lora_a.T @ lora_b.T) * (alpha / rank)


def test_lora_forward_checker():
    stub, solution = LAB08["lora_forward"]
    assert lab08.check_lora_forward(stub).mistake == "stub"
    assert lab08.check_lora_forward(solution).solved
    assert lab08.check_lora_forward(formula).solved
    unscaled = lambda x, w, a, b, al, r: F.linear(x, w) + F.linear(F.linear(x, a), b)  # noqa: E731
    assert lab08.check_lora_forward(unscaled).mistake == "no_scaling"
    by_alpha = lambda x, w, a, b, al, r: F.linear(x, w) + F.linear(F.linear(x, a), b) * al  # noqa: E731
    assert lab08.check_lora_forward(by_alpha).mistake == "alpha_only"
    floor = lambda x, w, a, b, al, r: F.linear(x, w) + F.linear(F.linear(x, a), b) * (al // r)  # noqa: E731
    assert lab08.check_lora_forward(floor).mistake == "floor_division"
    typed_in = lambda x, w, a, b, al, r: F.linear(x, w) + F.linear(F.linear(x, a), b) * 2  # noqa: E731
    assert not lab08.check_lora_forward(typed_in).solved
    swapped = lambda x, w, a, b, al, r: F.linear(x, w) + F.linear(F.linear(x, b), a) * al / r  # noqa: E731
    assert lab08.check_lora_forward(swapped).mistake == "order"
    matmul_nf4 = lambda x, w, a, b, al, r: x @ w.T + F.linear(F.linear(x, a), b) * al / r  # noqa: E731
    assert lab08.check_lora_forward(matmul_nf4).mistake == "nf4_op"
    detached = lambda x, w, a, b, al, r: F.linear(x, w) + (F.linear(F.linear(x, a), b) * al / r).detach()  # noqa: E731
    assert lab08.check_lora_forward(detached).mistake == "detached"
    assert lab08.check_lora_forward(lambda x, w, a, b, al, r: F.linear(x, w)).mistake == "base_only"


def test_lora_case_reference_matches_the_formula():
    case = lab08.lora_case()
    out, grad_a, grad_b = lab08._reference(case)
    a = case["lora_a"].clone().requires_grad_(True)
    b = case["lora_b"].clone().requires_grad_(True)
    mine = formula(case["x"], case["weight"], a, b, case["alpha"], case["rank"])
    mine.sum().backward()
    assert torch.allclose(out, mine.detach(), atol=1e-5)
    assert torch.allclose(grad_a, a.grad, atol=1e-5) and torch.allclose(grad_b, b.grad, atol=1e-5)


def test_the_7b_figure_gathers_nothing_on_one_rank():
    import matplotlib.pyplot as plt
    states = {"quantized": 3 * 2**30, "sharded_params": 2**30}
    _, two = lab08.draw_7b_states(states, 99.6 * 2**20, 386.0 * 2**20, world_size=2)
    assert two.endswith("all-gather 99.6 MiB vs 386.0 MiB in bf16") and "4.128 bits/weight" in two
    fig, one = lab08.draw_7b_states(states, 99.6 * 2**20, 386.0 * 2**20, world_size=1)
    assert "all-gather" not in one and "one rank gathers nothing (a block: 99.6 MiB vs 386.0 MiB in bf16)" in one
    assert fig.axes[1].get_title() == "one block (1 rank: no all-gather)"
    plt.close("all")


def test_bitsandbytes_buffers_by_hand(capsys):
    from fsdp_lab.models.llama import LlamaConfig
    lab08.print_bitsandbytes_buffers(LlamaConfig.from_name("llama2-7b"))
    # 32 blocks x (4 x 4096^2 + 3 x 4096 x 11008) = 6,476,005,376 values, one byte per 64 of them;
    # the largest weight, 11008 x 4096 in bf16, is 86.0 MiB
    assert 32 * (4 * 4096**2 + 3 * 4096 * 11008) // 64 == 101_187_584
    assert capsys.readouterr().out == ("absmax statistics on every rank: 0.094 GiB; largest bf16 temporary "
                                       "(11008 x 4096): 86.0 MiB\n")


def test_shortest_times_ratios_to_the_last_call(monkeypatch, capsys):
    seconds = {"a": 0.003, "b": 0.0015, "ref": 0.001}
    monkeypatch.setattr(lab08, "shortest_time", lambda fn: fn())   # no timing: fn returns its seconds
    lab08.print_shortest_times({label: (lambda t=t: t) for label, t in seconds.items()})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a      3.00 ms" and lines[2] == "ref    1.00 ms"
    assert lines[3] == "time / ref's: a 3.0x; b 1.5x"


def test_recorded_compile_ratios_name_both_shapes(tmp_path, capsys):
    path = tmp_path / "nf4_compile.json"
    path.write_text('{"device": "cpu", "shape": [2048, 2048], "ratio_eager_gather_over_compiled": 0.9672, '
                    '"ratio_eager_elementwise_over_compiled": 6.942}')
    lab08.print_recorded_compile_ratios(path, torch.Size([1024, 1024]))
    assert capsys.readouterr().out == (
        "recorded by benchmarks/nf4_compile.py on cpu, a 2048 x 2048 weight (this lab times 1024 x 1024): "
        "time / compiled's: eager (gather form) 0.97x; eager (element-wise form) 6.9x\n")


def test_recorded_compile_ratios_without_the_file_say_how_to_record_one(tmp_path, capsys):
    lab08.print_recorded_compile_ratios(tmp_path / "missing.json", torch.Size([1024, 1024]))  # no raise
    assert "run python benchmarks/nf4_compile.py" in capsys.readouterr().out


def test_published_against_estimates_prints_the_estimates_shares(tmp_path, capsys):
    from fsdp_lab.memory.estimate import Breakdown
    gib = 2**30

    def made_up(activations, temporaries, rest):
        return Breakdown(bytes={"activations": activations * gib, "temporaries": temporaries * gib,
                                "quantized": rest * gib}, phase="forward_end")

    published = {"talk, FSDP1 + bitsandbytes": 12.88, "talk, FSDP2 + torchao NF4": 12.60,
                 "Answer.AI (rank 64), peak reserved": 4.98}
    lab08.print_published_against_estimates(published, {"fsdp2": made_up(6, 3, 3)},
                                            {8: made_up(0.5, 0.5, 1), 64: made_up(1, 0, 3)}, str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert "estimate of live bytes, fsdp2" in lines[3] and lines[3].endswith("12.00 GiB")
    assert lines[-2] == ("published minus estimate: 0.98 GiB at batch 1 x 512 (rank 64); +0.60 GiB for the "
                         "talk's FSDP2 figure")
    assert lines[-1] == ("share of the estimate (FSDP2): activations 50%, temporaries 25% at batch 8 x 2048; "
                         "activations 25%, temporaries 0% at batch 1 x 512 (rank 64)")


def test_published_against_estimates_adds_the_recorded_gpu_runs(tmp_path, capsys):
    from fsdp_lab.memory.estimate import Breakdown
    made_up = Breakdown(bytes={"activations": 2**30}, phase="forward_end")
    published = {"talk, FSDP1 + bitsandbytes": 12.88, "talk, FSDP2 + torchao NF4": 12.60,
                 "Answer.AI (rank 64), peak reserved": 4.98}
    gpu = tmp_path / "qlora_7b_cuda.json"
    gpu.write_text(json.dumps({"gpu": "Some GPU", "torch": "2.11.0", "measured": {
        "fsdp2": {"peak_gib": 3.196}, "fsdp1": {"error": "NotImplementedError: ..."}}}))
    lab08.print_published_against_estimates(published, {"fsdp2": made_up}, {64: made_up}, str(tmp_path))
    out = capsys.readouterr().out
    assert "GPU run of our FSDP2, rank 8" in out and "≈3.20 GiB" in out
    assert "GPU run of our FSDP1" not in out  # a run that failed is not shown as a figure
    assert "(GPU runs: Some GPU, torch 2.11.0, torch.cuda.max_memory_allocated)" in out
    lab08.print_published_against_estimates(published, {"fsdp2": made_up}, {64: made_up}, str(tmp_path / "none"))
    assert "no GPU runs" in capsys.readouterr().out


def test_importing_lab08_holds_back_a_cuda_builds_cuda_home_warning(tmp_path):
    # what a CUDA build of torch does on a machine with a CUDA toolkit and no GPU: it logs
    # "No CUDA runtime is found" once, when torch.compile's first CPU compile imports
    # cpp_extension, and the stderr output fails lab 08's compile cell under nbval
    pretend = textwrap.dedent(f"""
        import logging, os
        import torch
        import fsdp_lab.workshop  # imported as a real build: fsdp_lab asks torch._C for CUDA parts then

        def pretend():
            torch.cuda._is_compiled = lambda: True
            torch.cuda.is_available = lambda: False
            torch.version.cuda = "13.0"
            os.environ["CUDA_HOME"] = {str(tmp_path)!r}
    """)

    def stderr_of(code):
        return subprocess.run([sys.executable, "-c", pretend + textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=120, env=env_with_repo(), check=True).stderr

    assert "No CUDA runtime is found" in stderr_of("""
        pretend()
        import torch.utils.cpp_extension
    """)  # the pretence holds
    quiet = stderr_of("""
        pretend()
        import fsdp_lab.workshop.lab08
        import torch.utils.cpp_extension
        logging.getLogger("torch.utils.cpp_extension").warning("a later warning")
    """)
    assert "No CUDA runtime" not in quiet
    assert "a later warning" in quiet  # the logger's level is given back
