"""Memory plots (headless), the MemoryExplorer widget, and CUDA snapshot parsing/plotting."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fsdp_lab.memory import snapshot  # noqa: E402
from fsdp_lab.memory.estimate import estimate  # noqa: E402
from fsdp_lab.memory.tracker import MemoryTracker  # noqa: E402
from fsdp_lab.memory.tags import CATEGORIES  # noqa: E402
from fsdp_lab.viz.memory_plots import (COLORS_BESIDE_TIMELINE, plot_breakdown, plot_estimate_vs_measured,  # noqa: E402
                                       plot_memory_curve)
from fsdp_lab.viz.memory_widgets import MemoryExplorer  # noqa: E402


def bar_heights(ax):
    return [round(p.get_height()) for p in ax.patches]


def test_plot_breakdown_stacks_categories():
    ax = plot_breakdown({"rank 0": {"params": 3 * 2**20, "activations": 2**20},
                         "rank 1": {"params": 3 * 2**20, "activations": 2 * 2**20}}, unit="MiB")
    # one bar per (category, label): params first, then activations stacked on top
    assert bar_heights(ax) == [3, 3, 1, 2]
    assert [p.get_y() for p in ax.patches][2:] == [3.0, 3.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["params", "activations"]
    plt.close("all")
    with pytest.raises(ValueError, match="unknown memory categories"):
        plot_breakdown([{"weights": 1}])


def test_plot_memory_curve_from_a_tracker():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with MemoryTracker(model) as mt:
        model(torch.randn(4, 8)).sum().backward()
    ax = plot_memory_curve(mt.timeline(), label_every=2)
    assert len(ax.collections) >= 2  # stacked areas (params, activations, ...) and the backward band
    assert ax.get_xticklabels()[0].get_text() == "start"
    plt.close("all")
    with pytest.raises(ValueError):
        plot_memory_curve([])


def test_plots_and_tables_take_what_a_tracker_gives():
    from fsdp_lab.memory.results import format_rows, merge_ranks

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with MemoryTracker(model) as mt:
        model(torch.randn(4, 8)).sum().backward()
    result = mt.result()
    # a MemoryResult stands for its peak, the tracker for its result, one result for one rank
    by_result = bar_heights(plot_breakdown({"rank 0": result}, unit="B"))
    assert by_result == bar_heights(plot_breakdown({"rank 0": result.peak}, unit="B"))
    assert [t.get_text() for t in plot_memory_curve(mt, label_every=1).get_xticklabels()] == \
        [label for label, _ in result.timeline]
    assert merge_ranks(result) == merge_ranks([result])
    # one breakdown alone (mt.peak(), or the result itself) is one bar
    assert bar_heights(plot_breakdown(mt.peak(), unit="B")) == by_result
    assert bar_heights(plot_breakdown(result, unit="B")) == by_result
    with pytest.raises(ValueError, match="format_rows needs at least one row"):
        format_rows([])
    with pytest.raises(TypeError, match="a memory breakdown is .* got int"):
        plot_breakdown({"rank 0": 3})
    plt.close("all")


def area_at(ax, category, x):
    """(bottom, top) of a category's stacked area at ``x``, from the drawn polygon's vertices."""
    (area,) = [c for c in ax.collections if c.get_label() == category]
    ys = [y for vx, y in area.get_paths()[0].vertices if vx == x]
    return min(ys), max(ys)


def test_plot_memory_curve_shows_the_last_snapshot_and_the_peak():
    mib = 2**20
    timeline = [("start", {"params": mib}), ("backward x end", {"params": mib, "grads": mib}),
                ("end", {"params": mib, "grads": 0})]
    ax = plot_memory_curve(timeline, peak={"params": mib, "grads": mib, "temporaries": mib},
                           peak_label="backward x end")
    # three snapshots, each one phase wide: the last spans [2, 3] and has no gradients left
    assert ax.get_xlim() == (0, 3)
    assert area_at(ax, "params", 3) == (0, 1)
    bottom, top = area_at(ax, "grads", 3)
    assert top == bottom == 1
    assert area_at(ax, "grads", 1) == (1, 2)
    # the peak falls between snapshots, above the curve: a dashed line at 3 MiB
    (line,) = [l for l in ax.lines if l.get_linestyle() == "--"]
    assert list(line.get_ydata()) == [3, 3]
    assert "tracker's peak, 3.000 MiB after 'backward x end'" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close("all")
    # a plain timeline, as before: no peak line
    ax = plot_memory_curve(timeline, unit="KiB")
    assert not [l for l in ax.lines if l.get_linestyle() == "--"] and area_at(ax, "params", 3) == (0, 1024)
    plt.close("all")


def test_plot_memory_curve_marks_a_results_own_peak():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with MemoryTracker(model) as mt:
        model(torch.randn(4, 8)).sum().backward()
    result = mt.result()
    ax = plot_memory_curve(result, unit="B")
    (line,) = [l for l in ax.lines if l.get_linestyle() == "--"]
    assert list(line.get_ydata()) == [result.peak_total] * 2
    assert ax.get_xlim() == (0, len(result.timeline))
    plt.close("all")


def test_plot_estimate_vs_measured_pairs_bars():
    ax = plot_estimate_vs_measured({"params": 2**20, "grads": 2**20}, {"params": 2**20, "grads": 2 * 2**20})
    assert bar_heights(ax) == [1, 1, 1, 2]  # estimate params, grads; measured params, grads
    assert sum(p.get_hatch() == "//" for p in ax.patches) == 2
    plt.close("all")
    ax = plot_estimate_vs_measured({"a": {"params": 2**20}, "b": {"params": 2**21}},
                                   {"a": {"params": 2**20}, "b": {"params": 2**21}})
    assert len(ax.get_xticks()) == 2
    plt.close("all")


def test_explorer_redraws_on_change_and_overlays_a_measurement():
    ex = MemoryExplorer(model="cpu", world_size=2, strategy="fsdp2", batch_size=1, seq_len=32)
    ex.explorer.update()
    first = ex.explorer.last_png
    assert first and "sharded_params" in ex.explorer.last_text
    ex.controls["world_size"].value = 4  # observers redraw
    assert ex.explorer.last_png != first
    assert "sharded_params" in ex.explorer.last_text
    ex.controls["world_size"].value = 2
    ex.measure(simulated=True)
    assert "measured peak" in ex.explorer.last_text, ex.status.value
    fig, _ = ex.figure()
    assert any(p.get_hatch() == "//" for p in fig.axes[0].patches)
    plt.close("all")
    ex.controls["cpu_offload"].value = True
    ex.measure()
    assert "CPU offload" in ex.status.value
    ex.controls["cpu_offload"].value = False
    for control, value, fix in (("optimizer", "sgd", "set optimizer to adamw"),
                                ("grad_dtype", "bfloat16", "set grads to same")):
        before = ex.controls[control].value
        ex.controls[control].value = value  # a setup measure_step does not run: refused, not mislabelled
        ex.measure()
        assert fix in ex.status.value
        ex.controls[control].value = before
    with pytest.raises(ValueError, match="unknown control"):
        MemoryExplorer(colour="red")


def test_explorer_fits_the_sequence_length_to_a_newly_chosen_model():
    ex = MemoryExplorer(model="llama2-7b", world_size=8, seq_len=4096)
    ex.controls["model"].value = "cpu"          # max_seq_len 128: the length follows
    assert ex.controls["seq_len"].value == 128 and "note:" not in ex.explorer.last_text
    ex.controls["seq_len"].value = 1024         # longer by hand: estimated, with a note
    assert ex.settings()["seq_len"] == 1024
    assert "seq len 1024 is past cpu's max_seq_len (128)" in ex.explorer.last_text
    ex.controls["model"].value = "llama2-7b"    # long enough: nothing changes
    assert ex.controls["seq_len"].value == 1024 and "note:" not in ex.explorer.last_text
    plt.close("all")


@pytest.mark.parametrize("strategy,qlora", [("fsdp2", False), ("fsdp1_full_shard", False), ("fsdp2", True)])
def test_explorer_measures_a_bf16_fsdp_step_in_the_estimates_dtypes(strategy, qlora):
    # the hatched bars sit beside the estimate's: a bf16 model's shards and AdamW state are bf16 in
    # both, and a QLoRA step has the estimate's NF4 bytes and adapters
    ex = MemoryExplorer(model="cpu", world_size=2, strategy=strategy, param_dtype="bfloat16", batch_size=1, seq_len=32,
                        qlora=qlora)
    ex.measure(simulated=True)
    measured = ex.measured[ex._key(ex.settings())]
    at_step = ex.estimate(ex.settings()).phases["optimizer_step"]
    for cat in ("sharded_params", "optimizer_state", "quantized"):
        assert measured.current[cat] == at_step[cat], cat
    assert measured.current["quantized"] > 0 if qlora else measured.current["quantized"] == 0
    plt.close("all")


def test_explorer_status_is_about_the_settings_measured_only():
    ex = MemoryExplorer(model="llama2-7b", world_size=2, batch_size=1, seq_len=32)
    ex.measure()
    assert "too big to run here" in ex.status.value
    ex.controls["model"].value = "cpu"  # the refusal was about llama2-7b: it goes with it
    assert ex.status.value == ""
    ex.measure(simulated=True)
    assert "measured" in ex.status.value
    ex.controls["world_size"].value = 4  # no hatched bars for 4 ranks: no "measured" either
    assert ex.status.value == ""
    plt.close("all")


def test_explorer_refuses_to_measure_past_the_model_s_length_before_any_rank_starts(monkeypatch):
    import fsdp_lab.viz.memory_widgets as memory_widgets

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(memory_widgets, "launch", no_launch)
    ex = MemoryExplorer(model="cpu", world_size=2, batch_size=1, seq_len=32)
    ex.controls["seq_len"].value = 8192
    ex.measure()
    assert "seq len 8192 is past cpu's max_seq_len (128)" in ex.status.value
    assert "measure 128 tokens or fewer" in ex.status.value and "Traceback" not in ex.status.value
    plt.close("all")


def test_explorer_takes_the_figure_away_when_a_setting_is_refused():
    ex = MemoryExplorer(model="cpu", world_size=8, strategy="fsdp1_hybrid_shard", batch_size=1, seq_len=32)
    ex.explorer.update()
    assert ex.explorer.last_png
    ex.controls["world_size"].value = 12  # not whole 8-GPU nodes: refused
    assert "ValueError" in ex.explorer.last_text
    assert ex.explorer.last_png is None  # no figure of 8 ranks beside it
    plt.close("all")


def test_a_run_button_explorer_marks_its_figure_out_of_date_when_a_control_changes():
    import ipywidgets as widgets

    from fsdp_lab.viz.widgets import STALE_CLASS, Explorer

    renders, shown_while_rendering = [], []

    def render(n):
        renders.append(n)
        shown_while_rendering.append(ex.stale.value)
        fig, ax = plt.subplots()
        ax.bar([0], [n])
        return fig, f"n = {n}"

    n = widgets.IntSlider(value=1, min=1, max=4)
    ex = Explorer({"n": n}, render, auto=False)
    ex.update()
    n.value = 3  # no render on change (it would run ranks): the shown result is marked instead
    assert renders == [1] and ex.last_text == "n = 1" and STALE_CLASS in ex.stale.value
    ex.button.click()
    assert renders == [1, 3] and ex.last_text == "n = 3" and ex.stale.value == ""
    assert all("running" in shown for shown in shown_while_rendering)  # the figure below is the last one
    plt.close("all")


def test_explorer_hybrid_shards_within_the_chosen_node():
    ex = MemoryExplorer(model="cpu", world_size=12, strategy="fsdp1_hybrid_shard", batch_size=1, seq_len=32)
    ex.explorer.update()  # 12 GPUs are not whole 8-GPU nodes: the control that fixes it is named
    assert "not a whole number of 8-GPU nodes" in ex.explorer.last_text and "GPUs/node" in ex.explorer.last_text
    ex.controls["gpus_per_node"].value = 4
    # hybrid on 3 nodes of 4 holds what FULL_SHARD over 4 ranks holds, replicated per node
    full_shard_on_4 = estimate("cpu", world_size=4, strategy="fsdp1_full_shard", batch_size=1, seq_len=32)
    assert ex.estimate().phases == full_shard_on_4.phases
    assert "sharded_params" in ex.explorer.last_text  # redrawn: the error is gone
    ex.controls["world_size"].value = 2  # less than a node: one node of 2
    full_shard_on_2 = estimate("cpu", world_size=2, strategy="fsdp1_full_shard", batch_size=1, seq_len=32)
    assert ex.estimate().phases == full_shard_on_2.phases
    plt.close("all")


def synthetic_snapshot():
    """A snapshot in torch's format: 1 MiB allocated before recording, then +2, +1, -2 MiB."""
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * mib, "time_us": 1000},
        {"action": "alloc", "addr": 2, "size": mib, "time_us": 2000},
        {"action": "free_requested", "addr": 1, "size": 2 * mib, "time_us": 2500},
        {"action": "free_completed", "addr": 1, "size": 2 * mib, "time_us": 3000},
    ]
    segments = [{"device": 0, "blocks": [{"size": mib, "state": "active_allocated"},
                                         {"size": mib, "state": "active_allocated"},
                                         {"size": 2 * mib, "state": "inactive"}]}]
    return {"segments": segments, "device_traces": [trace]}


