"""Checkers for lab 08 (QLoRA).

* ``check_nearest_code(nearest_code)``: the NF4 lookup, value in [-1, 1] -> index of the
  nearest code, an exact tie going to the lower code. Reference: ``fsdp_lab.qlora.nf4``'s
  ``nearest_nf4_code`` (checked against bitsandbytes' code book and tie rule in
  ``tests/test_nf4.py``) on random values, the 16 codes themselves and the 15 exact midpoints.
* ``check_lora_forward(lora_forward)``: one LoRA linear on a frozen NF4 weight,
  ``x Wᵀ + (alpha / rank) · x Aᵀ Bᵀ``, and its gradients. Reference: ``LoRALinear`` on the same
  tensors. B is random here, not zero as at initialisation: a zero B hides every mistake in the
  update.

The lab's figures, tables and the explorer's figure are drawn here too (``plot_codebook_over_normal``,
``print_memory_at_rest``, ``print_recorded_compile_ratios``, ``plot_qlora_two_ranks``,
``print_published_against_estimates``, ``print_bitsandbytes_buffers``,
``draw_7b_states``, ``print_adapters_against_frozen``), with the timing
and gathered-bytes helpers ``shortest_time`` and ``bytes_still_gathered``; the notebook keeps the
quantization, the runs and the arithmetic they draw.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from statistics import NormalDist

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.workshop.checking import checker, correct, mistake

TOLERANCE = 1e-5  # float32 sums in a different order


def import_cpp_extension_quietly() -> None:
    """Import ``torch.utils.cpp_extension`` (which ``torch.compile`` imports at its first CPU
    compile) with its import-time warnings held back. A CUDA build of torch on a machine with a
    CUDA toolkit but no GPU logs "No CUDA runtime is found" to stderr there, once per process;
    the lab compiles for the CPU, where it does not apply, and under nbval an unexpected stderr
    output fails the cell. ``fsdp-lab doctor`` still recommends the CPU build there. Raises
    nothing of its own."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        logger.setLevel(level)


import_cpp_extension_quietly()


def nearest_code_cases() -> torch.Tensor:
    """The values every answer is tried on (float32): 10,000 uniform in [-1, 1], the 16 codes,
    and the 15 float32 midpoints between neighbouring codes (bitsandbytes' thresholds)."""
    from fsdp_lab.qlora.nf4 import NF4_CODEBOOK

    generator = torch.Generator().manual_seed(3)
    uniform = torch.rand(10_000, generator=generator) * 2 - 1
    return torch.cat([uniform, NF4_CODEBOOK, _midpoints()])


