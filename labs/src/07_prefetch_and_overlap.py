"""Lab 07: prefetching, overlap and apples-to-apples benchmarking with collective timelines."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 07 — Prefetch, overlap, and comparing FSDP1 with FSDP2 fairly

    **Goals.**

    1. Read a collective timeline: which all-gather belongs to which block, what runs under compute.
    2. See what prefetching buys (overlap) and what it costs (one more unit gathered, for the settings
       that gather the next unit while the current one is held), and write the backward order of each
       prefetch setting yourself.
    3. Change the wrapping granularity (per block, per two blocks, whole model) and predict the counts
       and the bytes yourself.
    4. Redo a famous benchmarking mistake: compare FSDP1 with FSDP2 unfairly, then fairly, then phase
       by phase — with repeats, because times vary from run to run.
    5. Measure the cost of the optimizer step: a per-parameter loop, `foreach`, and `fused` AdamW.
    6. Write the overlap metric yourself and check it against `Timeline.overlap()`.
    """),
    code("""
    %matplotlib inline
    import os
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import torch
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab.compare import compare
    from fsdp_lab.models.llama import Llama
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab_files, lab07
    from fsdp_lab.workshop.repeats import Repeats, spread

    files = lab_files("07_prefetch_and_overlap")   # labs/figures/07_prefetch_and_overlap, from labs/ or labs/solutions/
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: what the wrapping implies

    Every `fully_shard` call is one *unit*: one all-gather before it computes, one reduce-scatter of its
    gradients. With one unit per block of our Llama (L blocks; the cell prints L) plus the root (embeddings,
    final norm, output), a training step needs

    * forward: the root once, then each block: 1 + L all-gathers;
    * backward: each block again (it was freed after forward; the root was kept, it is needed at once): L more
      all-gathers;
    * one reduce-scatter per unit: 1 + L.

    An all-gather of a unit moves the unit's full parameter bytes (nccl-tests counts the gathered size). Work
    the numbers out on one process, before running anything:
    """),
    code("""
    model = Llama("cpu", seed=0)
    root_bytes = 4 * sum(p.numel() for m in (model.tok_embeddings, model.norm, model.output) for p in m.parameters())
    block_bytes = 4 * sum(p.numel() for p in model.layers[0].parameters())
    layers = len(model.layers)
    expected = {"all_gathers": 1 + 2 * layers, "reduce_scatters": 1 + layers,
                "gathered_bytes": root_bytes + 2 * layers * block_bytes,
                "reduced_bytes": root_bytes + layers * block_bytes}
    print(f"root {root_bytes:,} B, one block {block_bytes:,} B, {layers} blocks")
    for key, value in expected.items():
        print(f"{key:>16}: {value:,}")
    """),
    md("""
    ## 2. Run every configuration at once

    `fsdp_lab.compare` builds the same model from the same seed for each configuration, trains it on the same
    batches and records the last step's timeline on every rank — all configurations in one launch of 2 ranks.
    Each configuration trains three steps: the first warms up (AdamW creates its state), MemoryTracker
    measures the second, the first step that repeats, and the third is timed with its timeline recorded. The
    table has the counts and bytes of one step, the peak of gathered parameters and the loss.
    """),
    code("""
    RUNS = [
        dict(name="fsdp2 block", implementation="fsdp2"),
        dict(name="fsdp2 block no-prefetch", prefetch="none"),
        dict(name="fsdp2 block synchronous", synchronous=True),
        dict(name="fsdp2 block explicit", prefetch="explicit"),
        dict(name="fsdp2 block keep-gathered", reshard_after_forward=False),
        dict(name="fsdp2 two_blocks", wrapping="two_blocks"),
        dict(name="fsdp2 model", wrapping="model"),
        dict(name="fsdp2 block offload", cpu_offload=True),
        dict(name="fsdp2 two_blocks offload", wrapping="two_blocks", cpu_offload=True),
        dict(name="fsdp2 model offload", wrapping="model", cpu_offload=True),
        dict(name="fsdp1 block pre", implementation="fsdp1", prefetch="backward_pre"),
        dict(name="fsdp1 block post", implementation="fsdp1", prefetch="backward_post"),
        dict(name="fsdp1 block none", implementation="fsdp1", prefetch="none"),
        dict(name="fsdp1 block fwd-prefetch", implementation="fsdp1", forward_prefetch=True),
        dict(name="fsdp2 block for_loop", optimizer="for_loop"),
        dict(name="fsdp2 block fused", optimizer="fused"),
        dict(name="fsdp1 block for_loop", implementation="fsdp1", optimizer="for_loop"),
        dict(name="fsdp1 block fused", implementation="fsdp1", optimizer="fused"),
    ]
    table = compare(RUNS, model="cpu", steps=3, world_size=2, batch_size=4, seq_len=32)
    """),
    code("""
    row = table.row("fsdp2 block")   # against section 1's numbers worked out by hand
    print("measured == worked out by hand:", all(row[k] == v for k, v in expected.items()))
    """),
    md("""
    The counts, bytes, memory peaks and losses are deterministic (checked when this notebook is tested;
    communication buffers are given back on the training thread, not whenever gloo's worker lets go of them);
    times are not. Times come later, measured several times, in cells whose output is not compared.
    """),
    code("""
    print(table.format(["name", "all_gathers", "reduce_scatters", "gathered_mib", "reduced_mib",
                        "peak_unsharded_mib", "loss"]))
    """),
    md("""
    ## 3. Reading a timeline

    One row per (rank, lane): compute (forward, backward, optimizer) and comm (all-gathers and
    reduce-scatters). Each comm event carries the unit it serves (`args["module"]`), so the order can be read
    off as text too. In backward, with FSDP2's implicit prefetch, block *i−1*'s all-gather is issued before
    block *i* computes its gradients; without prefetch it waits until block *i* is done and its reduce-scatter
    is issued.
    """),
    code("""
    def sequence(name, phase="backward"):
        # rank 0's comm and compute events of one phase, in start order, as text (lab07.event_sequence)
        return lab07.event_sequence(table.timelines[name], rank=0, phase=phase)

    for name in ["fsdp2 block", "fsdp2 block no-prefetch"]:
        print(f"{name}:\\n  {sequence(name)}\\n")
    """),
    code("""
    fig, axes = plt.subplots(2, 1, figsize=(12.5, 6.6))
    for ax, name in zip(axes, ["fsdp2 block", "fsdp2 block synchronous"]):
        plot_timeline(table.timelines[name], ax=ax, title=f"{name}: overlap {table.row(name)['overlap']:.2f} (this run)",
                      legend_outside=True)
    fig.tight_layout()
    files.savefig(fig, "timeline_async_vs_sync.png", dpi=90, bbox_inches="tight")
    plt.show()
    print(table.format(["name", "overlap", "step_ms"], names=["fsdp2 block", "fsdp2 block synchronous"]))
    """, tags=["nbval-ignore-output"]),
    md("""
    The synchronous run (`fsdp_lab.fsdp2.param_group.set_synchronous(True)`, the `synchronous=True` setting) waits
    for every collective as soon as it is issued: the same collectives, the same bytes, the same loss — and an
    overlap of exactly 0, because nothing runs while a collective is in flight. The figure's titles and the table
    under it come from the same run (the `table` above). The asynchronous overlap is a time, like the step times:
    a collective ends when gloo's worker finishes it, which on a busy machine can be before the main thread
    computes again, so it can come out 0 there; it is shown only in the figure and the table above, whose outputs
    are not compared.
    """),
    code("""
    sync, overlapped = table.row("fsdp2 block synchronous"), table.row("fsdp2 block")
    print("synchronous overlap:", sync["overlap"])
    print("same bytes and loss:", sync["gathered_bytes"] == overlapped["gathered_bytes"], sync["loss"] == overlapped["loss"])
    """),
    md("""
    **On a GPU the overlap comes from elsewhere.** Here gloo runs each collective on CPU threads while the
    main thread computes. On a GPU, FSDP2 issues the all-gathers on their own CUDA streams (copy-in and
    all-gather streams, separate from compute) and the CPU *runs ahead* of the GPU: the next unit's all-gather
    is queued while the GPU is still computing the current one, which is how forward overlaps even with no
    explicit prefetch (PyTorch's `set_modules_to_forward_prefetch` docs: a singleton list of the next module
    "gives the same all-gather overlap behavior as the default overlap behavior, except the prefetched
    all-gather is issued earlier from the CPU"). A CPU run on gloo executes each op when it is issued, so it
    cannot show that; what it shows faithfully is the *order* in which work is issued.

    ## 4. What prefetching buys and what it costs

    FSDP1 has three backward settings: `BACKWARD_PRE` gathers the next unit *before* the current unit's
    gradient computation (most overlap), `BACKWARD_POST` *after* it (before the reduce-scatter), `None` never
    early. `forward_prefetch=True` does the same in forward. FSDP2 prefetches the next unit in backward
    implicitly; `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` make it explicit (the
    `explicit` run prefetches one block ahead in both directions).

    The cost depends on when the next unit is gathered. `BACKWARD_PRE` and FSDP2's prefetch gather it while
    the current unit is still held, so one more unit is gathered at the peak. `BACKWARD_POST` frees the
    current unit as soon as its gradients are computed and only then issues the next all-gather
    (`_post_backward` in `fsdp_lab/fsdp1/runtime.py`): no extra unit at the peak. PyTorch's documentation adds
    that it overlaps less on a GPU, because that all-gather cannot run under the current unit's gradient
    computation; on gloo, where each op runs when it is issued, the overlap (in the explorer's timeline
    titles, section 11) can come out the other way. The order of events shows where each setting gathers:
    """),
    code("""
    for name in ["fsdp1 block pre", "fsdp1 block post", "fsdp1 block none"]:
        print(f"{name}:\\n  {sequence(name)}\\n")
    print("forward, fsdp1 forward_prefetch:\\n ", sequence("fsdp1 block fwd-prefetch", phase="forward"))
    print("forward, fsdp2 explicit:\\n ", sequence("fsdp2 block explicit", phase="forward"))
    """),
    code("""
    lab07.print_prefetch_peaks(table, ["fsdp1 block pre", "fsdp1 block post", "fsdp1 block none", "fsdp2 block",
                                       "fsdp2 block no-prefetch", "fsdp2 block keep-gathered"], root_bytes, block_bytes)
    """),
    md("""
    `BACKWARD_PRE` holds two blocks at its peak (this one and the prefetched next one); `BACKWARD_POST` and
    `None` one each, `BACKWARD_POST` because it frees this block before gathering the next. FSDP2's prefetched
    all-gather lands in its comm buffer (`comm_buffers`) and becomes `unsharded_params` only when waited for,
    so the next block's buffers are held through the whole backward of this one. The last line compares
    `fsdp2 block` with `fsdp2 block no-prefetch`: the comm-buffer column's maximum need not move (without
    prefetch, each block's own all-gather holds the same buffers for a moment, beside the previous block's
    reduce-scatter), but the peak total does, because with prefetch they are held while this block's
    gradients are alive too. The synchronous run above waits for the prefetch at once: two blocks of
    `unsharded_params`. Keeping everything gathered
    (`reshard_after_forward=False`) holds every block but saves one all-gather per block per step.

    ## 5. Exercise: the backward order of each prefetch setting

    Write `backward_order(forward, prefetch)`: `forward` is the list of blocks in the order their forward ran
    (read from the timeline below); return the backward events of those blocks, in order, as `(kind, block)`
    pairs — `("AG", b)` its all-gather, `("bwd", b)` its gradient computation, `("RS", b)` its reduce-scatter
    — for `prefetch` = `"none"`, `"pre"` (FSDP1 `BACKWARD_PRE`, FSDP2's default) or `"post"` (FSDP1
    `BACKWARD_POST`). Backward visits the blocks in reverse; the last forward block's all-gather comes first;
    the next block's all-gather is issued before this block's `bwd` (`pre`), right after it (`post`), or after
    this block's reduce-scatter (`none`). The check compares with the events fsdp_lab's FSDP1 and FSDP2
    recorded in the table's timelines.
    """),
    code("""
    forward = lab07.forward_order(table.timelines["fsdp2 block"])
    print("forward order:", forward)
    """),
    exercise("""
    def backward_order(forward, prefetch):
        ### BEGIN SOLUTION
        order = forward[::-1]
        events = [("AG", order[0])]
        for i, block in enumerate(order):
            following = order[i + 1] if i + 1 < len(order) else None
            if prefetch == "pre" and following:
                events.append(("AG", following))
            events.append(("bwd", block))
            if prefetch == "post" and following:
                events.append(("AG", following))
            events.append(("RS", block))
            if prefetch == "none" and following:
                events.append(("AG", following))
        return events
        ### END SOLUTION
        ### STUB raise NotImplementedError("walk forward[::-1]; place each next block's ('AG', b) per the setting")
    """),
    code("""
    lab07.check_backward_order(backward_order, table)
    """),
    md("""
    ## 6. Wrapping granularity

    Fewer, bigger units mean fewer, bigger collectives — and less to overlap with: with the whole model as one
    unit, the only all-gather comes before any compute and the only reduce-scatter after all of it. That unit
    is also the root, which is not freed after forward (it is needed at once in backward), so nothing is
    gathered again in backward: the whole-model wrapping gathers fewer bytes per step as well (the `AG MiB`
    column).
    """),
    code("""
    print(table.format(["name", "all_gathers", "reduce_scatters", "gathered_mib", "peak_unsharded_mib"],
                       names=["fsdp2 block", "fsdp2 two_blocks", "fsdp2 model", "fsdp2 block keep-gathered"]))
    """),
    md("""
    ## 7. Exercise: collectives and bytes of a wrapping

    Write `collectives_per_step(root_bytes, unit_bytes, reshard_after_forward)`: `root_bytes` is the root
    unit's parameter bytes, `unit_bytes` the list of the other units' bytes (empty when the whole model is one
    unit). Return a dict with `all_gathers`, `reduce_scatters`, `gathered_bytes` (all-gather output sizes
    summed) and `reduced_bytes` (reduce-scatter input sizes summed) of one training step. The check feeds it
    the units of four wrappings and compares with what fsdp_lab's FSDP2 recorded for them (`fsdp2 block`,
    `two_blocks`, `model`, `block keep-gathered`).
    """),
    exercise("""
    def collectives_per_step(root_bytes, unit_bytes, reshard_after_forward):
        ### BEGIN SOLUTION
        gathers = 2 if reshard_after_forward else 1        # again in backward, if freed after forward
        return {"all_gathers": 1 + gathers * len(unit_bytes),  # the root is kept for backward
                "reduce_scatters": 1 + len(unit_bytes),
                "gathered_bytes": root_bytes + gathers * sum(unit_bytes),
                "reduced_bytes": root_bytes + sum(unit_bytes)}
        ### END SOLUTION
        ### STUB raise NotImplementedError("root: 1 all-gather; each unit: 2 (1 if kept gathered); 1 reduce-scatter per unit")
    """),
    code("""
    lab07.check_collectives_per_step(collectives_per_step, table)
    """),
    md("""
    ## 8. Times vary: measure several times

    Everything so far was counted. Times differ from run to run (other processes, the scheduler, gloo's
    threads), so the cells below repeat the timed runs on fresh ranks and show the spread; every sentence that
    depends on a time is printed from those measurements, in cells whose output is not compared when the
    notebook is tested.

    **CPU offload** (sharded parameters, gradients and optimizer step on the host) makes every all-gather
    start with a host-to-device copy and every reduce-scatter end with a device-to-host copy (PyTorch's
    `CPUOffloadPolicy`). On a CPU-only machine the "device" is the host, so those copies cost almost nothing
    here: what the CPU run can show is how the wrapping changes the number of collectives and the time that is
    not hidden under compute.
    """),
    code("""
    REPEATS = 3
    TIMED = ["fsdp2 block", "fsdp2 block synchronous", "fsdp2 block offload", "fsdp2 two_blocks offload",
             "fsdp2 model offload", "fsdp1 block pre", "fsdp2 block for_loop", "fsdp2 block fused",
             "fsdp1 block for_loop", "fsdp1 block fused"]
    # the first table plus fresh runs of the timed configurations; measured(name, key): one value per
    # repeat, key a phase of phase_summary() (ms, mean over ranks) or a row field
    repeats = Repeats([table] + [compare([r for r in RUNS if r["name"] in TIMED], model="cpu", steps=3,
                                         world_size=2, batch_size=4, seq_len=32) for _ in range(REPEATS - 1)])
    measured = repeats.measured

    OFFLOAD = ["fsdp2 block offload", "fsdp2 two_blocks offload", "fsdp2 model offload"]
    print(repeats.phase_table(OFFLOAD))
    fig = repeats.error_bars(OFFLOAD, ["window", "exposed_comm", "idle"], "CPU offload, by wrapping", height=3.2)
    files.savefig(fig, "offload_granularity.png", dpi=90, bbox_inches="tight")
    plt.show()

    lab07.print_offload_verdict(repeats, table, OFFLOAD, whole_model="fsdp2 model offload")
    """, tags=["nbval-ignore-output"]),
    md("""
    Every repeat issued the same collectives and bytes and reached the same loss; the offload runs differ in
    their number of collectives, and the whole-model unit (the root, kept gathered) also gathers fewer bytes.
    """),
    code("""
    print("every repeat: same collectives, bytes and loss as the first run:", lab07.repeats_agree(repeats, table, TIMED))
    print(table.format(["name", "all_gathers", "reduce_scatters", "gathered_mib", "reduced_mib"], names=OFFLOAD))
    """),
    md("""
    On a GPU, per-block units let one block's copies and collectives run under the previous block's compute,
    while a whole-model unit gathers (and holds) everything before any compute: a claim about GPUs, which
    the CPU numbers above neither confirm nor refute. For QLoRA's small NF4 weights coarser groups pay.
    FSDP2 gathers a block's NF4 codes and bf16/fp32 parameters in **one** group (as bytes, lab 05);
    PyTorch's FSDP1 takes one dtype per flat parameter, so FSDP1-QLoRA stores the codes as bf16
    (bitsandbytes' `quant_storage`), and `fsdp_lab`'s FSDP1 makes one flat parameter per dtype (lab 08).

    ## 9. FSDP1 vs FSDP2, as an investigation

    **First attempt (unfair).** FSDP1 on the tied-embedding model with the whole model as one unit, against
    FSDP2 on the untied model with one unit per block. `compare` refuses: the two runs do not train the same
    number of parameters.
    """),
    code("""
    UNFAIR = [dict(name="fsdp1 (tied, whole model)", implementation="fsdp1", wrapping="model", model="cpu-tied"),
              dict(name="fsdp2 (per block)", implementation="fsdp2", wrapping="block")]
    try:
        compare(UNFAIR)
    except ValueError as error:
        print("ValueError:", error)
    """),
    md("""
    Forcing it with `allow_mismatch=True` gives numbers that look like a verdict: FSDP1 issues far fewer
    all-gathers and moves fewer bytes (the table below). None of that is about flat versus per-parameter
    sharding — it is a smaller model and a coarser wrapping.
    """),
    code("""
    unfair = compare(UNFAIR, allow_mismatch=True)
    print(unfair.format(["name", "all_gathers", "reduce_scatters", "gathered_mib", "reduced_mib"]))
    print("parameters:", {r["name"]: r["num_params"] for r in unfair})
    """),
    md("""
    **Fair.** Same model, same data, same seed, same wrapping (one unit per block), each with its default
    prefetch. Now the collectives are identical — the same count and the same bytes — and so is the loss. What
    is left to compare is *where time goes*.
    """),
    code("""
    FAIR = ["fsdp1 block pre", "fsdp2 block"]
    print(table.format(["name", "all_gathers", "reduce_scatters", "gathered_mib", "reduced_mib", "loss"], names=FAIR))
    """),
    code("""
    def comm_order(name):
        return [(e.name, e.args.get("module"), e.bytes) for e in table.timelines[name].comm_events(0)]
    print("rank 0 issued the same collectives, for the same units, with the same bytes, in the same order:",
          comm_order(FAIR[0]) == comm_order(FAIR[1]))
    """),
    md("""
    **Per phase.** Forward, backward, optimizer step, comm that was not hidden (exposed), and idle time, per
    rank and averaged, over the repeated runs. A phase-by-phase table like this is where an implementation's
    remaining gaps show: a slower optimizer step, more exposed communication, idle time.
    """),
    code("""
    print(repeats.phase_table(FAIR))
    fig = repeats.error_bars(FAIR, ["forward", "backward", "optimizer", "exposed_comm"],
                             "FSDP1 vs FSDP2, same model and wrapping", height=2.8)
    files.savefig(fig, "fsdp1_vs_fsdp2_phases.png", dpi=90, bbox_inches="tight")
    plt.show()
    for phase in ["backward", "optimizer", "exposed_comm"]:
        a, b = (measured(n, phase) for n in FAIR)
        print(f"{phase:>13}: fsdp1 {spread(a)} ms, fsdp2 {spread(b)} ms -> " + ("a difference larger than the spread"
              if repeats.apart(*FAIR, phase) else "within the run-to-run spread"))
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 10. The optimizer step: per-tensor dispatch

    FSDP2's parameters are DTensors: every `torch` op on them goes through DTensor's dispatch (sharding
    propagation) before it reaches the local shard. A per-parameter AdamW loop pays that for every op of every
    parameter; `foreach` batches the parameters into a few multi-tensor ops; `fused` does the update in fused
    multi-tensor kernels. fsdp_lab's FSDP1 gives the optimizer the original parameters as plain tensors (views
    into its flat shard, PyTorch's `use_orig_params=True`; with `use_orig_params=False` PyTorch's optimizer
    would see one `FlatParameter` per unit instead). With the original parameters both implementations give
    the optimizer the model's own parameter tensors, as many as the unwrapped model has:
    """),
    code("""
    print("parameter tensors of the unwrapped model:", len(list(model.parameters())))
    names = ["fsdp2 block for_loop", "fsdp2 block", "fsdp2 block fused",
             "fsdp1 block for_loop", "fsdp1 block pre", "fsdp1 block fused"]
    losses = [table.row(n)["loss"] for n in names]
    print("same loss with every optimizer implementation (within 1e-4):", max(losses) - min(losses) < 1e-4)
    """),
    code("""
    LABELS = {"fsdp2 block": "fsdp2 foreach", "fsdp1 block pre": "fsdp1 foreach"}
    lab07.print_optimizer_times(repeats, names, LABELS)
    print()
    lab07.print_optimizer_peaks(repeats, names, LABELS)
    """, tags=["nbval-ignore-output"]),
    md("""
    The printed times say which implementation was fastest in this run and by how much; on FSDP2 the
    per-parameter loop pays DTensor dispatch for every op of every parameter. The peaks are those of each
    run's second step, the first one that repeats: AdamW created its state in the first step, so the state is
    held from the start of this one, through forward and backward. Printed beside each peak is the last phase
    boundary before it. Forward and backward are the same for all three implementations, so a peak that falls
    there cannot tell them apart; what each allocates in `optimizer.step()` (the foreach and fused kernels
    work on many tensors at once) shows in the peak only when the peak falls inside the step. (The line under
    the peaks says whether any of them varied between repeats: communication buffers are given back on the
    training thread, section 2, so the peaks do not depend on when gloo's threads finish.)

    ## 11. Explore: two configurations, one above the other

    Pick any two of the runs above; the widget draws their timelines one above the other and the phase
    breakdown, with the phase table beneath. The static figure is the widget's default pair.
    """),
    code("""
    def render(run_a, run_b):
        return lab07.draw_two_runs(table, run_a, run_b)

    fig, text = render("fsdp1 block pre", "fsdp2 block")
    files.savefig(fig, "explorer_default.png", dpi=90, bbox_inches="tight")
    print(text)
    """, tags=["nbval-ignore-output"]),
    code("""
    choices = [r["name"] for r in table]
    explorer = Explorer({
        "run_a": widgets.Dropdown(options=choices, value="fsdp1 block pre", description="run A"),
        "run_b": widgets.Dropdown(options=choices, value="fsdp2 block", description="run B"),
    }, render, title="Two timelines")
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 12. Exercise: the overlap metric

    Write `overlap_fraction(comm, compute)`: given the (start, end) intervals of one rank's collectives and of
    its compute, in any order, return the fraction of comm time during which some compute was also running. Careful: compute
    spans nest (a block inside the model) and collectives can run concurrently — count each instant once
    (merge each side into a union of intervals first). Return 0.0 without comm. The check compares with
    `Timeline.overlap()` on every timeline of the table.
    """),
    exercise("""
    def overlap_fraction(comm, compute):
        ### BEGIN SOLUTION
        def union(intervals):
            merged = []
            for a, b in sorted(intervals):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            return merged
        comm, compute = union(comm), union(compute)
        total = sum(b - a for a, b in comm)
        hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
        return hidden / total if total > 0 else 0.0
        ### END SOLUTION
        ### STUB raise NotImplementedError("merge each side into a union of intervals; hidden comm time / comm time")
    """),
    code("""
    lab07.check_overlap_fraction(overlap_fraction, table)
    """),
    md("""
    ## Summary

    * A timeline's comm events, labelled with their unit, show the order of all-gathers and reduce-scatters;
      their number and bytes follow from the wrapping (all-gathers: root 1, 2 per resharding unit, 1 per
      unit kept gathered; 1 reduce-scatter per unit).
    * Prefetching moves an all-gather earlier so it can run under compute. `BACKWARD_PRE` and FSDP2's prefetch
      pay with one more unit gathered at the peak; `BACKWARD_POST` frees the current unit first, so it costs
      no extra unit (on GPUs, PyTorch's documentation says, it overlaps less). A synchronous run has the same
      collectives and an overlap of exactly 0. On GPUs, FSDP2's forward overlap comes from the CPU running
      ahead onto separate streams.
    * Coarser wrapping: fewer, bigger collectives and less to hide them under; the whole model as one unit is
      the root, kept gathered for backward, so it gathers fewer bytes too. On CPU, the repeated measurements
      above say which won here.
    * Compare implementations only on the same model, data, seed and wrapping — `compare` refuses anything
      else unless told to — then look phase by phase, over repeated runs, and call a difference real only when
      it is larger than the spread.

    Read next: `docs/overlap.md`, `fsdp_lab/compare.py`, and `fsdp_lab/fsdp2/fully_shard.py` (prefetch).
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
