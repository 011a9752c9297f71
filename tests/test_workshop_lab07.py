"""Lab 07's checkers fed the shipped stub, the shipped solution and typical wrong answers.

The reference is a real ``fsdp_lab.compare`` table (one launch, the runs the checkers read):
the backward events and the collective counts/bytes recorded by fsdp_lab's FSDP1 and FSDP2, and
``Timeline.overlap()``.
"""

from __future__ import annotations

import pytest

from fsdp_lab.compare import compare
from fsdp_lab.timeline import _union
from fsdp_lab.workshop import lab07
from test_workshop_labs import Shipped

LAB07 = Shipped("07_prefetch_and_overlap")


@pytest.fixture(scope="module")
def table():
    runs = [dict(name="fsdp2 block"), dict(name="fsdp2 block no-prefetch", prefetch="none"),
            dict(name="fsdp2 block keep-gathered", reshard_after_forward=False),
            dict(name="fsdp2 two_blocks", wrapping="two_blocks"), dict(name="fsdp2 model", wrapping="model"),
            dict(name="fsdp1 block pre", implementation="fsdp1", prefetch="backward_pre"),
            dict(name="fsdp1 block post", implementation="fsdp1", prefetch="backward_post"),
            dict(name="fsdp1 block none", implementation="fsdp1", prefetch="none")]
    return compare(runs, model="cpu", steps=3, world_size=2, batch_size=4, seq_len=32)


def test_recorded_orders_agree_between_fsdp1_and_fsdp2(table):
    # the reference: both implementations record the same backward order for the same setting
    for names in lab07.ORDER_RUNS.values():
        orders = {tuple(lab07.recorded_backward(table.timelines[n])) for n in names}
        assert len(orders) == 1, names


# ----------------------------------------------------------------------------- backward order


def forward_not_reversed(forward, prefetch):
    return [e for b in forward for e in (("AG", b), ("bwd", b), ("RS", b))]


def swapped(forward, prefetch):
    solution = LAB07["backward_order"][1]
    return solution(forward, {"pre": "post", "post": "pre"}.get(prefetch, prefetch))


def prefetch_ignored(forward, prefetch):
    return LAB07["backward_order"][1](forward, "none")


def as_text(forward, prefetch):
    return [f"{kind} {unit}" for kind, unit in LAB07["backward_order"][1](forward, prefetch)]


def test_backward_order_verdicts(table):
    stub, solution = LAB07["backward_order"]
    assert lab07.check_backward_order(stub, table).mistake == "stub"
    right = lab07.check_backward_order(solution, table)
    assert right.solved and "AG layers.3 -> AG layers.2 -> bwd layers.3" in right.message
    assert lab07.check_backward_order(forward_not_reversed, table).mistake == "forward_order"
    assert lab07.check_backward_order(swapped, table).mistake == "pre_post_swapped"
    assert lab07.check_backward_order(prefetch_ignored, table).mistake == "wrong_pre"
    assert lab07.check_backward_order(as_text, table).mistake == "not_pairs"
    after_rs = lab07.check_backward_order(post_after_reduce_scatter, table)
    assert after_rs.mistake == "post_after_reduce_scatter", after_rs
    assert "BACKWARD_POST" in after_rs.message


def post_after_reduce_scatter(forward, prefetch):
    # 'post' read as "after the reduce-scatter": the order of 'none'
    return LAB07["backward_order"][1](forward, "none" if prefetch == "post" else prefetch)


# ----------------------------------------------------------------------------- collectives per step


def no_regather(root, units, reshard):
    return {"all_gathers": 1 + len(units), "reduce_scatters": 1 + len(units),
            "gathered_bytes": root + sum(units), "reduced_bytes": root + sum(units)}


def root_twice(root, units, reshard):
    k = 2 if reshard else 1
    return {"all_gathers": k * (1 + len(units)), "reduce_scatters": 1 + len(units),
            "gathered_bytes": k * (root + sum(units)), "reduced_bytes": root + sum(units)}


def reshard_ignored(root, units, reshard):
    return {"all_gathers": 1 + 2 * len(units), "reduce_scatters": 1 + len(units),
            "gathered_bytes": root + 2 * sum(units), "reduced_bytes": root + sum(units)}


def test_collectives_per_step_verdicts(table):
    stub, solution = LAB07["collectives_per_step"]
    assert lab07.check_collectives_per_step(stub, table).mistake == "stub"
    right = lab07.check_collectives_per_step(solution, table)
    assert right.solved and "fsdp2 block: 9 AG / 5 RS" in right.message and "fsdp2 model: 1 AG / 1 RS" in right.message
    assert lab07.check_collectives_per_step(no_regather, table).mistake == "no_regather"
    assert lab07.check_collectives_per_step(root_twice, table).mistake == "root_regathered"
    assert lab07.check_collectives_per_step(reshard_ignored, table).mistake == "reshard_ignored"
    per_rank = lab07.check_collectives_per_step(bytes_per_rank, table)
    assert per_rank.mistake == "bytes_per_rank", per_rank
    assert "1/2 of" in per_rank.message and "whole output" in per_rank.message
    no_root = lab07.check_collectives_per_step(root_not_reduced, table)
    assert no_root.mistake == "no_root_reduce_scatter", no_root
    assert "root" in no_root.message