def _midpoints() -> torch.Tensor:
    from fsdp_lab.qlora.nf4 import NF4_CODEBOOK

    return (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2


@checker("nearest_code", hint="midpoints = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2; a value's code is "
                              "how many midpoints lie strictly below it")
def check_nearest_code(nearest_code):
    """Compare ``nearest_code(values)`` with fsdp_lab's NF4 lookup on 10,000 uniform values in
    [-1, 1], the 16 code values and the 15 float32 midpoints between them (a value on a midpoint
    goes to the lower code, as in bitsandbytes); name the usual mistakes (float codes, midpoints
    sent up, an argmin of distances, an evenly spaced grid, mirrored codes)."""
    from fsdp_lab.qlora.nf4 import nearest_nf4_code

    values = nearest_code_cases()
    got = nearest_code(values.clone())
    if not isinstance(got, torch.Tensor) or got.shape != values.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return mistake("shape", f"for {values.numel()} values it returned {shape}; return one index per "
                                "value, same shape as the input")
    if got.is_floating_point():
        return mistake("float_codes", f"it returned {got.dtype} values; a code is an integer index 0..15 "
                                      "(uint8, so two fit in one byte)",
                       "return the count of midpoints below each value, as torch.uint8")
    got, want = got.long(), nearest_nf4_code(values).long()
    wrong = got != want
    if not wrong.any():
        block = values[:10_000].reshape(100, 100)   # a weight is 2-D: the codes keep its shape
        try:
            square = nearest_code(block.clone())
        except Exception as error:  # noqa: BLE001 - named in the verdict
            square = error
        if not (isinstance(square, torch.Tensor) and square.shape == block.shape
                and torch.equal(square.long(), nearest_nf4_code(block).long())):
            shown = (f"shape {tuple(square.shape)}" if isinstance(square, torch.Tensor)
                     else f"{type(square).__name__}: {square}" if isinstance(square, Exception)
                     else type(square).__name__)
            return mistake("not_shape_kept", f"right for a 1-D input, but a (100, 100) input gave {shown}: "
                                             "return one code per value, in the input's shape",
                           "compare values.unsqueeze(-1) with the midpoints and sum over that last dimension")
        return correct(f"all {values.numel():,} values agree with fsdp_lab's lookup, the 15 midpoints "
                       "included: each value goes to its nearest normal quantile, so the 16 codes are dense "
                       "near 0, where most weights are")
    ties = torch.isin(values, _midpoints())
    first = int(wrong.nonzero()[0])
    example = f"e.g. {values[first].item():+.6f} -> {got[first].item()}, want {want[first].item()}"
    if bool(ties[wrong].all()):
        if bool((got[ties] == want[ties] + 1).all()):
            return mistake("ties_up", f"only the {int(wrong.sum())} midpoints differ ({example}): a "
                                      "value on a midpoint went to the upper code; bitsandbytes sends it "
                                      "to the lower",
                           "count midpoints strictly below the value (`>`, not `>=`)")
        return mistake("tie_rounding", f"only values on midpoints differ ({example}): an argmin of distances "
                                       "(or midpoints not computed in float32) sends some of them up, where "
                                       "float32 rounding left the midpoint a little nearer the upper code; "
                                       "bitsandbytes' rule is a threshold, not a distance",
                       "compare each value with the 15 float32 midpoints (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2")
    uniform = torch.round((values + 1) / 2 * 15).long()
    if torch.equal(got, uniform):
        return mistake("uniform", f"{int(wrong.sum())} values differ ({example}): that is an evenly spaced "
                                  "grid; NF4's codes are normal quantiles, closer together near 0",
                       "look the values up in NF4_CODEBOOK itself")
    if torch.equal(got, 15 - want):
        return mistake("reversed", f"every index is mirrored ({example}): code 0 is -1.0 and code 15 is +1.0")
    return mistake("wrong", f"{int(wrong.sum())} of {values.numel():,} values differ ({example})")


def lora_case(seed: int = 0) -> dict:
    """The tensors a LoRA forward is checked on: an NF4 weight (32 x 48), A (4 x 48) and B
    (32 x 4) both random, alpha 10, rank 4 (a scaling of 2.5, which integer division or a typed-in
    constant would miss), and an input of shape (2, 3, 48)."""
    from fsdp_lab.qlora import to_nf4

    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, 3, 48, generator=g),
            "weight": to_nf4(torch.randn(32, 48, generator=g) * 0.1),
            "lora_a": torch.randn(4, 48, generator=g) * 0.1,
            "lora_b": torch.randn(32, 4, generator=g) * 0.1,
            "alpha": 10.0, "rank": 4}


def _reference(case: dict):
    """LoRALinear's output and its gradients for A and B (loss: the output's sum)."""
    from fsdp_lab.qlora import LoRALinear

    base = nn.Linear(48, 32, bias=False)
    base.weight = nn.Parameter(case["weight"], requires_grad=False)
    layer = LoRALinear(base, rank=case["rank"], alpha=case["alpha"])
    with torch.no_grad():
        layer.lora_a.copy_(case["lora_a"])
        layer.lora_b.copy_(case["lora_b"])
    out = layer(case["x"])
    out.sum().backward()
    return out.detach(), layer.lora_a.grad, layer.lora_b.grad


def _explain_lora(error: BaseException, text: str):
    if "cannot be multiplied" in text or "size mismatch" in text or "shape" in text and "mat" in text:
        return mistake("order", f"the shapes do not chain ({text.splitlines()[0]}): A is rank x in and B is "
                                "out x rank, so x goes through A first (in -> rank), then B (rank -> out)",
                       "update = F.linear(F.linear(x, lora_a), lora_b)")
    if "NF4Tensor" in text or "NF4" in text and "NotImplementedError" in text:
        return mistake("nf4_op", f"an NF4 weight supports few ops ({text.splitlines()[0]}); F.linear(x, weight) "
                                 "dequantizes it for you", "base = F.linear(x, weight)")
    return None


@checker("lora_forward", hint="the frozen weight's output (F.linear dequantizes an NF4 weight) plus x through "
                              "lora_a, then lora_b, times alpha / rank",
         explain=_explain_lora)
