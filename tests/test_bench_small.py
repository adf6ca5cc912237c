"""The small suite's timing arithmetic (torch_fused/bench/small.py): a ratio is taken within each
round and then summarized, so a drift of the host between rounds does not enter it."""

from __future__ import annotations

import pytest

from torch_fused.bench.small import median, paired_ratio


def test_the_ratio_is_taken_within_each_round():
    # the medians are 2 and 2 (ratio 1), but within its round ours is 1/3, 2 and 1.5 of the base
    mid, lo, hi = paired_ratio([1.0, 2.0, 3.0], [3.0, 1.0, 2.0])
    assert mid == pytest.approx(1.5)
    assert (lo, hi) == pytest.approx((1 / 3, 2.0))


def test_a_host_drift_common_to_both_rows_leaves_the_ratio_alone():
    base = [100.0, 300.0, 150.0, 120.0, 400.0]
    ours = [0.8 * b for b in base]
    assert paired_ratio(ours, base) == pytest.approx((0.8, 0.8, 0.8))


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([5.0, 1.0, 3.0]) == 3.0
