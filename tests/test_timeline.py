"""Timeline: events from hooks and collectives, overlap by hand-worked intervals, Chrome trace."""

import io
import json
import pickle

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab import collectives
from fsdp_lab.timeline import Event, Timeline
from fsdp_lab.viz import plot_timeline


def _timeline_of(events):
    tl = Timeline(rank=0, device="cpu")
    tl._events = list(events)
    return tl


def test_overlap_is_the_hidden_fraction_of_comm_time():
    # comm [0, 10] and [20, 30]; compute [5, 25] (nested [6, 7] counts once) -> hidden 5 + 5 of 20.
    tl = _timeline_of([
        Event(0, "comm", "all_gather", 8, 0.0, 10.0, "comm"),
        Event(0, "comm", "reduce_scatter", 8, 20.0, 30.0, "comm"),
        Event(0, "compute", "block", 0, 5.0, 25.0),
        Event(0, "compute", "inner", 0, 6.0, 7.0),
        Event(1, "comm", "all_gather", 8, 0.0, 4.0, "comm"),
        Event(1, "compute", "block", 0, 4.0, 9.0),
    ])
    assert tl.overlap() == {0: pytest.approx(0.5), 1: 0.0}


def test_chrome_trace_has_one_process_per_rank_and_one_thread_per_lane(tmp_path):
    tl = _timeline_of([
        Event(0, "compute", "fwd", 0, 1.0, 1.5),
        Event(1, "comm", "all_gather", 64, 1.25, 2.0, "comm", {"dtype": "float32"}),
    ])
    doc = tl.to_chrome_trace(tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == doc
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in spans] == [
        (0, "fwd", 0.0, 500000.0), (1, "all_gather", 250000.0, 750000.0)]
    assert spans[1]["args"] == {"bytes": 64, "dtype": "float32"}
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "compute"), (1, "comm")}


def test_attach_records_forward_in_order_and_backward_in_reverse():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with Timeline() as tl:
        tl.attach(model)
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        with tl.span("optimizer_step"):
            pass
    names = [e.name for e in sorted(tl.events, key=lambda e: e.t_end)]
    assert names == ["0 forward", "1 forward", "2 forward", "2 backward", "1 backward", "0 backward",
                     "optimizer_step"]
    assert all(e.t_end >= e.t_start for e in tl.events)
    # hooks are removed at exit: another pass records nothing
    model(torch.randn(3, 4)).sum()
    assert len(tl.events) == 7


def test_timeline_round_trips_through_torch_save_and_merges():
    a = _timeline_of([Event(0, "compute", "x", 0, 0.0, 1.0)])
    b = _timeline_of([Event(1, "comm", "all_reduce", 4, 0.5, 0.7, "comm")])
    buf = io.BytesIO()
    torch.save(b, buf)
    buf.seek(0)
    b2 = torch.load(buf, weights_only=False)
    merged = Timeline.merge([a, b2])
    assert merged.ranks() == [0, 1]
    assert [e.name for e in merged.comm_events()] == ["all_reduce"]


def test_span_outside_recording_is_an_error():
    with pytest.raises(RuntimeError, match="outside"):
        with Timeline().span("x"):
            pass


def test_plot_timeline_draws_rows_per_rank_and_lane():
    tl = _timeline_of([Event(0, "compute", "f", 0, 0.0, 1.0, args={"phase": "forward"}),
                       Event(0, "comm", "all_gather", 4, 0.2, 0.4, "comm"),
                       Event(1, "comm", "all_gather", 4, 0.2, 0.5, "comm")])
    ax = plot_timeline(tl)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 compute", "rank 0 comm", "rank 1 comm"]
    with pytest.raises(ValueError, match="no events"):
        plot_timeline(_timeline_of([]))
    inside, outside = plot_timeline(tl).get_legend(), plot_timeline(tl, legend_outside=True).get_legend()
    assert [t.get_text() for t in outside.get_texts()] == [t.get_text() for t in inside.get_texts()]
    anchor = outside.get_bbox_to_anchor().transformed(outside.axes.transAxes.inverted())
    assert anchor.x0 == pytest.approx(1.0)  # the legend starts at the axes' right edge


