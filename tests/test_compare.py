"""compare(): collective counts and bytes worked out by hand, memory of gathered units, refusal of
unfair comparisons, same losses for every implementation. One 2-rank launch (tests/_overlap_runs.py)."""

import pytest
import torch

from _overlap_runs import FP32, LAYER_NUMEL, LAYERS, ROOT_NUMEL, RUNS, results

MIB = 2 ** 20


@pytest.fixture(scope="module")
def table():
    return results()


# name -> (all-gathers, reduce-scatters) of one training step, from the wrapping:
#   per block: the root (embeddings, norm, output) once (the root keeps its parameters from forward to
#   backward), each block in forward and again in backward; one reduce-scatter per unit.
EXPECTED_COUNTS = {
    "block": (1 + 2 * LAYERS, 1 + LAYERS),
    "block sync": (1 + 2 * LAYERS, 1 + LAYERS),
    "block again": (1 + 2 * LAYERS, 1 + LAYERS),
    "explicit": (1 + 2 * LAYERS, 1 + LAYERS),
    "no prefetch": (1 + 2 * LAYERS, 1 + LAYERS),
    "two_blocks": (1 + 2 * (LAYERS // 2), 1 + LAYERS // 2),
    "offload two_blocks": (1 + 2 * (LAYERS // 2), 1 + LAYERS // 2),
    "model": (1, 1),
    "no reshard": (1 + LAYERS, 1 + LAYERS),  # blocks stay gathered from forward to backward
    "fsdp1 pre": (1 + 2 * LAYERS, 1 + LAYERS),
    "fsdp1 post": (1 + 2 * LAYERS, 1 + LAYERS),
    "fsdp1 none": (1 + 2 * LAYERS, 1 + LAYERS),
    "fsdp1 fwd": (1 + 2 * LAYERS, 1 + LAYERS),
    "fsdp1 model": (1, 1),
    "fused": (1 + 2 * LAYERS, 1 + LAYERS),
    "for_loop": (1 + 2 * LAYERS, 1 + LAYERS),
}


def test_every_run_has_a_hand_count():
    assert set(EXPECTED_COUNTS) == {r["name"] for r in RUNS}


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_collectives_per_step_match_the_wrapping(table, name):
    row = table.row(name)
    assert (row["all_gathers"], row["reduce_scatters"]) == EXPECTED_COUNTS[name]
    for rank in (0, 1):  # both ranks issue the same collectives
        assert len(table.timelines[name].comm_events(rank, "all_gather")) == EXPECTED_COUNTS[name][0]


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_bytes_equal_parameter_bytes(table, name):
    row = table.row(name)
    gathers, _ = EXPECTED_COUNTS[name]
    layer_gathers = gathers - 1 if name not in ("model", "fsdp1 model") else 0
    blocks_per_unit = 2 if "two_blocks" in name else 1
    expected = FP32 * (ROOT_NUMEL + layer_gathers * blocks_per_unit * LAYER_NUMEL)
    if name in ("model", "fsdp1 model"):
        expected = FP32 * (ROOT_NUMEL + LAYERS * LAYER_NUMEL)
    assert row["gathered_bytes"] == expected
    assert row["reduced_bytes"] == FP32 * (ROOT_NUMEL + LAYERS * LAYER_NUMEL)  # every gradient once
    assert row["num_params"] == ROOT_NUMEL + LAYERS * LAYER_NUMEL


def test_unsharded_memory_counts_the_gathered_units(table):
    def unsharded(name):
        return round(table.row(name)["peak_unsharded_mib"] * MIB)
    root, block = FP32 * ROOT_NUMEL, FP32 * LAYER_NUMEL
    assert unsharded("block") == root + block          # the root stays, one block at a time
    assert unsharded("two_blocks") == root + 2 * block
    assert unsharded("no reshard") == root + LAYERS * block  # everything stays until backward
    assert unsharded("model") == root + LAYERS * block
    # FSDP1 BACKWARD_PRE gathers the next block before freeing this one: one more unit
    assert unsharded("fsdp1 pre") == root + 2 * block
    assert unsharded("fsdp1 none") == root + block
    # forward_prefetch (backward prefetch off) follows the order recorded in the first step: in the
    # measured step forward holds the next block while this one computes
    assert unsharded("fsdp1 fwd") == root + 2 * block


# AdamW keeps exp_avg and exp_avg_sq of every parameter shard (float32) and a 4-byte `step` tensor
# per parameter: 9 per block (wq wk wv wo w1 w2 w3, two norms) and 3 in the root
PARAM_TENSORS = 9 * LAYERS + 3


def test_memory_is_measured_in_a_step_that_repeats(table):
    """The tracked step is one after AdamW created its state: at the moment of the peak the whole
    state is held (in the first step it appears only inside optimizer.step())."""
    half = FP32 * (ROOT_NUMEL + LAYERS * LAYER_NUMEL) // 2
    for row in table:
        assert row["at_peak"]["optimizer_state"] == 2 * half + 4 * PARAM_TENSORS, row["name"]
        assert row["at_peak"]["sharded_params"] == half, row["name"]
        assert round(row["peak_total_mib"] * MIB) == sum(row["at_peak"].values()), row["name"]


def test_each_run_is_measured_as_if_alone(table):
    """The last run repeats the first after fourteen other models were built and dropped in the
    same ranks: every category reads the same, and a whole-model unit holds exactly half the
    parameters (2 ranks, nothing padded), not the shards of runs before it."""
    first, again = table.row("block"), table.row("block again")
    assert again["peak_by_category"] == first["peak_by_category"]
    assert again["peak_total_mib"] == first["peak_total_mib"]
    half = FP32 * (ROOT_NUMEL + LAYERS * LAYER_NUMEL) // 2
    for name in ("model", "fsdp1 model", "block", "fsdp1 pre"):
        assert table.row(name)["peak_by_category"]["sharded_params"] == half, name


def test_losses_equal_plain_training_and_each_other(table):
    from fsdp_lab.models.data import global_batch
    from fsdp_lab.models.llama import Llama

    model = Llama("cpu", seed=0)
    batch = global_batch(512, 4, 32, seed=0, step=0)
    with torch.no_grad():
        reference = float(model(batch.input_ids, batch.labels).loss)
    for row in table:
        assert row["losses"][0] == pytest.approx(reference, rel=1e-5), row["name"]
        assert row["loss"] == pytest.approx(table.row("block")["loss"], rel=1e-4), row["name"]


def test_table_prints_every_run(table):
    text = table.format(timings=False)
    assert all(r["name"] in text for r in RUNS) and "step ms" not in text
    assert "step ms" in str(table)


def test_refuses_different_parameter_counts():
    from fsdp_lab.compare import compare
    with pytest.raises(ValueError, match="parameter count differs.*803,968.*allow_mismatch"):
        compare([{"name": "a"}, {"name": "b", "model": "cpu-tied"}])


def test_refuses_different_data():
    from fsdp_lab.compare import compare
    with pytest.raises(ValueError, match="data differs"):
        compare([{"name": "a"}, {"name": "b", "data_seed": 1}])


def test_bad_settings_are_named():
    from fsdp_lab.compare import RunConfig, compare
    with pytest.raises(ValueError, match="prefetch='backward_pre' is not one of"):
        RunConfig(implementation="fsdp2", prefetch="backward_pre")
    with pytest.raises(ValueError, match="two_blocks"):
        RunConfig(implementation="fsdp1", wrapping="two_blocks")
    with pytest.raises(TypeError, match="unknown run settings"):
        compare([{"wraping": "block"}])
    with pytest.raises(TypeError, match=r"a list of runs and got one run; pass compare\(\[run\]\)"):
        compare({"implementation": "fsdp2"})
    with pytest.raises(ValueError, match="unique"):
        compare([{}, {}])
    with pytest.raises(ValueError, match="steps must be >= 3"):
        compare([{}], steps=2)
    with pytest.raises(TypeError, match="cpu_offload must be True or False, got 'no'"):
        RunConfig(cpu_offload="no")
    # a world of 0 used to end in ZeroDivisionError from the divisibility check
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        compare([{}], world_size=0)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        compare([{}], seq_len=0)


@pytest.mark.gpu
def test_profiler_sees_collectives_in_timeline_order():
    import fsdp_lab
    results = fsdp_lab.launch(_profiler_rank, world_size=min(2, torch.cuda.device_count()))
    for order in results:
        assert len(order["profiler"]) == len(order["timeline"]) > 0


def _profiler_rank():
    from fsdp_lab.compare import RunConfig, build_run, profiler_collective_order
    from fsdp_lab.dist import current_device
    from fsdp_lab.models.data import global_batch
    model, optimizer, _, _ = build_run(RunConfig())
    batch = global_batch(512, 2, 32)

    def step():
        model(batch.input_ids.to(current_device()), batch.labels.to(current_device())).loss.backward()
        optimizer.step()
    return profiler_collective_order(step)
