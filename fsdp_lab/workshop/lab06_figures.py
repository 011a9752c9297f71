"""Lab 06's figures and tables (mixed precision): the life of a gradient through a policy's
dtypes, the policy table's memory columns, ratios and losses, the optim-mode bug, and the
explorer's figure of one policy run. ``fsdp_lab.workshop.lab06`` holds the checkers and the
training loop and re-exports these, so the notebook reaches them all as ``lab06.<name>``.

matplotlib and ipywidgets are imported inside these functions: the checkers' ranks import
``lab06``, and through it this module, and need neither.
"""

from __future__ import annotations

import torch


DTYPE_COLORS = {torch.float32: "#4C72B0", torch.bfloat16: "#DD8452", torch.float16: "#55A868"}
MEMORY_COLUMNS = {"sharded_params": ("sharded", 7), "unsharded_params": ("gathered", 8),
                  "unsharded_grads": ("acc.grad", 8), "sharded_grads": ("sh.grad", 7),
                  "optimizer_state": ("optim", 6), "activations": ("act.", 6), "temporaries": ("temp", 6)}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype without its module: ``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def draw_gradient_life(life: dict, stages: list[tuple[str, str]], ax=None):
    """One box per stage of a gradient's life, left to right, coloured by dtype and labelled with
    its size in KiB. ``life``: {stage: (dtype, bytes)}; ``stages``: [(stage, label)] in order.
    Returns the Axes. Raises KeyError for a stage that ``life`` lacks."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(11, 2.6))[1]
    for i, (key, label) in enumerate(stages):
        dtype, nbytes = life[key]
        ax.add_patch(plt.Rectangle((i * 1.5, 0), 1.2, 1, color=DTYPE_COLORS.get(dtype, "#999"), alpha=0.85))
        ax.text(i * 1.5 + 0.6, 0.62, dtype_name(dtype), ha="center", fontsize=9, color="white", weight="bold")
        ax.text(i * 1.5 + 0.6, 0.3, f"{nbytes / 1024:.0f} KiB", ha="center", fontsize=8, color="white")
        ax.text(i * 1.5 + 0.6, -0.25, "\n".join(label.split(" ", 2)[:2] + label.split(" ", 2)[2:]),
                ha="center", va="top", fontsize=7)
        if i:
            ax.annotate("", xy=(i * 1.5, 0.5), xytext=(i * 1.5 - 0.3, 0.5), arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.2, len(stages) * 1.5)
    ax.set_ylim(-0.9, 1.2)
    ax.axis("off")
    ax.set_title("life of layers.0.feed_forward.w1's gradient (rank 0, 2 ranks)")
    return ax


def print_policy_memory(table: dict) -> None:
    """Print one row per policy: the highest each memory category reached (KiB) and the bytes
    all-gathered and reduce-scattered per step. ``table``: {policy: {"highest": {category: bytes},
    "wire": {collective: bytes}}}. Raises KeyError for a row without "highest" or "wire"."""
    header = " ".join(f"{name:>{width}}" for name, width in MEMORY_COLUMNS.values())
    print(f"{'policy':>30} | {header} | {'AG bytes':>9} {'RS bytes':>9}")
    for name, row in table.items():
        m = row["highest"]
        print(f"{name:>30} | " + " ".join(f"{m.get(c, 0) / 1024:{w}.0f}" for c, (_, w) in MEMORY_COLUMNS.items())
              + f" | {row['wire'].get('all_gather', 0):9,d} {row['wire'].get('reduce_scatter', 0):9,d}")
    print("(KiB on rank 0: the highest each category reached during the second step; bytes per step on rank 0)")


def plot_policies(table: dict):
    """Left: each policy's loss minus the "fp32" policy's, step by step; right: memory by category
    at rank 0's peak (KiB), one stacked bar per policy. ``table``: {policy: {"losses": [...],
    "memory": {category: bytes}}}. Returns the Figure. Raises KeyError without an "fp32" policy."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    reference = table["fp32"]["losses"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1.1, 1]})
    for name, row in table.items():
        if name != "fp32":
            ax0.plot(range(1, len(reference) + 1), [a - b for a, b in zip(row["losses"], reference)], label=name, lw=1.2)
    ax0.axhline(0, color="black", lw=0.8, label="fp32 (the reference)")
    ax0.set_xlabel("step"); ax0.set_ylabel("loss − fp32 loss")
    ax0.set_title(f"each policy's loss minus the fp32 run's (fp32: {reference[0]:.3f} → {reference[-1]:.3f})", fontsize=9)
    ax0.legend(fontsize=7)
    plot_breakdown({name.replace(" + ", "\n"): row["memory"] for name, row in table.items()}, ax=ax1, unit="KiB",
                   title="memory by category at rank 0's peak, second step")
    ax1.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    return fig


def print_policy_ratios(table: dict) -> None:
    """Print what bf16 halves and what float32 accumulation doubles, as ratios between the lab's
    four policies (named as in the lab): gathered parameters, all-gather and reduce-scatter bytes,
    the accumulation buffer. Raises KeyError if a policy or a collective is missing."""
    def highest(policy, category):
        return table[policy]["highest"].get(category, 0)

    def wire(policy, collective):
        return table[policy]["wire"][collective]

    fp32, bf16 = "fp32", "bf16 params + fp32 reduce"
    acc32, acc16 = "bf16 comm + fp32 accumulation", "bf16 params + bf16 reduce"
    print(f"gathered params, bf16 / fp32 compute: "
          f"{highest(bf16, 'unsharded_params') / highest(fp32, 'unsharded_params'):.2f}; "
          f"all-gather bytes: {wire(bf16, 'all_gather') / wire(fp32, 'all_gather'):.2f}; "
          f"reduce-scatter bytes, bf16 / fp32 wire: {wire(acc16, 'reduce_scatter') / wire(bf16, 'reduce_scatter'):.2f}; "
          f"acc.grad column, fp32 / bf16 accumulation: "
          f"{highest(acc32, 'unsharded_grads') / highest(acc16, 'unsharded_grads'):.2f}")