def test_plot_timeline_gives_every_legend_entry_its_own_colour():
    # two collectives outside the fixed palette (the OOM agreement's) beside an all-gather and a forward
    tl = _timeline_of([Event(0, "compute", "f", 0, 0.0, 1.0, args={"phase": "forward"}),
                       Event(0, "comm", "all_gather", 4, 0.2, 0.4, "comm"),
                       Event(0, "comm", "oom_sync", 8, 0.5, 0.6, "comm"),
                       Event(1, "comm", "oom_flag", 4, 0.7, 0.8, "comm")])
    legend = plot_timeline(tl).get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["all_gather", "forward", "oom_flag", "oom_sync"]
    colours = [tuple(handle.get_facecolor()) for handle in legend.legend_handles]
    assert len(set(colours)) == len(labels)
    ax = plot_timeline(tl)  # each bar is drawn in its legend entry's colour
    bar_colours = {tuple(c.get_facecolor()[0]) for c in ax.collections}
    assert bar_colours == set(colours)


def _overlap_run():
    # The same all-gather and the same matmuls, once waited before computing (sync) and
    # once issued async with the compute in between: only the second can overlap.
    import torch.distributed as dist

    n = dist.get_world_size()
    x = torch.ones(1 << 20)
    out = torch.empty(n << 20)
    a = torch.randn(384, 384)
    result = {}
    for mode in ("sync", "async"):
        with Timeline() as tl:
            for _ in range(3):
                if mode == "sync":
                    collectives.all_gather_into_tensor(out, x)
                    with tl.span("matmul"):
                        for _ in range(20):
                            a @ a
                else:
                    handle = collectives.all_gather_into_tensor(out, x, async_op=True)
                    with tl.span("matmul"):
                        for _ in range(20):
                            a @ a
                    handle.wait()
        result[mode] = tl
    return result


def test_overlap_is_zero_when_synchronous_and_positive_when_async():
    per_rank = fsdp_lab.launch(_overlap_run, world_size=2, timeout=120)
    sync = Timeline.merge(r["sync"] for r in per_rank)
    asynchronous = Timeline.merge(r["async"] for r in per_rank)
    assert len(sync.comm_events()) == len(asynchronous.comm_events()) == 6
    assert all(v == 0.0 for v in sync.overlap().values())
    assert all(v > 0.0 for v in asynchronous.overlap().values())


def test_phase_summary_splits_the_window_worked_by_hand():
    # window 0..18 (first start to last end): forward 0..4 (with a nested block 1..2), backward
    # 6..12, optimizer 14..16, comm 3..8 (hidden 3..4 and 6..8 -> exposed 4..6 = 2) and 17..18
    # (exposed 1); idle 12..14 and 16..17 = 3.
    tl = _timeline_of([
        Event(0, "compute", "model forward", 0, 0.0, 4.0, args={"phase": "forward"}),
        Event(0, "compute", "block forward", 0, 1.0, 2.0, args={"phase": "forward"}),
        Event(0, "compute", "model backward", 0, 6.0, 12.0, args={"phase": "backward"}),
        Event(0, "compute", "optimizer_step", 0, 14.0, 16.0, args={"phase": "optimizer"}),
        Event(0, "comm", "all_gather", 8, 3.0, 8.0, "comm", {"group_size": 2}),
        Event(0, "comm", "reduce_scatter", 8, 17.0, 18.0, "comm", {"group_size": 2}),
    ])
    row = tl.phase_summary()[0]
    assert row == pytest.approx({"forward": 4.0, "backward": 6.0, "optimizer": 2.0, "other_compute": 0.0,
                                 "exposed_comm": 3.0, "idle": 3.0, "window": 18.0})
    assert sum(v for k, v in row.items() if k != "window") == pytest.approx(row["window"])
    rows = tl.collective_summary()
    assert rows[0]["algbw"] == pytest.approx(8 / 5.0) and rows[0]["busbw"] == pytest.approx(8 / 5.0 / 2)


