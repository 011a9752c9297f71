"""Lab 09: slaying OOMs — automatic microbatching without FSDP deadlocks, thrashing, offload, checklist."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, exercise, md  # noqa: E402

CELLS = [
    md("""
    # Lab 09 — Slaying OOMs without deadlocks

    **Goals.**

    1. See where an out-of-memory error on *one* rank deadlocks FSDP (Composer's four sync points, and the
       ones this package adds), watch a run hang without sync hooks and recover with them — from an OOM at
       a sync point and from one in the middle of an allocation in forward and in backward.
    2. Follow the agreement protocol ("someone ran out" and "everyone is done") on a timeline.
    3. Let `AutoMicrobatch` find the largest microbatch that fits an (emulated) memory budget.
    4. Know what thrashing is and how it is caught, on the emulated allocator's own retry count.
    5. Measure the slaying-OOMs checklist: shard, offload, checkpoint, microbatch, LoRA, quantize.
    6. Write the agreement all-reduce and the microbatch step-down rule yourself.
    """),
    code("""
    %matplotlib inline
    import functools, os, time
    from contextlib import nullcontext
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    fsdp_lab.start_fork_server()   # launch forks ranks from it; it loads torch now, while the cells run
    from fsdp_lab import collectives
    from fsdp_lab.automicrobatch import AutoMicrobatch
    from fsdp_lab.oom import memory_budget, inject_oom
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz.widgets import Explorer
    from fsdp_lab.workshop import lab09, lab_files

    files = lab_files("09_slaying_ooms")   # labs/figures/09_slaying_ooms in the lab build, else labs/my_figures/09_slaying_ooms
    MiB = 2**20
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: an emulated device

    On a GPU the caching allocator raises `torch.OutOfMemoryError` when it cannot find memory. On a laptop
    there is no such limit, so `fsdp_lab.oom.memory_budget(nbytes, rank=...)` emulates one: a `MemoryTracker`
    counts every storage allocated, and the allocation that would pass the budget raises the **same exception
    type**. Ranks not named only track, which makes *asymmetric* OOMs possible.
    """),
    code("""
    try:
        with memory_budget(4 * MiB) as tracker:
            a = torch.zeros(MiB // 4)          # 1 MiB of float32: fits
            b = torch.zeros(4 * MiB // 4)      # 4 more MiB: does not
    except torch.OutOfMemoryError as error:
        print(type(error).__name__, "is torch.cuda.OutOfMemoryError:", torch.OutOfMemoryError is torch.cuda.OutOfMemoryError)
        print(error)
    """),
    md("""
    ## 2. Where one rank's OOM deadlocks FSDP

    FSDP's collectives need **every** rank. If rank 1 runs out of memory and rank 0 does not, rank 0 walks
    into the next collective and waits for rank 1 forever. Composer (PR #3510, "Remove OOM-Driven FSDP
    Deadlocks") found four such places in PyTorch's FSDP1 and puts a sync before each:

    | Composer's sync point (FSDP1) | what comes next on the healthy rank |
    |---|---|
    | forward pre-hook of every FSDP unit | the unit's forward **all-gather** |
    | full backward pre-hook of every FSDP unit | the unit's backward **all-gather** |
    | full backward hook of every non-FSDP submodule | the **prefetch all-gather** FSDP1 issues from its post-backward reshard |
    | inside `FlatParamHandle.unshard`, after the unsharded storage is re-allocated (which can itself OOM) | the unit's **all-gather** into that storage |

    Composer also checks after each microbatch's forward and agrees once more after the optimizer step. It has
    no sync before the reduce-scatter (a to-do in its code). This package names its points in
    `fsdp_lab.sync_points`, and its FSDP1 and FSDP2 both fire them (`sync_points.fire(point, module)`):
    `pre_forward`, `pre_backward`, `post_backward`, and right before every `all_gather` (after the gathered
    storage is allocated, Composer's fourth point) and every `reduce_scatter` (the point Composer lacks).
    `AutoMicrobatch.train_step` fires one more, `optimizer_step`, after the last microbatch's backward and
    before the optimizer step. The sync hook runs at `all_gather`, `reduce_scatter` and `optimizer_step`.

    First without sync hooks: rank 1 fails at its second `pre_backward` and goes to agree on a retry, while
    rank 0 is already inside the backward all-gather. `launch` sees both ranks waiting in collectives that
    differ, ends the hang and names each rank's last collective.
    """),
    code("""
    B, SEQ = 8, 32      # samples per rank per step, sequence length
    CONFIG = LlamaConfig.from_name("cpu", n_layers=2)

    def sharded_llama(offload=False, impl="fsdp2", n_layers=CONFIG.n_layers):
        model = Llama(LlamaConfig.from_name("cpu", n_layers=n_layers), seed=0)
        if impl == "fsdp1":
            from fsdp_lab.fsdp1 import CPUOffload, FullyShardedDataParallel, ModuleWrapPolicy
            from fsdp_lab.models.llama import TransformerBlock
            model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                             cpu_offload=CPUOffload(offload_params=offload))
        else:
            from fsdp_lab.fsdp2 import fully_shard, CPUOffloadPolicy, OffloadPolicy
            policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
            for layer in model.layers:
                fully_shard(layer, offload_policy=policy)
            fully_shard(model, offload_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def rank_batch(step, seq=SEQ):
        import torch.distributed as dist
        r, w = dist.get_rank(), dist.get_world_size()
        return shard_batch(global_batch(CONFIG.vocab_size, B * w, seq, step=step), r, w)

    def without_hooks():
        model, opt = sharded_llama()
        amb = AutoMicrobatch(model, opt, B)
        amb.remove_hooks()                     # what a trainer without sync hooks does
        inject_oom("pre_backward", rank=1, skip=1)
        amb.train_step(rank_batch(0))

    try:
        fsdp_lab.launch(without_hooks, world_size=2, timeout=60)   # a backstop: the deadlock is seen once both ranks wait
    except fsdp_lab.LaunchTimeout as error:
        print(type(error).__name__, "- the collective each rank waits in:")
        for rank, last in enumerate(error.last_collectives):
            print(f"  rank {rank}: {last}")
    """),
    md("""
    Now with sync hooks (the default while `AutoMicrobatch` is unsettled). Composer's hook runs a **pair** of
    one-element all-reduces: MAX of "I ran out", then MIN of "I am done with the batch" (0 from a rank still
    inside it). This package sends both flags in **one** two-element MAX all-reduce, `[oom, not_done]`, since
    MIN(done) = 1 − MAX(not done). The healthy rank learns of the failure there and raises `PeerOutOfMemoryError`
    instead of entering the all-gather; both ranks clean up FSDP state (`FSDPModule.recover_from_error()`: free
    gathered parameters, drop partial gradients), step the microbatch down and retry the same data.

    We make rank 1 fail at the points where `inject_oom` aims in `CASES` below (`pre_forward`, `pre_backward`,
    `post_backward` and `optimizer_step`), then in the middle of an allocation in forward and in backward
    (`memory_budget(..., fail_at=(phase, n))`, the n-th allocation of that phase, as the table names it: a
    real `torch.OutOfMemoryError` raised by the emulated allocator, away from any sync point), all in one
    launch. The `optimizer_step` point fires *before* the step, so its OOM is retried like the others; an OOM
    inside `optimizer.step()` itself raises `OptimizerStepOOMError` (on every rank while the sync hooks are
    on, on the failing rank alone once they are off) and is not retried: the step's memory does not depend on
    the microbatch size.
    """),
    code("""
    LEAK_CATEGORIES = ("unsharded_params", "comm_buffers", "unsharded_grads", "activations", "sharded_grads")

    CASES = [("pre_forward", 1, None), ("pre_backward", 1, None), ("post_backward", 1, None),
             ("optimizer_step", 0, None), ("allocation", 0, ("forward", 5)), ("allocation", 0, ("backward", 5))]

    def recover_at_each_point():
        rows, timeline, marks = [], None, {}
        for point, skip, fail_at in CASES:
            model, opt = sharded_llama()
            with memory_budget(None, rank=1, model=model, optimizer=opt, fail_at=fail_at) as tracker, \
                    Timeline() as tl:
                tl.attach(model)                       # compute lanes: each block's forward and backward
                amb = AutoMicrobatch(model, opt, B)
                handle = inject_oom(point, rank=1, skip=skip) if fail_at is None else None
                # for the figure: the clock times of rank 1's OOM and of the retry
                with lab09.clock_marks(amb, point, skip, marks) if point == "pre_backward" else nullcontext():
                    result = amb.train_step(rank_batch(0))
                if handle is not None:
                    handle.remove()
                amb.close()
            if point == "pre_backward":
                timeline = tl
            where = point if fail_at is None else f"allocation {fail_at[1]} in {fail_at[0]}"
            leaked = sum(tracker.current()[c] for c in LEAK_CATEGORIES)
            rows.append((where, result.microbatch_size, result.retries, leaked))
        return {"rows": rows, "timeline": timeline, "marks": marks}

    recovered = fsdp_lab.launch(recover_at_each_point, world_size=2, timeout=180)
    lab09.print_recovery_table(recovered[0]["rows"], recovered[1]["rows"])
    """),
    md("""
    The table above is this run's: in every case both ranks end on the same microbatch, and no gathered
    parameter or communication buffer is still held after the step (leaked bytes: what `LEAK_CATEGORIES` still
    hold then; gradients cannot show up there, as `zero_grad(set_to_none=True)` runs after every step). An OOM
    in the middle of an allocation is caught by the same agreement as one at a sync point: the failing rank
    leaves the batch, the healthy one meets its flag at its next sync.

    Without hooks rank 0 sits in FSDP's all-gather while rank 1 waits in the agreement's all-reduce
    (`oom_sync`, on this package's own gloo group). In Composer both run on the one default communicator, so
    there the mismatch is an all-reduce facing an all-gather; either way neither rank can go on, and on a real
    cluster only the collective timeout (NCCL's watchdog) ends it.

    ## 3. The agreement protocol on a timeline

    The OOM flags travel on a gloo group of their own (`fsdp_lab.oom.flag_group()`), so a rank waiting on a
    flag can never swallow another rank's all-gather. Below: rank 1 fails at its second `pre_backward` (red
    line), both agree, recover and retry with a smaller microbatch (green line). Each `oom_sync` is one
    two-element all-reduce: a sync hook's (before every all-gather, reduce-scatter and the optimizer step) or
    a round of `agree()` after each try at the batch; after the optimizer step the one-element `oom_flag`
    agrees whether the step itself ran out (counts and sizes below).
    """),
    code("""
    merged = Timeline.merge([r["timeline"] for r in recovered])
    for rank in (0, 1):
        events = sorted(merged.comm_events(rank), key=lambda e: e.t_start)
        names = [e.name for e in events]
        sizes = {n: "/".join(map(str, sorted({e.bytes for e in events if e.name == n}))) for n in ("oom_sync", "oom_flag")}
        print(f"rank {rank}: {len(events)} collectives;", ", ".join(f"{names.count(n)} {n} ({b} B each)" for n, b in sizes.items()))
        print(f"   first ones: {names[:6]}; last ones: {names[-3:]}")
    fig = lab09.plot_agreement_timeline(merged, recovered[1]["marks"]["oom"], recovered[0]["marks"]["retry"])
    files.savefig(fig, "agreement_timeline.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    ## 4. Automatic microbatch search on a budget

    One process is enough to see the search. We measure the peak of a training step (AdamW) for every
    microbatch size, model depth and sequence length, then let `AutoMicrobatch` search under a budget: it
    starts at the whole batch (`B`) and steps down to the largest divisor of `B` at most half the failed size
    (this package's rule; Composer simply halves, which is the same for a power of two).

    Which step? AdamW creates its state (two tensors the size of each parameter) inside the first `step()`, so
    during the first forward and backward that state does not exist yet; from the second step on it does. A
    budget that holds the first step can fail the second, so `step_peak` runs one step first and measures the
    next one, the step that repeats for the rest of training.
    """),
    code("""
    # step_peak(n_layers, seq, microbatch, ...): (peak bytes, {category: bytes at the peak}) of a step after the first
    step_peak = functools.partial(lab09.step_peak, B)
    GRID = {(n, s, m): step_peak(n, s, m)[0] for n in (2, 4) for s in (32, 64, 128) for m in (1, 2, 4, 8)}
    lab09.print_step_peaks(GRID, B)
    first_total, first = step_peak(2, 32, 8, first_step=True)
    later_total, later = step_peak(2, 32, 8)
    print(f"2 layers, seq 32, microbatch 8: first step {first_total / MiB:.2f} MiB, every later step "
          f"{later_total / MiB:.2f} MiB; AdamW state at the peak: {first['optimizer_state'] / MiB:.2f} "
          f"then {later['optimizer_state'] / MiB:.2f} MiB")
    """),
    code("""
    def predicted_microbatch(budget, n_layers, seq):
        size = B
        while size >= 1:
            if GRID[n_layers, seq, size] <= budget:
                return size
            size = max((d for d in range(1, size // 2 + 1) if B % d == 0), default=0)
        return None

    # halfway between the first step's peak and a later step's, both at microbatch 4
    first_at_4, later_at_4 = step_peak(4, 128, 4, first_step=True)[0], GRID[4, 128, 4]
    budget = int((first_at_4 + later_at_4) / 2)
    model = Llama(LlamaConfig.from_name("cpu", n_layers=4), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amb = AutoMicrobatch(model, opt, B)
    print(f"budget {budget / MiB:.2f} MiB; predicted from the table: microbatch {predicted_microbatch(budget, 4, 128)}")
    with memory_budget(budget, model=model, optimizer=opt) as tracker:
        for step in range(3):
            tried_before, failures_before = len(amb.tried), tracker.failures
            result = amb.train_step(global_batch(CONFIG.vocab_size, B, 128, step=step))
            print(f"step {step + 1}: tried {amb.tried[tried_before:]}, chose {result.microbatch_size}, "
                  f"OOMs raised: {tracker.failures - failures_before}")
    print(f"at microbatch 4 the first step peaks at {first_at_4 / MiB:.2f} MiB, a later one at {later_at_4 / MiB:.2f} MiB; "
          f"within the budget: first {first_at_4 <= budget}, later {later_at_4 <= budget}")
    """),
    md("""
    The budget sits between the two peaks of the last line, so the first step fits at a microbatch the table
    rules out: it runs before AdamW's state exists. The second step holds that state, runs out of memory at
    the same size, and steps down again, to the size the table predicted; from then on each step fits at the
    first try. On a GPU this is the run that trains one step and dies on the second: size a budget for the
    step that repeats, not the first one.
    """),
    code("""
    def render(budget_mib, n_layers, seq_len):
        chosen = predicted_microbatch(budget_mib * MiB, n_layers, seq_len)
        return lab09.plot_microbatch_search(GRID, B, budget_mib, n_layers, seq_len, chosen)

    fig, text = render(round(budget / MiB, 1), 4, 128)
    print(text)
    files.savefig(fig, "microbatch_search.png", dpi=90, bbox_inches="tight")
    """),
    code("""
    explorer = Explorer({
        "budget_mib": widgets.FloatSlider(value=round(budget / MiB, 1), min=5, max=70, step=0.5, description="budget MiB"),
        "n_layers": widgets.Dropdown(options=[2, 4], value=4, description="layers"),
        "seq_len": widgets.Dropdown(options=[32, 64, 128], value=128, description="seq len"),
    }, render, title="AutoMicrobatch: which microbatch fits?")
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 5. Thrashing

    On a GPU, a step that *almost* does not fit does not always fail. When PyTorch's caching allocator finds
    no free cached block and `cudaMalloc` fails, it frees its cached blocks and calls `cudaMalloc` again;
    `torch.cuda.memory_stats()["num_alloc_retries"]` counts those failed calls that ended in a cache flush and
    retry. Each one synchronizes the device and empties the cache — steps get slow. Like Composer,
    `AutoMicrobatch` compares that count after each step with the one before; retries growing in
    **`THRASHING_STREAK` consecutive steps** (printed below) count as an OOM: the microbatch steps down for
    the next step and the sync hooks come back. The streak is counted differently: Composer MAX-reduces a
    per-batch flag "some rank's count grew" and counts consecutive batches with it set (the growth may come
    from different ranks); this package counts each rank's own streak and MAX-reduces "my streak reached
    `THRASHING_STREAK`". (Composer also re-runs the same batch with the smaller microbatch; this package steps
    down for the next one.)

    Here the emulated allocator does the counting: `memory_budget(None, retry_above=...)` adds a retry each
    time an allocation takes the tracked total past a line, and `AutoMicrobatch` reads that count where it
    would read `num_alloc_retries`. The line sits between the peaks of a later step at microbatch 4 and 8
    measured in section 4; the output shows the count after each step and the microbatch each step used.
    Inside `AutoMicrobatch` the first step stays under the line (AdamW's state does not exist yet); from the
    second step on, the whole batch crosses it, the count grows `THRASHING_STREAK` steps in a row, and the
    rule steps down to the next divisor (microbatch per step, printed), where the count stops growing:
    """),
    code("""
    import fsdp_lab.automicrobatch as automicrobatch_module
    line = int((GRID[2, 32, 4] + GRID[2, 32, 8]) / 2)
    model = Llama(CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amb = AutoMicrobatch(model, opt, B)
    original = automicrobatch_module._alloc_retries
    retries_seen = []
    with memory_budget(None, model=model, optimizer=opt, retry_above=line) as tracker:
        automicrobatch_module._alloc_retries = lambda device: tracker.alloc_retries
        try:
            sizes = []
            for s in range(5):
                sizes.append(amb.train_step(global_batch(CONFIG.vocab_size, B, SEQ, step=s)).microbatch_size)
                retries_seen.append(tracker.alloc_retries)
        finally:
            automicrobatch_module._alloc_retries = original
    print(f"retry line {line / MiB:.2f} MiB (peak of a step: microbatch 4 {GRID[2, 32, 4] / MiB:.2f}, "
          f"8 {GRID[2, 32, 8] / MiB:.2f} MiB)")
    print(f"rule: retries growing in {automicrobatch_module.THRASHING_STREAK} consecutive steps count as an OOM; "
          f"sync hooks go after {amb.stable_steps} clean steps")
    print("microbatch per step:", sizes, "| emulated retries after each step:", retries_seen)
    print("events:", [h["event"] for h in amb.history])
    """),
    md("""
    ## 6. CPU offload of the optimizer step

    `CPUOffloadPolicy` (FSDP2) and `CPUOffload(offload_params=True)` (FSDP1) keep sharded parameters, their
    gradients and the optimizer state in host memory; the optimizer step runs on the CPU and every all-gather
    copies the shard up first. On a GPU that saves those three categories of device memory and costs
    host-device copies and a slower step. On this CPU machine both "devices" are the same memory, so the
    breakdown below shows *which categories move to the host*; the saving on a GPU is their sum. The model
    here is one where the states are the point: many layers and short sequences (the first line of the
    output). The last lines split the device peak of the offloaded step: the host categories' bytes *at that
    moment* are what offload took off the device then. (Step times are in an ignored cell.)
    """),
    code("""
    HOST = ("sharded_params", "sharded_grads", "optimizer_state")
    STATE_LAYERS, STATE_SEQ = 8, 8   # a model whose parameters, gradients and AdamW state dominate

    def offload_compare():
        out = {}
        for impl in ("fsdp2", "fsdp1"):
            for offload in (False, True):
                model, opt = sharded_llama(offload, impl, STATE_LAYERS)
                amb = AutoMicrobatch(model, opt, B)
                amb.train_step(rank_batch(0, STATE_SEQ))
                start = time.perf_counter()
                with MemoryTracker(model, opt) as tracker:
                    amb.train_step(rank_batch(1, STATE_SEQ))
                amb.close()
                out[impl, offload] = {"peak": tracker.peak(), "total": tracker.peak_total(),
                                      "seconds": time.perf_counter() - start}
        return out

    offload_runs = fsdp_lab.launch(offload_compare, world_size=2, timeout=180)[0]
    offload = {flag: offload_runs["fsdp2", flag] for flag in (False, True)}  # FSDP2's, for the checklist
    print(f"model: {STATE_LAYERS} layers; each rank {B} sequences of {STATE_SEQ} tokens")
    lab09.print_offload_breakdown(offload_runs, HOST)   # ends with each implementation's device part
    device_with = lab09.device_part(offload[True], HOST)   # the peak less what sat on the host at that moment
    """),
    md("""
    Both implementations move the same three categories to the host, and the table reads each one's true
    storage: FSDP1's sharded flat parameter, its flat gradient and AdamW's state, FSDP2's per-parameter shards
    and their state. What stays on the device is what a step creates — gathered parameters, communication
    buffers, unsharded gradients, activations and temporaries — and that differs between FSDP1 (one flat
    buffer per unit) and FSDP2 (per-parameter copy-in/copy-out buffers).
    """),
    code("""
    for impl in ("fsdp2", "fsdp1"):
        print(f"{impl}: step time without offload {offload_runs[impl, False]['seconds']:.3f} s, "
              f"with offload {offload_runs[impl, True]['seconds']:.3f} s")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 7. Activation checkpointing vs microbatching, and the checklist

    Both cut activation memory. Checkpointing keeps only each block's input and recomputes the block in
    backward (about one extra forward); microbatching keeps the whole step's math but runs it in pieces (more,
    smaller kernels; same number of FLOPs). Each item of the slaying-OOMs checklist attacks one kind of
    memory, so each is measured where that kind dominates (peak bytes per rank of an AdamW step after the
    first, as in section 6): the state items on section 6's model, the activation items on a shallow model
    with long sequences (each group's title names its layers and sequence length).
    """),
    code("""
    SEQ_LONG = 128
    state_base = step_peak(STATE_LAYERS, STATE_SEQ, 8)[0]
    act_base = step_peak(2, SEQ_LONG, 8)[0]
    groups = {
        f"states dominate ({STATE_LAYERS} layers, seq {STATE_SEQ})": (state_base, [
            ("baseline, one process", state_base),
            ("FSDP2 on 2 ranks (section 6, rank 0)", offload[False]["total"]),
            ("FSDP2 + CPU offload (device part)", device_with),
            ("LoRA (rank 8, base frozen)", step_peak(STATE_LAYERS, STATE_SEQ, 8, lora="lora")[0]),
            ("QLoRA (NF4 base + LoRA)", step_peak(STATE_LAYERS, STATE_SEQ, 8, lora="qlora")[0])]),
        f"activations dominate (2 layers, seq {SEQ_LONG})": (act_base, [
            ("baseline, one process", act_base),
            ("microbatch 2 (AutoMicrobatch-style)", step_peak(2, SEQ_LONG, 2)[0]),
            ("activation checkpointing", step_peak(2, SEQ_LONG, 8, checkpoint=True)[0])]),
    }
    fig = lab09.plot_checklist(groups)
    files.savefig(fig, "checklist.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    Where the states dominate, sharding over 2 ranks alone brings the per-rank peak down (this run: the FSDP2
    row over its baseline is printed above; FSDP adds gathered parameters and communication buffers on top of
    the halved states), offload moves the sharded states off the device, and LoRA/QLoRA drop the frozen base's
    gradients and optimizer state. Where activations dominate, the group runs the two items aimed at them;
    sharding, offload and LoRA would cut only the states' part of that peak, not the activations. Percentages
    are against each group's own baseline: QLoRA and offload cut most where states dominate, microbatch 2 more
    than checkpointing where activations do. Which kind dominates decides the order of attack. On a 7B model
    at typical sequence lengths the states dominate (weights, gradients and two AdamW moments for every
    parameter): shard first, then offload the states or use QLoRA, and checkpoint or microbatch when the
    activations still do not fit — letting `AutoMicrobatch` pick the microbatch on every rank at once.

    ## 8. Exercise: the agreement that decides the retry on every rank

    Write `agreement(oom, not_done)`, run on every rank: `oom` is 1 if this rank ran out of memory, `not_done`
    1 if it is still inside the batch. Return `(someone_oomed, all_done)`, the same on every rank, using
    **one** `collectives.all_reduce` (it takes `op="max"`) of a two-element int32 tensor. The check runs it on
    2 ranks for every combination of flags (the check prints how many) and compares with the formula and with
    `fsdp_lab.oom`.
    """),
    exercise("""
    def agreement(oom, not_done):
        ### BEGIN SOLUTION
        flags = torch.tensor([oom, not_done], dtype=torch.int32)
        collectives.all_reduce(flags, op="max")      # MAX(oom), MAX(not done)
        return int(flags[0]), 1 - int(flags[1])      # MIN(done) = 1 - MAX(not done)
        ### END SOLUTION
        ### STUB raise NotImplementedError("all-reduce [oom, not_done] with op='max'; return (t[0], 1 - t[1])")
    """),
    code("""
    lab09.check_agreement(agreement)
    """),
    md("""
    ## 9. Exercise: the step-down rule

    After an OOM every rank must pick the same smaller microbatch, and it must divide the batch (each
    microbatch's loss is weighted by its share). Composer simply halves (`max(size // 2, 1)`); this package
    takes the largest divisor of the batch at most half the failed size. Write `next_microbatch(batch_size,
    failed, min_size)`: the largest divisor of `batch_size` that is at most half of `failed` and at least
    `min_size`, or `None` when there is none. The check compares it with `AutoMicrobatch`'s rule for every
    small batch size (the check prints the range).
    """),
    exercise("""
    def next_microbatch(batch_size, failed, min_size=1):
        ### BEGIN SOLUTION
        for size in range(failed // 2, min_size - 1, -1):
            if batch_size % size == 0:
                return size
        return None
        ### END SOLUTION
        ### STUB raise NotImplementedError("count down from failed // 2 to min_size; return the first divisor of batch_size")
    """),
    code("""
    lab09.check_next_microbatch(next_microbatch)
    """),
    md("""
    ## Summary

    * One rank's OOM deadlocks FSDP at the next collective. Composer syncs before each FSDP1 unit's forward
      all-gather, its backward all-gather, the post-backward prefetch all-gather, and inside FSDP1's unshard
      after the storage is re-allocated; this package's FSDP1 and FSDP2 add a sync before each reduce-scatter,
      and `AutoMicrobatch.train_step` one before the optimizer step.
    * Sync hooks + an agreement ("someone ran out", "everyone is done") on a separate group turn that into a
      clean, shared retry — whether the OOM came at a sync point or mid-allocation in forward or backward:
      recover FSDP state, step the microbatch down, rerun the same data.
    * Composer's hook is a pair of one-element all-reduces (MAX, then MIN); this package's is one two-element
      MAX. Hooks go after `stable_steps` clean steps and come back after an OOM, an eval or thrashing
      (allocator retries growing `THRASHING_STREAK` steps in a row; both printed in section 5).
    * The checklist, measured: shard and offload attack states, checkpointing and microbatching attack
      activations, LoRA/QLoRA attack gradients, optimizer state and weights.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
