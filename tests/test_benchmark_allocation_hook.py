"""benchmarks/allocation_hook.py: the replay of an allocation stream, on streams worked by hand
(building the C++ extension is left to the benchmark)."""

from _benchmarks import load_benchmark

allocation_hook = load_benchmark("allocation_hook")
replay = allocation_hook.replay


def test_peak_and_what_autograd_held_at_it():
    # event:    0: A+100  1: B+50  2: C+400  3: B-50  4: D+30  5: C-400  6: A-100
    addresses = [0xA, 0xB, 0xC, 0xB, 0xD, 0xC, 0xA]
    deltas = [100, 50, 400, -50, 30, -400, -100]
    save_a = (1, 0xA)      # A saved after its allocation (before event 1)
    save_c = (3, 0xC)      # C saved before event 3
    releases = [(5, save_c)]  # C released before it is freed (event 5); A never released
    peak, saved = replay(addresses, deltas, [save_a, save_c], releases)
    assert peak == 550                  # after event 2: A + B + C
    assert saved == 100                 # then only A was saved (C is saved from event 3 on)


def test_a_storage_saved_twice_counts_once_until_both_are_released():
    addresses = [0xA, 0xB, 0xB, 0xC]
    deltas = [100, 200, -200, 300]
    first, second = (1, 0xA), (1, 0xA)
    peak, saved = replay(addresses, deltas, [first, second], [(2, first)])
    assert (peak, saved) == (400, 100)  # after event 3: A (still saved once) + C


def test_storages_from_before_the_stream_are_skipped_and_frees_lower_the_total():
    addresses = [0xE, 0xA, 0xB]
    deltas = [-64, 100, 10]  # E existed before the stream; its free takes the total below the start
    peak, saved = replay(addresses, deltas, [(1, 0xE)], [])
    assert (peak, saved) == (46, 0)