def test_plot_phase_breakdown_stacks_phases_per_run():
    from fsdp_lab.viz import plot_phase_breakdown

    fast = _timeline_of([Event(0, "compute", "f", 0, 0.0, 0.001, args={"phase": "forward"})])
    slow = _timeline_of([Event(0, "compute", "f", 0, 0.0, 0.003, args={"phase": "forward"})])
    ax = plot_phase_breakdown({"fast": fast, "slow": slow})
    forward_widths = [p.get_width() for p in ax.patches[::6]]  # first patch of each run is forward
    assert forward_widths == pytest.approx([1.0, 3.0])
    with pytest.raises(ValueError):
        plot_phase_breakdown({})


def test_attach_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="needs the model \\(an nn.Module\\), got int"):
        Timeline().attach(3)
    with pytest.raises(TypeError, match=r"must be \(name, nn.Module\) pairs, .*; got \[\('head', 'not a module'\)\]"):
        Timeline().attach(nn.Linear(2, 2), modules=[("head", "not a module")])
    head = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"pairs, .*; got \[Linear"):
        Timeline().attach(nn.Sequential(head), modules=[head])  # modules without their names
    with pytest.raises(TypeError, match="Timeline.merge takes Timelines .*, got int"):
        Timeline.merge([1, 2])
    with pytest.raises(TypeError, match="rank number .* got '0'"):
        Timeline(rank="0")
    with pytest.raises(ValueError, match="rank number >= 0, got -1"):
        Timeline(rank=-1)
    with pytest.raises(RuntimeError, match=r"attach inside `with Timeline\(\) as tl:`"):
        Timeline().attach(nn.Linear(2, 2))  # before the block: its hooks would have no clock
    with Timeline() as done:
        pass
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        done.attach(nn.Linear(2, 2))  # after it: the timeline is final


def test_a_leaf_model_is_its_own_unit():
    model = nn.Linear(2, 2)
    with Timeline() as tl:
        tl.attach(model, [["Linear", model]])  # pairs as lists too (from JSON, say)
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert [(e.name, e.args.get("phase")) for e in tl.compute_events()] == [("Linear forward", "forward"),
                                                                       ("Linear backward", "backward")]


def test_a_collective_not_waited_on_inside_the_block_is_left_out_with_a_warning():
    import fsdp_lab
    from fsdp_lab import collectives

    with fsdp_lab.simulated_world(2):
        with pytest.warns(UserWarning, match=r"2 asynchronous collective\(s\) \(all_gather, all_reduce\) issued "
                                             "inside this Timeline were not waited on"):
            with Timeline() as tl:
                waited = collectives.all_reduce(torch.ones(4), async_op=True)
                waited.wait()
                late = collectives.all_reduce(torch.ones(4), async_op=True)
                never = collectives.all_gather_into_tensor(torch.empty(8), torch.ones(4), async_op=True)
                collectives.broadcast(torch.ones(4), src=0)
        before = [e.name for e in tl.comm_events()]
        late.wait()  # after the block: the timeline stays as it was
        assert before == ["all_reduce", "broadcast"] and [e.name for e in tl.comm_events()] == before
        assert tl.unwaited == ["all_reduce", "all_gather"]  # in issue order
        assert pickle.loads(pickle.dumps(tl)).unwaited == ["all_reduce", "all_gather"]
        never.wait()


def test_a_recorded_timeline_loads_where_its_device_is_missing(monkeypatch):
    # recorded on GPU ranks, read on a laptop: unpickling makes no device check
    import pickle

    tl = _timeline_of([Event(0, "comm", "all_gather", 4, 0.2, 0.4, "comm")])
    tl.device = torch.device("cuda", 0)
    blob = pickle.dumps(tl)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = pickle.loads(blob)
    assert loaded.device == torch.device("cuda", 0) and [e.name for e in loaded.comm_events()] == ["all_gather"]
