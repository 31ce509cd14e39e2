"""The slowdown detector's median and mean answer as the standard library's do."""

from __future__ import annotations

import random
import statistics

import pytest

from gpuwatchd.health.slowdowns import averages


def test_median_and_mean_match_statistics_on_odd_even_and_repeated_values() -> None:
    rng = random.Random(7)
    for n in range(1, 20):
        for _ in range(20):
            values = [
                rng.choice((0.0, 1.0, rng.random(), rng.uniform(-1e6, 1e6))) for _ in range(n)
            ]
            assert averages.median(values) == statistics.median(values)
            assert averages.median(iter(values)) == statistics.median(values)
            assert averages.mean(values) == statistics.fmean(values)


def test_no_values_is_an_error_not_a_number() -> None:
    with pytest.raises(ValueError):
        averages.median([])
    with pytest.raises(ValueError):
        averages.mean(iter(()))
