"""The benchmarks' timing arithmetic. The small suite's (torch_fused/bench/small.py): a ratio is
taken within each round and then summarized, so a drift of the host between rounds does not enter
it. A row timed against its floor (bench/common.py): the floor right before and right after it."""

from __future__ import annotations

import pytest

from torch_fused.bench.small import median, paired_ratio


def test_the_ratio_is_taken_within_each_round():
    # the medians are 2 and 2 (ratio 1), but within its round ours is 1/3, 2 and 1.5 of the base
    mid, lo, hi = paired_ratio([1.0, 2.0, 3.0], [3.0, 1.0, 2.0])
    assert mid == pytest.approx(1.5)
    assert (lo, hi) == pytest.approx((1 / 3, 2.0))


def test_a_host_drift_common_to_both_rows_leaves_the_ratio_alone():
    # the host's speed drifts 4x over the rounds, the same for both rows; ours is 0.8 of the base
    # in every round but one, which a burst of noise slowed to 4x the base
    base = [100.0, 300.0, 150.0, 120.0, 400.0]
    ours = [0.8 * b for b in base]
    ours[3] = 4 * base[3]
    mid, lo, hi = paired_ratio(ours, base)
    assert mid == pytest.approx(0.8)
    assert (lo, hi) == pytest.approx((0.8, 4.0))
    # the ratio of the medians pairs a fast round of one row with a slow round of the other
    assert median(ours) / median(base) == pytest.approx(1.6)


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([5.0, 1.0, 3.0]) == 3.0


def test_the_floor_is_timed_right_before_and_right_after_the_op():
    # bench/common.timed_against_floor, which distill.py, lm_head.py and agreement.py time their
    # rows with: floor, op, floor, in this order; the floor's ms is the mean of its two timings
    from torch_fused.bench.common import timed_against_floor

    calls = []
    floor_ms = iter([2.0, 4.0])

    def time_floor():
        calls.append("floor")
        return next(floor_ms)

    def time_op():
        calls.append("op")
        return 9.0

    assert timed_against_floor(time_op, time_floor) == (9.0, 3.0)
    assert calls == ["floor", "op", "floor"]