def check_lora_forward(lora_forward):
    """Run ``lora_forward(x, weight, lora_a, lora_b, alpha, rank)`` on an NF4 weight and compare its
    output and the gradients of ``lora_a`` and ``lora_b`` with fsdp_lab's ``LoRALinear``; name
    the usual mistakes (scaling by alpha or its floor, adapters left out, a detached update)."""
    case = lora_case()
    want, want_grad_a, want_grad_b = _reference(case)
    lora_a = case["lora_a"].clone().requires_grad_(True)
    lora_b = case["lora_b"].clone().requires_grad_(True)
    got = lora_forward(case["x"], case["weight"], lora_a, lora_b, case["alpha"], case["rank"])
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return mistake("shape", f"for x of shape {tuple(case['x'].shape)} it returned {shape}, want {tuple(want.shape)}")
    x, w, a, b = case["x"], case["weight"], case["lora_a"], case["lora_b"]
    base, update = F.linear(x, w), F.linear(F.linear(x, a), b)
    scaling = case["alpha"] / case["rank"]
    if not torch.allclose(got.detach(), want, atol=TOLERANCE, rtol=0):
        candidates = [("no_scaling", base + update, "the update was added unscaled"),
                      ("alpha_only", base + update * case["alpha"], "the update was scaled by alpha, not alpha / rank"),
                      ("inverted_scaling", base + update / scaling, "the update was scaled by rank / alpha"),
                      ("floor_division", base + update * (case["alpha"] // case["rank"]),
                       "alpha // rank is integer division: the update was scaled by its floor"),
                      ("base_only", base, "only the frozen weight's output: the adapters were left out"),
                      ("update_only", update * scaling, "only the adapters' update: the frozen weight's output "
                                                        "x Wᵀ was left out")]
        for name, value, what in candidates:
            if torch.allclose(got.detach(), value, atol=TOLERANCE, rtol=0):
                return mistake(name, f"{what}; with alpha {case['alpha']:g} and rank {case['rank']} the update "
                                     f"is multiplied by {scaling:g}")
        error = (got.detach() - want).abs().max().item()
        return mistake("wrong", f"largest difference from LoRALinear: {error:.3g}")
    if not got.requires_grad:
        return mistake("detached", "the output carries no gradient: the update was computed under no_grad or "
                                   "detached, so A and B would never train",
                       "keep lora_a and lora_b in the autograd graph")
    got.sum().backward()
    if lora_a.grad is None or lora_b.grad is None:
        return mistake("detached", "lora_a or lora_b got no gradient; the update must use them directly")
    if not (torch.allclose(lora_a.grad, want_grad_a, atol=TOLERANCE, rtol=0)
            and torch.allclose(lora_b.grad, want_grad_b, atol=TOLERANCE, rtol=0)):
        return mistake("gradients", "the output is right but A's or B's gradient is not; compute the output "
                                    "from lora_a and lora_b themselves")
    return correct(f"output and gradients of A and B match LoRALinear (to {TOLERANCE:g}) with a random B: the "
                   f"frozen NF4 weight gets no gradient, the update is scaled by alpha / rank = {scaling:g}, "
                   "and only the r·(in + out) adapter values train")


# ----------------------------------------------------------------------------- the lab's figures and tables
# matplotlib and ipywidgets are imported inside these functions: checking an answer needs neither.


def plot_codebook_over_normal():
    """The 16 NF4 code values as vertical lines over the N(0, 1) density, on the normalised axis
    (x / absmax of its block; the outermost quantile lands on ±1). Returns the Figure."""
    import matplotlib.pyplot as plt

    from fsdp_lab.qlora.nf4 import NF4_CODEBOOK

    fig, ax = plt.subplots(figsize=(8, 3))
    xs = torch.linspace(-1.1, 1.1, 400)
    scale = NormalDist().inv_cdf(0.9677083)  # the outermost quantile is normalised to 1
    pdf = torch.tensor([NormalDist().pdf(float(x) * scale) for x in xs])
    ax.plot(xs, pdf / pdf.max(), color="gray", label="N(0,1) density (scaled)")
    ax.vlines(NF4_CODEBOOK, 0, 1, color="tab:blue", label="NF4 code values")
    ax.set_xlabel("normalised value (x / absmax of its block)"); ax.legend(loc="upper left", fontsize=8)
    ax.set_title("NF4: codes are denser where weights are")
    fig.tight_layout()
    return fig


def print_memory_at_rest(result, rank: int = 0) -> None:
    """Print the non-zero memory categories (bytes) rank ``rank`` holds after a step: ``result`` is
    its MemoryTracker result, read through its ``current`` {category: bytes}."""
    print(f"rank {rank} at rest after the step (bytes):")
    for category, nbytes in result.current.items():
        if nbytes:
            print(f"  {category:16} {nbytes:>10,}")


def shortest_time(fn, repeats: int = 7) -> float:
    """The shortest of ``repeats`` calls of ``fn()``, in seconds: other work on the machine only
    ever adds time, so the fastest call is the least disturbed."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return min(times)


def print_shortest_times(calls: dict) -> None:
    """Time each of ``calls`` ({label: fn}) with ``shortest_time`` and print its milliseconds,
    then how many times longer each took than the last one, the reference."""
    seconds = {label: shortest_time(fn) for label, fn in calls.items()}
    width = max(map(len, seconds))
    for label, t in seconds.items():
        print(f"{label:{width}} {1e3 * t:7.2f} ms")
    *others, reference = seconds
    print(f"time / {reference}'s: " + "; ".join(f"{label} {seconds[label] / seconds[reference]:.1f}x"
                                                   for label in others))


def print_recorded_compile_ratios(path, lab_shape) -> None:
    """Print the ratios ``benchmarks/nf4_compile.py`` recorded in the JSON file ``path`` (each eager
    form's time / the compiled time), with the device and the weight shape they were measured on,
    and ``lab_shape``, the shape the lab times. Without the file (labs copied away from the
    repository's ``benchmarks/``) it says so and how to record one, so the notebook runs on.
    Raises KeyError for a file without the ratios, the device or the shape."""
    if not os.path.exists(path):
        print(f"no recorded benchmark at {path}: run python benchmarks/nf4_compile.py in the repository")
        return
    with open(path, encoding="utf-8") as fh:
        recorded = json.load(fh)
    shape = " x ".join(str(n) for n in recorded["shape"])
    print(f"recorded by benchmarks/nf4_compile.py on {recorded['device']}, a {shape} weight (this lab times "
          f"{' x '.join(str(n) for n in lab_shape)}): time / compiled's: eager (gather form) "
          f"{recorded['ratio_eager_gather_over_compiled']:.2f}x; eager (element-wise form) "
          f"{recorded['ratio_eager_elementwise_over_compiled']:.1f}x")


def train_recorded(model, steps: int = 3) -> dict:
    """On each rank of a launch: ``steps`` AdamW steps (lr 5e-3, trainable parameters only) of the
    sharded ``model`` on lab 08's batches (4 x 32 tokens over the ranks); the second step is recorded.
    Returns "losses" (this rank's), "memory" (that step's MemoryResult), "events" (its collectives:
    name, module, bytes) and "unsharded_after" (bytes still gathered after the last step)."""
    import torch.distributed as dist

    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.timeline import Timeline

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    losses, result, events = [], None, []
    for step in range(steps):
        batch = shard_batch(global_batch(512, 4, 32, step=step), rank, world)
        recording = step == 1
        with MemoryTracker(model, opt) if recording else contextlib.nullcontext() as tracker, \
                Timeline() if recording else contextlib.nullcontext() as timeline:
            loss = model(batch.input_ids, batch.labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        if recording:
            result = tracker.result()
            events = [(e.name, e.args.get("module"), e.bytes) for e in timeline.comm_events(rank)]
        losses.append(loss.item())
    return {"losses": losses, "memory": result, "events": events, "unsharded_after": bytes_still_gathered(model)}


def bytes_still_gathered(model) -> int:
    """Bytes held by the all-gather outputs of every FSDP2 group in ``model`` (0 once every group
    has resharded). Reads FSDP2's per-module state (``_fsdp_state``): a module without a group
    holds nothing."""
    return sum(p.untyped_storage().nbytes() for s in model.modules() if hasattr(s, "_fsdp_state")
               and s._fsdp_state.group is not None
               for f in s._fsdp_state.group.fsdp_params for p in f.all_gather_outputs)


def plot_qlora_two_ranks(runs: list[dict], nf4_block: int, bf16_block: int):
    """Left: memory by category at each rank's peak (KiB); right: the bytes one block's all-gather
    moves (KiB), measured with NF4 linears (``nf4_block``) against the same block with bf16
    linears (``bf16_block``). ``runs``: per rank, a dict whose "memory" has a ``peak``
    {category: bytes}. Returns the Figure. Raises ValueError (from ``plot_breakdown``) for an
    unknown memory category."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    plot_breakdown({f"rank {i}": r["memory"].peak for i, r in enumerate(runs)}, ax=axes[0], unit="KiB",
                   title=f"QLoRA on {len(runs)} ranks: memory at the peak")
    labels = ["NF4 block\n(measured)", "same block,\nbf16 linears"]
    axes[1].bar(labels, [nf4_block / 1024, bf16_block / 1024], color=["tab:purple", "tab:gray"])
    axes[1].set_ylabel("KiB per all-gather"); axes[1].set_title("bytes moved to unshard one block")
    fig.tight_layout()
    return fig


ANSWER_AI = "Answer.AI (rank 64), peak reserved"
TALK = ("talk, FSDP1 + bitsandbytes", "talk, FSDP2 + torchao NF4")


def _share(breakdown, category: str) -> float:
    return breakdown.bytes.get(category, 0) / breakdown.total


def print_published_against_estimates(published: dict, talk_estimate: dict, small_batch_estimate: dict,
                                      recorded: str) -> None:
    """Print the published Llama-2-7B QLoRA figures (GiB) beside the estimates of live bytes:
    ``published`` {label: GiB} with the two talk figures and Answer.AI's; ``talk_estimate``
    {strategy: Breakdown} at batch 8 x 2048, rank 8, with an "fsdp2" entry; ``small_batch_estimate``
    {LoRA rank: Breakdown} at batch 1 x 512, with a rank 64 entry (Breakdowns from
    ``fsdp_lab.memory.estimate.estimate``). Then the share of activations and temporaries in the
    FSDP2 / rank-64 estimates. The runs ``benchmarks/qlora_7b.py`` recorded in the folder
    ``recorded`` are added: on fake tensors (CPU), and on a GPU (``--device cuda``,
    ``max_memory_allocated``) with the GPU and torch they ran on; for a missing file a line says
    how to make it. Raises KeyError for a missing figure or estimate."""
    gib = {key: b.total / 2**30 for key, b in [*talk_estimate.items(), *small_batch_estimate.items()]}
    print("batch 8 x 2048, rank 8")
    for label in TALK:
        print(f"  {'published: ' + label:<50}{published[label]:6.2f} GiB")
    for strategy in talk_estimate:
        print(f"  {'estimate of live bytes, ' + strategy:<50}{gib[strategy]:6.2f} GiB")
    print("batch 1 x 512")
    print(f"  {'published: ' + ANSWER_AI:<50}{published[ANSWER_AI]:6.2f} GiB")
    for rank in small_batch_estimate:
        print(f"  {f'estimate of live bytes, rank {rank}':<50}{gib[rank]:6.2f} GiB")
    _print_recorded_runs(recorded)
    print(f"published minus estimate: {published[ANSWER_AI] - gib[64]:.2f} GiB at batch 1 x 512 "
          f"(rank 64); {published[TALK[1]] - gib['fsdp2']:+.2f} GiB for the talk's FSDP2 figure")
    big, small = talk_estimate["fsdp2"], small_batch_estimate[64]
    print(f"share of the estimate (FSDP2): activations {_share(big, 'activations'):.0%}, temporaries "
          f"{_share(big, 'temporaries'):.0%} at batch 8 x 2048; activations {_share(small, 'activations'):.0%}, "
          f"temporaries {_share(small, 'temporaries'):.0%} at batch 1 x 512 (rank 64)")


# benchmarks/qlora_7b.py's result files: (file, kind of run, where a strategy's run is, command)
_RECORDED_RUNS = (
    ("qlora_7b_estimate_cpu.json", "fake-tensor", lambda saved, s: saved.get(f"fake_tensor_run_{s}", {}),
     "python benchmarks/qlora_7b.py"),
    ("qlora_7b_cuda.json", "GPU", lambda saved, s: saved.get("measured", {}).get(s, {}),
     "python benchmarks/qlora_7b.py --device cuda (on a GPU)"),
)


def _print_recorded_runs(recorded) -> None:
    for file, kind, run_of, command in _RECORDED_RUNS:
        path = os.path.join(recorded, file)
        if not os.path.exists(path):
            print(f"  (no {kind} runs: {path} is missing; {command} writes it)")
            continue
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
        for strategy in ("fsdp2", "fsdp1"):
            run = run_of(saved, strategy)
            if "peak_gib" in run:  # after a "≈": the file is rewritten whenever the benchmark runs
                print(f"  {f'{kind} run of our {strategy.upper()}, rank 8':<49}≈{run['peak_gib']:.2f} GiB")
        if kind == "GPU":
            print(f"  (GPU runs: {saved.get('gpu', 'unnamed GPU')}, torch {saved.get('torch', '?')}, "
                  f"torch.cuda.max_memory_allocated)")


def print_bitsandbytes_buffers(config) -> None:
    """Print, for a Llama ``config`` quantized by bitsandbytes (one 8-bit double-quantized absmax per
    64 values of every block linear), the absmax statistics every rank keeps (GiB) and the largest
    bf16 weight a matmul dequantizes to (MiB), both worked out from the shapes."""
    d, f = config.dim, config.ffn_hidden
    shapes = [(config.n_heads * config.head_dim, d), (config.n_kv_heads * config.head_dim, d),
              (config.n_kv_heads * config.head_dim, d), (d, config.n_heads * config.head_dim), (f, d), (f, d), (d, f)]
    statistics = config.n_layers * sum(o * i for o, i in shapes) // 64
    largest = max(shapes, key=lambda s: s[0] * s[1])
    print(f"absmax statistics on every rank: {statistics / 2**30:.3f} GiB; largest bf16 temporary "
          f"({largest[0]} x {largest[1]}): {2 * largest[0] * largest[1] / 2**20:.1f} MiB")


def draw_7b_states(per_rank: dict, block_nf4: float, block_bf16: float, world_size: int):
    """(Figure, text) of one Llama-2-7B QLoRA setting: the per-rank model states ``per_rank``
    ({category: bytes}, drawn in GiB) and one block's all-gather in NF4 (``block_nf4`` bytes)
    against bf16 (``block_bf16`` bytes, drawn in MiB); the text gives the bits per weight, the
    GiB per rank and both all-gathers in MiB. Raises ValueError (from ``plot_breakdown``) for an
    unknown memory category."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    plot_breakdown({f"{world_size} rank{'s' if world_size > 1 else ''}": per_rank}, ax=axes[0], unit="GiB",
                   title="Llama-2-7B per rank (bf16)")
    axes[1].bar(["NF4", "bf16"], [block_nf4 / 2**20, block_bf16 / 2**20], color=["tab:purple", "tab:gray"])
    gathered = world_size > 1   # one rank holds every block whole: nothing is gathered
    axes[1].set_ylabel("MiB per block all-gather" if gathered else "MiB per block")
    axes[1].set_title("one block's all-gather" if gathered else "one block (1 rank: no all-gather)")
    fig.tight_layout()
    bits = 8 * block_nf4 / (block_bf16 / 2)
    sizes = f"{block_nf4 / 2**20:.1f} MiB vs {block_bf16 / 2**20:.1f} MiB in bf16"
    return fig, (f"{bits:.3f} bits/weight; model states {sum(per_rank.values()) / 2**30:.2f} GiB per rank; "
                 + (f"all-gather {sizes}" if gathered else f"one rank gathers nothing (a block: {sizes})"))


def print_adapters_against_frozen(model_states, world_size: int = 2) -> None:
    """For LoRA ranks 8 and 64 (block size 64, double quantization), print per rank of
    ``world_size`` (GiB) the NF4 weights, the adapters with their gradients and AdamW state, and
    the frozen bf16 embeddings, norms and output layer of Llama-2-7B, and which of the last two is
    larger. ``model_states(lora_rank, block_size, double_quant, world_size)`` returns the per-rank
    {category: bytes} first, as the lab's ``seven_b`` does. Raises KeyError for a missing category."""
    from fsdp_lab.models.llama import LlamaConfig

    c7, world = LlamaConfig.from_name("llama2-7b"), world_size
    frozen = 2 * (2 * c7.vocab_size * c7.dim + (2 * c7.n_layers + 1) * c7.dim) / world  # bf16 embeddings, output, norms
    for lora_rank in (8, 64):
        per_rank = model_states(lora_rank, 64, True, world)[0]
        adapters = per_rank["sharded_params"] - frozen + per_rank["sharded_grads"] + per_rank["optimizer_state"]
        print(f"LoRA rank {lora_rank:2d}, GiB per rank of {world}: NF4 weights {per_rank['quantized'] / 2**30:.2f}, "
              f"adapters with grads and AdamW state {adapters / 2**30:.2f}, frozen embeddings + norms + output "
              f"{frozen / 2**30:.2f} -> adapters {'larger' if adapters > frozen else 'smaller'} than the frozen part")
