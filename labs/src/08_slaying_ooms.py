"""Lab 08: slaying OOMs — automatic microbatching without FSDP deadlocks, thrashing, offload, checklist."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nbbuild import build, code, md  # noqa: E402

CELLS = [
    md("""
    # Lab 08 — Slaying OOMs without deadlocks

    **Goals.**

    1. See the four places where an out-of-memory error on *one* rank deadlocks FSDP, and watch a
       run hang without sync hooks and recover with them.
    2. Follow the agreement protocol (MAX of "I ran out", MIN of "I am done") on a timeline.
    3. Let `AutoMicrobatch` find the largest microbatch that fits an (emulated) memory budget.
    4. Know what thrashing is and how it is caught.
    5. Measure the slaying-OOMs checklist on one model: shard, offload, checkpoint, microbatch, LoRA, quantize.
    6. Write the microbatch step-down rule yourself.
    """),
    code("""
    %matplotlib inline
    import os, time
    import torch
    import matplotlib.pyplot as plt
    import ipywidgets as widgets
    import fsdp_lab
    from fsdp_lab import sync_points
    from fsdp_lab.automicrobatch import AutoMicrobatch, split_batch
    from fsdp_lab.oom import memory_budget, inject_oom
    from fsdp_lab.memory.tracker import MemoryTracker
    from fsdp_lab.models.data import global_batch, shard_batch
    from fsdp_lab.models.llama import Llama, LlamaConfig, apply_activation_checkpointing
    from fsdp_lab.timeline import Timeline
    from fsdp_lab.viz import plot_timeline
    from fsdp_lab.viz.widgets import Explorer

    FIGURES = "figures/08_slaying_ooms"
    os.makedirs(FIGURES, exist_ok=True)
    MiB = 2**20
    print(f"torch {torch.__version__} | device: {fsdp_lab.current_device()} | cores: {os.cpu_count()}")
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 1. The idea on one process: an emulated device

    On a GPU the caching allocator raises `torch.OutOfMemoryError` when it cannot find memory. On a laptop
    there is no such limit, so `fsdp_lab.oom.memory_budget(nbytes, rank=...)` emulates one: a
    `MemoryTracker` counts every storage allocated, and the allocation that would pass the budget raises
    the **same exception type**. Ranks not named only track, which makes *asymmetric* OOMs possible.
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
    ## 2. Four places where one rank's OOM deadlocks FSDP

    FSDP's collectives need **every** rank. If rank 1 runs out of memory and rank 0 does not, rank 0 walks
    into the next collective and waits for rank 1 forever. Those collectives sit at four places in a step,
    and `fsdp_lab.sync_points` names them (FSDP2 calls `sync_points.fire(point, module)` there):

    | point | what comes next on the healthy rank |
    |---|---|
    | `pre_forward` | the unit's forward **all-gather** |
    | `pre_backward` | the unit's backward **all-gather** (and the prefetch of the next one) |
    | `post_backward` | the unit's gradient **reduce-scatter** |
    | `optimizer_step` | the next step's first all-gather (the step itself has no collective) |

    First without sync hooks: rank 1 fails at its second `pre_backward` and goes to agree on a retry,
    while rank 0 is already inside the backward all-gather. `launch(..., timeout=...)` ends the hang and
    names each rank's last collective.
    """),
    code("""
    B, SEQ = 8, 32      # samples per rank per step, sequence length
    CONFIG = LlamaConfig.from_name("cpu", n_layers=2)

    def sharded_llama(offload=False, impl="fsdp2"):
        model = Llama(CONFIG, seed=0)
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
        fsdp_lab.launch(without_hooks, world_size=2, timeout=15)
    except fsdp_lab.LaunchTimeout as error:
        print(type(error).__name__, "- last collective each rank entered:")
        for rank, last in enumerate(error.last_collectives):
            print(f"  rank {rank}: {last}")
    """),
    md("""
    Now with sync hooks (the default while `AutoMicrobatch` is unsettled): before every FSDP collective each
    rank runs the pair of one-element all-reduces. The healthy rank learns of the failure there and raises
    `PeerOutOfMemoryError` instead of entering the all-gather; both ranks clean up FSDP state
    (`FSDPModule.recover_from_error()`: free gathered parameters, drop partial gradients), halve the microbatch
    and retry the same data. We inject the OOM at each of the four points in turn, in one launch.
    """),
    code("""
    LEAK_CATEGORIES = ("unsharded_params", "comm_buffers", "unsharded_grads", "activations", "sharded_grads")

    def recover_at_each_point():
        import gc, torch.distributed as dist
        rows, timeline = [], None
        for point, skip in [("pre_forward", 1), ("pre_backward", 1), ("post_backward", 1), ("optimizer_step", 0)]:
            gc.collect()
            model, opt = sharded_llama()
            with memory_budget(None, model=model, optimizer=opt) as tracker, Timeline() as tl:
                amb = AutoMicrobatch(model, opt, B)
                handle = inject_oom(point, rank=1, skip=skip)
                result = amb.train_step(rank_batch(0))
                handle.remove()
                amb.close()
            if point == "pre_backward":
                timeline = tl
            leaked = sum(tracker.current()[c] for c in LEAK_CATEGORIES)
            rows.append((point, result.microbatch_size, result.retries, leaked))
        return {"rows": rows, "timeline": timeline}

    recovered = fsdp_lab.launch(recover_at_each_point, world_size=2, timeout=120)
    print(f"{'OOM on rank 1 at':<16}{'microbatch r0':>14}{'microbatch r1':>14}{'retries':>8}{'leaked bytes r0/r1':>20}")
    for row0, row1 in zip(recovered[0]["rows"], recovered[1]["rows"]):
        print(f"{row0[0]:<16}{row0[1]:>14}{row1[1]:>14}{row0[2]:>8}{f'{row0[3]}/{row1[3]}':>20}")
    """),
    md("""
    Every case finishes, both ranks agree on microbatch 4, and no gathered parameter, buffer or partial
    gradient survives the recovery: the tracker is back to the sharded baseline.

    Without hooks rank 0 sits in FSDP's all-gather while rank 1 waits in the agreement's all-reduce
    (`oom_sync`, on its own process group): neither can finish, and only the timeout ends it.

    ## 3. The agreement protocol on a timeline

    The OOM flags travel on a gloo group of their own (`fsdp_lab.oom.flag_group()`), so a rank waiting on a
    flag can never swallow another rank's all-gather. Below: rank 1 fails at `pre_backward`; count the
    `oom_sync` all-reduces on each rank — rank 0 did one pair in its sync hook, then both did the pairs of
    `agree()` until the MIN of "done" was 1.
    """),
    code("""
    merged = Timeline.merge([r["timeline"] for r in recovered])
    for rank in (0, 1):
        events = sorted(merged.comm_events(rank), key=lambda e: e.t_start)
        names = [e.name for e in events]
        first = names.index("oom_sync")
        print(f"rank {rank}: {len(events)} collectives, {names.count('oom_sync')} oom_sync all-reduces; "
              f"first ones: {names[:6]}")
    fig, ax = plt.subplots(figsize=(11, 3))
    plot_timeline(merged, ax=ax, title="rank 1 runs out of memory at pre_backward; both agree, halve, retry")
    fig.savefig(f"{FIGURES}/agreement_timeline.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    ## 4. Automatic microbatch search on a budget

    One process is enough to see the search. We measure the peak of one training step (AdamW) for every
    microbatch size, model depth and sequence length, then let `AutoMicrobatch` search under a budget:
    it starts at the whole batch (8) and steps down to the largest divisor of 8 at most half the failed size.
    """),
    code("""
    def step_peak(n_layers, seq, microbatch, checkpoint=False, lora=None):
        model = Llama(LlamaConfig.from_name("cpu", n_layers=n_layers), seed=0)
        if checkpoint:
            apply_activation_checkpointing(model)
        if lora is not None:
            from fsdp_lab.qlora.lora import apply_lora
            apply_lora(model, rank=8, quantize_base=lora == "qlora")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        batch = global_batch(CONFIG.vocab_size, B, seq, step=0)
        with MemoryTracker(model, opt) as tracker:
            for begin in range(0, B, microbatch):
                (model(split_batch(batch, begin, begin + microbatch)).loss * (microbatch / B)).backward()
            opt.step()
        return tracker.peak_total(), tracker.peak()

    GRID = {(n, s, m): step_peak(n, s, m)[0] for n in (2, 4) for s in (32, 64, 128) for m in (1, 2, 4, 8)}
    print("peak MiB of one step (batch 8), rows: layers x seq, columns: microbatch 1 2 4 8")
    for n in (2, 4):
        for s in (32, 64, 128):
            print(f"  {n} layers, seq {s:>3}: " + " ".join(f"{GRID[n, s, m] / MiB:6.2f}" for m in (1, 2, 4, 8)))
    """),
    code("""
    def predicted_microbatch(budget, n_layers, seq):
        size = B
        while size >= 1:
            if GRID[n_layers, seq, size] <= budget:
                return size
            size = max((d for d in range(1, size // 2 + 1) if B % d == 0), default=0)
        return None

    budget = int((GRID[4, 128, 2] + GRID[4, 128, 4]) / 2)
    model = Llama(LlamaConfig.from_name("cpu", n_layers=4), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amb = AutoMicrobatch(model, opt, B)
    with memory_budget(budget, model=model, optimizer=opt) as tracker:
        result = amb.train_step(global_batch(CONFIG.vocab_size, B, 128, step=0))
    print(f"budget {budget / MiB:.2f} MiB: tried {amb.tried}, chose {result.microbatch_size} "
          f"(predicted from the table: {predicted_microbatch(budget, 4, 128)}), OOMs raised: {tracker.failures}")
    """),
    code("""
    def render(budget_mib, n_layers, seq_len):
        sizes = (1, 2, 4, 8)
        peaks = [GRID[n_layers, seq_len, m] / MiB for m in sizes]
        chosen = predicted_microbatch(budget_mib * MiB, n_layers, seq_len)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(sizes, peaks, "o-", label="measured peak of a step")
        ax.axhline(budget_mib, color="red", linestyle="--", label="budget")
        if chosen:
            ax.plot([chosen], [GRID[n_layers, seq_len, chosen] / MiB], "g*", markersize=16, label=f"chosen: {chosen}")
        ax.set_xscale("log", base=2); ax.set_xticks(sizes, [str(m) for m in sizes])
        ax.set_xlabel("microbatch size"); ax.set_ylabel("MiB"); ax.legend(fontsize=8)
        ax.set_title(f"{n_layers} layers, seq {seq_len}, batch {B}")
        text = f"chosen microbatch: {chosen}" if chosen else "nothing fits: even microbatch 1 runs out of memory"
        return fig, text

    fig, text = render(round(budget / MiB, 1), 4, 128)
    print(text)
    fig.savefig(f"{FIGURES}/microbatch_search.png", dpi=90, bbox_inches="tight")
    """),
    code("""
    explorer = Explorer({
        "budget_mib": widgets.FloatSlider(value=round(budget / MiB, 1), min=5, max=40, step=0.5, description="budget MiB"),
        "n_layers": widgets.Dropdown(options=[2, 4], value=4, description="layers"),
        "seq_len": widgets.Dropdown(options=[32, 64, 128], value=128, description="seq len"),
    }, render, title="AutoMicrobatch: which microbatch fits?")
    explorer.show((fig, text));
    """, tags=["nbval-ignore-output"]),
    md("""
    ## 5. Thrashing

    On a GPU, a step that *almost* does not fit does not always fail: the caching allocator frees its cache
    and retries (`torch.cuda.memory_stats()["num_alloc_retries"]` grows). Each retry is a device-wide sync and a
    cache flush — steps get slow. `AutoMicrobatch` treats retries that grow in **2 consecutive steps** on any
    rank (a MAX all-reduce) like an OOM: it halves the microbatch for the next step and re-installs the sync
    hooks. Here we feed it a counter that grows every step (as `memory_stats` would on a thrashing GPU):
    """),
    code("""
    import fsdp_lab.automicrobatch as automicrobatch_module
    counter = iter(range(100))
    original = automicrobatch_module._alloc_retries
    automicrobatch_module._alloc_retries = lambda device: next(counter)
    try:
        model = Llama(CONFIG, seed=0)
        amb = AutoMicrobatch(model, torch.optim.AdamW(model.parameters(), lr=1e-3), B)
        sizes = [amb.train_step(global_batch(CONFIG.vocab_size, B, SEQ, step=s)).microbatch_size for s in range(4)]
    finally:
        automicrobatch_module._alloc_retries = original
    print("microbatch per step:", sizes, "| events:", [h["event"] for h in amb.history])
    """),
    md("""
    ## 6. CPU offload of the optimizer step

    `CPUOffloadPolicy` (FSDP2) and `CPUOffload(offload_params=True)` (FSDP1) keep sharded parameters, their
    gradients and the optimizer state in host memory; the optimizer step runs on the CPU and every all-gather
    copies the shard up first. On a GPU that saves those
    three categories of device memory and costs host-device copies and a slower step. On this CPU machine both
    "devices" are the same memory, so the breakdown below shows *which categories move to the host*; the
    saving on a GPU is their sum. (Step times are in an ignored cell.)
    """),
    code("""
    HOST = ("sharded_params", "sharded_grads", "optimizer_state")
    SEQ_CHECK = 128   # the same per-rank batch (8 x 128 tokens) as the checklist below

    def offload_compare():
        out = {}
        for impl in ("fsdp2", "fsdp1"):
            for offload in (False, True):
                model, opt = sharded_llama(offload, impl)
                amb = AutoMicrobatch(model, opt, B)
                amb.train_step(rank_batch(0, SEQ_CHECK))
                start = time.perf_counter()
                with MemoryTracker(model, opt) as tracker:
                    amb.train_step(rank_batch(1, SEQ_CHECK))
                amb.close()
                out[impl, offload] = {"peak": tracker.peak(), "total": tracker.peak_total(),
                                      "seconds": time.perf_counter() - start}
        return out

    offload_runs = fsdp_lab.launch(offload_compare, world_size=2, timeout=180)[0]
    offload = {flag: offload_runs["fsdp2", flag] for flag in (False, True)}  # FSDP2's, for the checklist
    print(f"{'category at the peak (rank 0)':<30}{'FSDP2 MiB':>10}{'FSDP1 MiB':>10}  lives on, with offload")
    for category, nbytes in offload_runs["fsdp2", True]["peak"].items():
        other = offload_runs["fsdp1", True]["peak"][category]
        if nbytes or other:
            print(f"{category:<30}{nbytes / MiB:10.2f}{other / MiB:10.2f}  {'host' if category in HOST else 'device'}")

    def device_part(run):
        return run["total"] - sum(run["peak"][c] for c in HOST)

    for impl in ("fsdp2", "fsdp1"):
        print(f"{impl}: device peak without offload {offload_runs[impl, False]['total'] / MiB:.2f} MiB, "
              f"with offload {device_part(offload_runs[impl, True]) / MiB:.2f} MiB")
    device_with = device_part(offload[True])
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
    smaller kernels; same number of FLOPs). The table measures each item of the slaying-OOMs checklist on the
    same model (2 layers, batch 8, seq 128, AdamW, one process unless said), peak bytes of one step:
    """),
    code("""
    base = step_peak(2, SEQ_CHECK, 8)[0]
    rows = [("baseline (batch 8 in one go)", base),
            ("microbatch 2 (AutoMicrobatch-style)", step_peak(2, SEQ_CHECK, 2)[0]),
            ("activation checkpointing", step_peak(2, SEQ_CHECK, 8, checkpoint=True)[0]),
            ("LoRA (rank 8, base frozen)", step_peak(2, SEQ_CHECK, 8, lora="lora")[0]),
            ("QLoRA (NF4 base + LoRA)", step_peak(2, SEQ_CHECK, 8, lora="qlora")[0])]
    rows.append(("FSDP2 on 2 ranks (section 6, rank 0)", offload[False]["total"]))
    rows.append(("FSDP2 + CPU offload (device part)", device_with))
    for name, peak in rows:
        print(f"{name:<38}{peak / MiB:8.2f} MiB  {peak / base:6.1%} of baseline")
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r[0] for r in rows][::-1], [r[1] / MiB for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("peak MiB of one step"); ax.set_title("the slaying-OOMs checklist, measured")
    fig.savefig(f"{FIGURES}/checklist.png", dpi=90, bbox_inches="tight")
    """),
    md("""
    The last two rows come from section 6 (2 ranks, each with the same 8 x 128 tokens as the one-process
    rows; FSDP adds gathered parameters and communication buffers). On this small model activations
    dominate, so the activation items win; on a 7B model the states dominate and sharding, offload and
    QLoRA come first. Order of attack when a step does
    not fit: shard → checkpoint / microbatch (activations) → offload (states) → LoRA / QLoRA (states and
    weights) — and let `AutoMicrobatch` pick the microbatch on every rank at once.

    ## 8. Exercise: the step-down rule

    Write `next_microbatch(batch_size, failed, min_size)`: the largest divisor of `batch_size` that is at most
    half of `failed` and at least `min_size`, or `None` when there is none. The checking cell compares it with
    the rule `AutoMicrobatch` uses on many cases.
    """),
    code("""
    def next_microbatch(batch_size, failed, min_size=1):
        for size in range(failed // 2, min_size - 1, -1):
            if batch_size % size == 0:
                return size
        return None
    """),
    code("""
    cases = [(b, f, m) for b in range(1, 25) for f in range(1, b + 1) for m in (1, 2, 3)]
    wrong = [(b, f, m) for b, f, m in cases
             if next_microbatch(b, f, m) != AutoMicrobatch._largest_divisor(b, f // 2, m)]
    print("correct" if not wrong else f"not yet: e.g. batch {wrong[0][0]}, failed {wrong[0][1]}, min {wrong[0][2]}")
    """),
    md("""
    ## Summary

    * One rank's OOM deadlocks FSDP at the next collective: before a unit's forward all-gather, its backward
      all-gather, its reduce-scatter, and after the optimizer step.
    * Sync hooks before every collective + a MAX/MIN agreement on a separate group turn that into a clean,
      shared retry: recover FSDP state, halve the microbatch, rerun the same data. A finished step equals a
      fixed-microbatch step.
    * Hooks cost two tiny all-reduces per collective: they go after 3 clean steps and come back after an OOM,
      an eval or thrashing (allocator retries growing 2 steps in a row).
    * The checklist, measured: shard and offload attack states, checkpointing and microbatching attack
      activations, LoRA/QLoRA attack gradients, optimizer state and weights.
    """),
]

if __name__ == "__main__":
    build(__file__, CELLS)
