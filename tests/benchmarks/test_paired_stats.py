"""The quality benchmark's statistics (benchmarks.paired_stats)."""

import random
import statistics

import pytest

from benchmarks.paired_stats import (bootstrap_interval, crossed_bootstrap_interval, first_reaching, median_or_none,
                                     paired_points, seed_mean, t_interval)


def test_identical_values_give_a_point_interval_at_their_value():
    low, high = bootstrap_interval([[0.25] * 5, [0.25] * 7], resamples=200)
    assert low == pytest.approx(0.25) and high == pytest.approx(0.25)


def test_the_interval_holds_the_mean_and_widens_with_the_spread_between_seeds():
    generator = random.Random(1)
    close = [[generator.gauss(0.1, 0.3) for _ in range(96)] for _ in range(3)]
    apart = [[value + shift for value in values] for values, shift in zip(close, (-0.2, 0.0, 0.2))]
    low, high = bootstrap_interval(close)
    assert low < seed_mean(close) < high
    wide_low, wide_high = bootstrap_interval(apart)
    assert wide_high - wide_low > 2 * (high - low)


def test_the_interval_covers_the_true_mean_about_95_percent_of_the_time():
    # 200 experiments of 5 seeds x 30 prompts from one normal distribution (mean 0): a 95%
    # interval misses 0 in about 10 of them; binomial(200, 0.05) is within 3..20 with
    # probability > 0.99, and the bootstrap percentile interval runs a little narrow.
    generator = random.Random(0)
    misses = 0
    for experiment in range(200):
        data = [[generator.gauss(0, 1) for _ in range(30)] for _ in range(5)]
        low, high = bootstrap_interval(data, resamples=1000, seed=experiment)
        misses += not low <= 0 <= high
    assert 3 <= misses <= 25


def test_seed_mean_weights_seeds_equally():
    assert seed_mean([[1.0], [0.0, 0.0, 0.0]]) == 0.5
    assert seed_mean([[1.0, 0.0], [0.5]]) == statistics.mean([0.5, 0.5])


def test_first_reaching_and_medians_of_runs_that_never_get_there():
    curve = [(6, 0.2, 60.0), (12, 0.5, 120.0), (18, 0.4, 180.0)]
    assert first_reaching(curve, 0.45) == (12, 120.0)
    assert first_reaching(curve, 0.9) == (None, None)
    assert median_or_none([6, None, 12]) == 12  # the missing one counts as slowest
    assert median_or_none([6, None, None]) is None
    assert median_or_none([6, 12]) == 9 and median_or_none([6, None]) is None


def test_empty_seeds_are_refused():
    with pytest.raises(ValueError, match="at least one prompt"):
        bootstrap_interval([[0.1], []])


def test_paired_points_are_the_per_prompt_differences_in_points():
    first, second = [[1.0, 0.5, 0.0], [0.5, 0.5, 1.0]], [[0.5, 0.5, 0.5], [0.0, 0.5, 0.5]]
    differences = [[0.5, 0.0, -0.5], [0.5, 0.0, 0.5]]
    stats = paired_points(first, second)
    assert stats["difference_points"] == pytest.approx(100 * seed_mean(differences))
    assert stats["t_points"] == pytest.approx([100 * x for x in t_interval(differences)])
    assert stats["bootstrap_points"] == pytest.approx([100 * x for x in bootstrap_interval(differences)])
    crossed = paired_points(first, second, crossed=True)
    assert crossed["bootstrap_points"] == pytest.approx([100 * x for x in crossed_bootstrap_interval(differences)])
    assert crossed["bootstrap_points"] != stats["bootstrap_points"]  # these data tell the two apart
    assert paired_points(first[:1], second[:1])["t_points"] == [None, None]  # one seed: no t interval
