"""Repeats: values per repeat, mean ± sd and "apart" worked out by hand on made-up tables."""

import pytest

from fsdp_lab.compare import CompareResult
from fsdp_lab.workshop.repeats import Repeats, spread


def _table(step_ms_by_run: dict, forward_s_by_run: dict) -> CompareResult:
    # two ranks; a phase reads as the mean over ranks, in ms
    rows = [{"name": n, "step_ms": step_ms_by_run[n],
             "phases": {0: {"forward": f - 0.001}, 1: {"forward": f + 0.001}}}
            for n, f in forward_s_by_run.items()]
    return CompareResult(rows, timelines={}, configs={}, raw=[])


TABLES = Repeats([_table({"a": 10.0, "b": 20.0}, {"a": 0.010, "b": 0.020}),
                  _table({"a": 12.0, "b": 21.0}, {"a": 0.012, "b": 0.021}),
                  _table({"a": 14.0, "b": 22.0}, {"a": 0.014, "b": 0.022})])


def test_measured_reads_row_fields_and_phases_in_ms():
    assert TABLES.measured("a", "step_ms") == [10.0, 12.0, 14.0]
    assert TABLES.measured("b", "forward") == pytest.approx([20.0, 21.0, 22.0])
    with pytest.raises(KeyError, match="no run named 'c'"):
        TABLES.measured("c", "step_ms")


def test_spread_and_apart():
    assert spread([10.0, 12.0, 14.0]) == "  12.00 ±  2.00"
    # means 12 and 21 differ by 9 > sd 2 + sd 1
    assert TABLES.apart("a", "b", "step_ms")
    close = Repeats([_table({"a": 10.0, "b": 11.0}, {"a": 0, "b": 0}),
                     _table({"a": 14.0, "b": 13.0}, {"a": 0, "b": 0})])
    assert not close.apart("a", "b", "step_ms")  # means 12 and 12


def test_phase_table_has_one_line_per_run():
    text = TABLES.phase_table(["a", "b"], phases=("forward",))
    lines = text.splitlines()
    assert lines[0].startswith("run (ms, mean ± sd of 3 runs)") and lines[0].endswith("forward")
    assert lines[1].startswith("a") and lines[1].endswith("12.00 ±  2.00")
    assert lines[2].endswith("21.00 ±  1.00")


def test_error_bars_draw_means_and_one_sd():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = TABLES.error_bars(["a", "b"], ["step_ms"], "title", height=2.5)
    bars = fig.axes[0].patches
    # step_ms of a: 10, 12, 14 (mean 12, sd 2); of b: 20, 21, 22 (mean 21, sd 1)
    assert [bar.get_width() for bar in bars] == pytest.approx([12.0, 21.0])
    assert fig.get_size_inches() == pytest.approx([10, 2.5])
    assert fig.axes[0].get_title() == "title"
    plt.close(fig)


def test_optimizer_times_order_the_three_implementations(capsys):
    from fsdp_lab.workshop import lab07

    # optimizer seconds per rank; mean over ranks in ms: for_loop 30, foreach 20, fused 10 (fsdp2);
    # for_loop 6, foreach 9, fused 3 (fsdp1)
    ms = {"f2 loop": 30, "f2 foreach": 20, "f2 fused": 10, "f1 loop": 6, "f1 foreach": 9, "f1 fused": 3}
    rows = [{"name": n, "phases": {0: {"optimizer": v / 1e3 - 0.001}, 1: {"optimizer": v / 1e3 + 0.001}}}
            for n, v in ms.items()]
    tables = Repeats([CompareResult(rows, timelines={}, configs={}, raw=[])] * 2)
    lab07.print_optimizer_times(tables, list(ms), {"f2 foreach": "fsdp2 foreach"})
    out = capsys.readouterr().out
    assert "fsdp2 foreach" in out and "of 2 runs" in out
    assert "fsdp2: fastest to slowest in this run: fused < foreach < for_loop (for_loop / fused = 3.0x)" in out
    assert "fsdp1: fastest to slowest in this run: fused < for_loop < foreach (for_loop / fused = 2.0x)" in out


def test_optimizer_peaks_group_and_compare_repeats(capsys):
    from fsdp_lab.workshop import lab07

    names = ["f2 loop", "f2 foreach", "f2 fused", "f1 loop", "f1 foreach", "f1 fused"]
    phase = {"f2 fused": "optimizer step start"}     # only FSDP2's fused run peaks inside the step

    def table(moved):  # peak_total_mib per run; ``moved`` shifts one run's peak in this repeat
        rows = [{"name": n, "peak_total_mib": 10.0 + i + (0.5 if n == moved else 0),
                 "peak_phase": phase.get(n, "backward layers.0 end")} for i, n in enumerate(names)]
        return CompareResult(rows, timelines={}, configs={}, raw=[])

    lab07.print_optimizer_peaks(Repeats([table(None), table(None)]), names, {})
    out = capsys.readouterr().out
    assert "every run's peak the same in all repeats: True" in out
    assert "fsdp2: for_loop / foreach / fused peaks (first repeat): 10.00 / 11.00 / 12.00 MiB; " \
           "peak inside optimizer.step(): False / False / True" in out
    assert "fsdp1: for_loop / foreach / fused peaks (first repeat): 13.00 / 14.00 / 15.00 MiB; " \
           "peak inside optimizer.step(): False / False / False" in out
    lab07.print_optimizer_peaks(Repeats([table(None), table("f1 loop")]), names, {})
    assert "every run's peak the same in all repeats: False" in capsys.readouterr().out