def bytes_per_rank(root, units, reshard):
    k, world = (2 if reshard else 1), 2
    return {"all_gathers": 1 + k * len(units), "reduce_scatters": 1 + len(units),
            "gathered_bytes": (root + k * sum(units)) // world,  # what one rank holds, not the output
            "reduced_bytes": (root + sum(units)) // world}


def root_not_reduced(root, units, reshard):
    k = 2 if reshard else 1
    return {"all_gathers": 1 + k * len(units), "reduce_scatters": len(units),  # the root's is missing
            "gathered_bytes": root + k * sum(units), "reduced_bytes": sum(units)}


# ----------------------------------------------------------------------------- overlap metric


def no_union(comm, compute):
    total = sum(b - a for a, b in comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return hidden / total if total > 0 else 0.0


def compute_union_only(comm, compute):
    """Merges the compute intervals but not the comm ones: concurrent collectives count twice."""
    return no_union(comm, _union(compute))


def merge_in_given_order(intervals):
    out = []
    for a, b in intervals:                             # not sorted by start first
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def unsorted_merge(comm, compute):
    return no_union(merge_in_given_order(comm), merge_in_given_order(compute))


def exposed_fraction(comm, compute):
    """Merges both sides, then returns the part of the comm time NOT hidden."""
    return 1.0 - LAB07["overlap_fraction"][1](comm, compute) if comm else 0.0


def per_compute_time(comm, compute):
    """Merges both sides, then divides the hidden time by the compute time."""
    comm, compute = _union(comm), _union(compute)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    total = sum(b - a for a, b in compute)
    return hidden / total if comm and total > 0 else 0.0


def divides_by_zero(comm, compute):
    return LAB07["overlap_fraction"][1](comm, compute) if comm else 0.0 / sum(b - a for a, b in comm)


def test_overlap_fraction_verdicts(table):
    stub, solution = LAB07["overlap_fraction"]
    assert lab07.check_overlap_fraction(stub, table).mistake == "stub"
    right = lab07.check_overlap_fraction(solution, table)
    assert right.solved and "on all 16 (run, rank) pairs" in right.message
    assert lab07.check_overlap_fraction(no_union, table).mistake == "nested_counted_twice"
    assert lab07.check_overlap_fraction(compute_union_only, table).mistake == "concurrent_comm_counted_twice"
    assert lab07.check_overlap_fraction(divides_by_zero, table).mistake == "no_comm"
    # every interval the timelines give is in start order: only the hand-made case out of order shows it
    unsorted = lab07.check_overlap_fraction(unsorted_merge, table)
    assert unsorted.mistake == "unsorted_intervals" and "sort" in unsorted.hint
    # answers that merged both sides get the exercise's hint, not "merge the comm intervals"
    general = lab07.check_overlap_fraction(stub, table).hint
    for answer in (exposed_fraction, per_compute_time):
        verdict = lab07.check_overlap_fraction(answer, table)
        assert verdict.mistake == "wrong_fraction", answer.__name__
        assert verdict.hint == general, answer.__name__
    twice = lab07.check_overlap_fraction(compute_union_only, table)
    assert "merge the comm intervals into a union first" in twice.hint


def test_repeats_agree_only_when_counts_bytes_and_loss_repeat():
    class Run:
        def __init__(self, **changed):
            self.fields = {**dict.fromkeys(lab07.REPEATED_EXACTLY, 1), "step_ms": 5.0, **changed}

        def row(self, name):
            return self.fields

    first = Run()
    assert lab07.repeats_agree([first, Run(step_ms=9.0)], first, ["a", "b"])  # times may differ
    for key in lab07.REPEATED_EXACTLY:
        assert not lab07.repeats_agree([first, Run(**{key: 2})], first, ["a"])


def test_two_runs_are_drawn_on_one_time_scale_with_the_phase_table_in_ms(table):
    import matplotlib.pyplot as plt

    names = [row["name"] for row in table][:2]
    fig, text = lab07.draw_two_runs(table, *names)
    first, second = fig.axes[0].get_xlim(), fig.axes[1].get_xlim()
    assert first == second and first[0] == 0  # the shorter run looks shorter
    longest = max(max(e.t_end for e in table.timelines[n].events) - min(e.t_start for e in table.timelines[n].events)
                  for n in names)
    assert first[1] >= 1e3 * longest * 0.999  # both runs fit (ms)
    assert text.splitlines()[0].startswith("run (ms per rank)") and all(n in text for n in names)
    plt.close("all")