def test_snapshot_memory_over_time_and_plot(tmp_path):
    import pickle

    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(synthetic_snapshot()))
    times, values = snapshot.memory_over_time(path)
    assert times == [0.0, 1.0, 2.0]
    assert [v // 2**20 for v in values] == [3, 4, 2]
    ax = snapshot.plot_snapshot(path)
    assert "peak 4.0 MiB" in [t.get_text() for t in ax.texts]
    plt.close("all")
    with pytest.raises(ValueError, match="device 1"):
        snapshot.memory_over_time(synthetic_snapshot(), device=1)


def test_snapshot_record_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        with snapshot.record():
            pass


@pytest.mark.gpu
def test_snapshot_records_a_cuda_step(tmp_path):
    model = torch.nn.Linear(256, 256).cuda()
    path = tmp_path / "step.pickle"
    with snapshot.record(path):
        model(torch.randn(64, 256, device="cuda")).sum().backward()
    times, values = snapshot.memory_over_time(path, device=torch.cuda.current_device())
    assert max(values) >= 256 * 256 * 4 * 2  # weight and its gradient
    snapshot.plot_snapshot(path, device=torch.cuda.current_device())
    plt.close("all")


def test_memory_colours_beside_a_timeline_cover_every_category_and_share_none_with_the_timeline():
    from fsdp_lab.viz.timeline_plots import _COLORS as TIMELINE_COLORS, _SPARE_COLORS

    assert set(COLORS_BESIDE_TIMELINE) == set(CATEGORIES)
    colours = [c.lower() for c in COLORS_BESIDE_TIMELINE.values()]
    assert len(set(colours)) == len(colours)
    timeline = {c.lower() for c in [*TIMELINE_COLORS.values(), *_SPARE_COLORS]}
    shared = {cat: c for cat, c in COLORS_BESIDE_TIMELINE.items() if c.lower() in timeline}
    assert not shared, f"memory categories drawn in a timeline colour: {shared}"


def test_every_memory_table_and_plot_takes_the_same_units_and_names_them_on_a_wrong_one():
    from fsdp_lab.memory.estimate import Breakdown
    from fsdp_lab.memory.results import format_rows

    breakdown = Breakdown(bytes={"params": 3 * 2**20, "activations": 1_500_000})
    # worked by hand: 3 MiB = 3072 KiB = 3,145,728 B = 0.003145728 GB
    assert "3072.000 KiB" in breakdown.table("KiB")
    assert "3145728.000 B" in breakdown.table("B")
    assert "0.003 GB" in breakdown.table("GB")
    rows = [{"rank": 0, "params": 3 * 2**20}]
    assert format_rows(rows, unit="KiB").splitlines()[1].split() == ["0", "3072.000"]
    assert plot_breakdown([{"params": 2**30}], unit="GB").patches[0].get_height() == pytest.approx(1.073741824)
    plt.close("all")
    # decimal units as spec sheets print them: 3 MiB = 3.145728 MB = 3145.728 KB
    assert "3.146 MB" in breakdown.table("MB") and format_rows(rows, unit="KB").splitlines()[1].split() == ["0", "3145.728"]
    calls = [lambda: breakdown.table("Mb"), lambda: format_rows(rows, unit="Mb"),
             lambda: plot_breakdown([breakdown], unit="Mb"),
             lambda: plot_memory_curve([("start", {"params": 1})], unit="Mb"),
             lambda: plot_estimate_vs_measured(breakdown, breakdown, unit="Mb")]
    for call in calls:
        with pytest.raises(ValueError, match="unit must be one of B, KiB, MiB, GiB, KB, MB, GB, got 'Mb'"):
            call()
    plt.close("all")


def test_a_plot_that_makes_its_own_figure_keeps_legend_and_labels_inside_a_plain_savefig(tmp_path):
    # a script saves with plain savefig (Jupyter's inline display crops to what is drawn): the legend
    # right of the axes and the rotated phase labels must lie inside the figure
    from fsdp_lab.timeline import Event, Timeline
    from fsdp_lab.viz import plot_phase_breakdown, plot_timeline

    peak = {"params": 3 << 20, "grads": 3 << 20, "optimizer_state": 6 << 20, "activations": 1 << 20}
    curve = [("start", {"params": 3 << 20}), ("forward a very long module name end", peak), ("end", {"params": 3 << 20})]
    timeline = Timeline(rank=0, device="cpu")
    timeline._events = [Event(0, "compute", "f", 0, 0.0, 1.0, args={"phase": "forward"}),
                       Event(0, "comm", "all_gather", 4, 0.2, 0.4, "comm")]
    plots = [plot_breakdown({"rank 0": peak}), plot_memory_curve(curve, label_every=1),
             plot_estimate_vs_measured(peak, peak), plot_timeline(timeline, legend_outside=True),
             plot_phase_breakdown({"run": {0: dict.fromkeys(("forward", "backward", "optimizer", "other_compute",
                                                              "exposed_comm", "idle"), 0.001)}})]
    for ax in plots:
        figure = ax.figure
        figure.savefig(tmp_path / "plot.png")
        drawn = ax.get_tightbbox(figure.canvas.get_renderer())  # the axes with all it draws (legend, labels)
        assert ax.get_legend() is not None
        assert drawn.x0 >= -1 and drawn.y0 >= -1 and drawn.x1 <= figure.bbox.width + 1 \
            and drawn.y1 <= figure.bbox.height + 1, (ax.get_title(), drawn, figure.bbox)
    plt.close("all")