def print_policy_losses(table: dict, gap: dict) -> None:
    """Print each policy's first and last loss (the header names the last step, the length of the
    longest loss list) and its largest distance from the reference (``gap``: {policy: largest
    |loss - fp32 loss|}; the reference has no entry). Raises KeyError for a row without "losses"."""
    # ≈: bf16/fp16 digits that depend on the CPU's matrix kernels (oneDNN's AMX or AVX-512 BF16 where
    # the CPU has them, PyTorch's own elsewhere); labs/nbval_sanitize.cfg leaves them out of the comparison
    last_step = f"loss@{max(len(row['losses']) for row in table.values())}"
    print(f"{'policy':>30} | {'loss@1':>7} {last_step:>7} | largest |loss - fp32 loss|")
    for name, row in table.items():
        first, last = row["losses"][0], row["losses"][-1]
        print(f"{name:>30} | {'≈%.4f' % first:>7} {'≈%.4f' % last:>7} | "
              + (f"≈{gap[name]:.2e}" if name in gap else "(the reference)"))


def plot_optim_mode_bug(bug: dict):
    """Left: the loss per step of the single process, the fixed and the buggy reduction; right:
    buggy minus fixed. ``bug``: {"single process" | "fixed" | "buggy": [loss per step]}. Returns
    the Figure. Raises KeyError if one of the three runs is missing."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.4))
    steps = range(1, len(bug["fixed"]) + 1)
    for name, style in [("single process", dict(color="black", lw=2.5, alpha=0.35)),
                        ("fixed", dict(color="#4C72B0", lw=1.2)), ("buggy", dict(color="#C44E52", lw=1.2))]:
        ax0.plot(steps, bug[name], label=name, **style)
    ax0.set_xlabel("step"); ax0.set_ylabel("loss (mean over ranks)"); ax0.legend(fontsize=8)
    ax0.set_title("ZeRO-1 on 2 ranks, reduced the way Megatron-FSDP's optim mode did")
    ax1.plot(steps, [b - f for b, f in zip(bug["buggy"], bug["fixed"])], color="#C44E52")
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_xlabel("step"); ax1.set_ylabel("buggy loss − fixed loss")
    ax1.set_title("the cost of counting each rank's own gradient twice")
    fig.tight_layout()
    return fig


def print_optim_mode_bug(bug: dict) -> None:
    """Print the losses of the three runs at a few steps, the largest distance of the fixed run from
    the single process, the step where the buggy run leaves the fixed one, and their mean loss over
    the last 10 steps. ``bug``: {"single process" | "fixed" | "buggy": [loss per step]}, at least
    30 steps. Raises StopIteration if the buggy and fixed runs never differ by more than 1e-4."""
    steps = len(bug["fixed"])
    print(f"{'step':>5} | {'single process':>14} {'fixed (copy)':>12} {'buggy (add)':>11}")
    for step in (1, 10, 20, 30, steps):
        print(f"{step:5d} | {bug['single process'][step - 1]:14.4f} {bug['fixed'][step - 1]:12.4f} {bug['buggy'][step - 1]:11.4f}")
    fixed_gap = max(abs(a - b) for a, b in zip(bug["fixed"], bug["single process"]))
    print(f"fixed vs single process: largest difference {'below 1e-5' if fixed_gap < 1e-5 else f'{fixed_gap:.1e}'} "
          "(float32 round-off)")
    first = next(i + 1 for i, (b, f) in enumerate(zip(bug["buggy"], bug["fixed"])) if abs(b - f) > 1e-4)
    tail_buggy, tail_fixed = sum(bug["buggy"][-10:]) / 10, sum(bug["fixed"][-10:]) / 10
    print(f"buggy leaves the fixed run at step {first}; mean loss over the last 10 steps: buggy {tail_buggy:.4f}, "
          f"fixed {tail_fixed:.4f} ({'higher' if tail_buggy > tail_fixed else 'lower'} with the bug); buggy above fixed on "
          f"{sum(b > f for b, f in zip(bug['buggy'][1:], bug['fixed'][1:]))} of {steps - 1} steps after the first")

def draw_policy_run(run: dict):
    """(Figure, text) of one policy's run: its loss curve and its memory at rank 0's peak (KiB);
    the text gives the bytes per collective per step, the first and last loss, and, under loss
    scaling, the final scale and the steps skipped. ``run``: the dict ``train_and_measure``
    returns ("losses", "memory", "wire", "scale", "skipped"). Raises KeyError if one is missing,
    ValueError (from ``plot_breakdown``) for an unknown memory category."""
    import matplotlib.pyplot as plt

    from fsdp_lab.viz.memory_plots import plot_breakdown

    steps = len(run["losses"])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.4))
    ax0.plot(range(1, steps + 1), run["losses"], color="#4C72B0")
    ax0.set_xlabel("step"); ax0.set_ylabel("loss"); ax0.set_title("loss")
    plot_breakdown({"this policy": run["memory"]}, ax=ax1, unit="KiB", title="memory at rank 0's peak")
    fig.tight_layout()
    wire = ", ".join(f"{k} {v:,d} B" for k, v in run["wire"].items())
    scaling = (f" | loss scale {run['scale']:g}, {run['skipped']} of {steps} steps skipped"
               if run["scale"] is not None else "")
    return fig, f"per step on rank 0: {wire} | loss ≈{run['losses'][0]:#.3g} -> ≈{run['losses'][-1]:#.3g}{scaling}"
