"""Intervals for RL quality results measured on several seeds.

A result is a list of seeds, each a list of per-prompt values (a gain, or a paired
difference of two methods on the same prompt). Prompts of one seed are not independent of
that seed's run, so the bootstrap is two-level: draw the seeds with replacement, then, inside
every drawn seed, its prompts with replacement; the statistic is the mean over the drawn
seeds of their prompt means. Its percentile interval covers the run-to-run spread (seeds)
and the prompt sample (prompts) together. Where every seed validates on the same prompts
(a task with few of them), the prompts are one sample shared by the seeds: the crossed
bootstrap draws the seeds and, once per resample, the prompts, the same for every seed.
``t_interval`` is the interval over seeds alone (of each seed's prompt mean).
"""

from __future__ import annotations

import statistics

import numpy as np


def seed_mean(per_seed: list[list[float]]) -> float:
    """The mean over seeds of each seed's mean over its prompts."""
    return statistics.mean(statistics.mean(values) for values in per_seed)


def bootstrap_interval(per_seed: list[list[float]], *, resamples: int = 10_000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """The two-level percentile bootstrap interval of ``seed_mean`` (see the module docstring)."""
    if not per_seed or any(len(values) == 0 for values in per_seed):
        raise ValueError("bootstrap_interval needs at least one seed, each with at least one prompt")
    generator = np.random.default_rng(seed)
    seeds = [np.asarray(values, dtype=float) for values in per_seed]
    statistic = np.zeros(resamples)
    for _ in range(len(seeds)):
        drawn = generator.integers(len(seeds), size=resamples)  # one seed per resample, per slot
        for index, values in enumerate(seeds):
            chosen = drawn == index
            count = int(chosen.sum())
            if count:
                prompts = generator.integers(len(values), size=(count, len(values)))
                statistic[chosen] += values[prompts].mean(axis=1)
    statistic /= len(seeds)
    tail = (1 - level) / 2
    low, high = np.quantile(statistic, [tail, 1 - tail])
    return float(low), float(high)


def crossed_bootstrap_interval(per_seed: list[list[float]], *, resamples: int = 10_000, level: float = 0.95,
                               seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of ``seed_mean`` when every seed's values are on the
    same prompts, in the same order: seeds and prompts drawn independently, crossed."""
    if not per_seed or len({len(values) for values in per_seed}) != 1 or not per_seed[0]:
        raise ValueError("crossed_bootstrap_interval needs seeds with values on the same, non-empty list of prompts")
    values = np.asarray(per_seed, dtype=float)  # seeds x prompts
    generator = np.random.default_rng(seed)
    seeds = np.empty((resamples, values.shape[0]), dtype=np.int64)
    prompts = np.empty((resamples, values.shape[1]), dtype=np.int64)
    for index in range(resamples):  # drawn in this order: each resample's seeds, then its prompts
        seeds[index] = generator.integers(values.shape[0], size=values.shape[0])
        prompts[index] = generator.integers(values.shape[1], size=values.shape[1])
    # Every resample's (seeds x prompts) block, one contiguous row each, averaged at once.
    statistic = values[seeds[:, :, None], prompts[:, None, :]].reshape(resamples, -1).mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(statistic, [tail, 1 - tail])
    return float(low), float(high)


def t_interval(per_seed: list[list[float]], *, level: float = 0.95) -> tuple[float, float]:
    """Student's t interval of ``seed_mean`` over the seeds' prompt means (n - 1 degrees of freedom)."""
    from scipy import stats

    means = [statistics.mean(values) for values in per_seed]
    if len(means) < 2:
        raise ValueError("t_interval needs at least two seeds")
    half = stats.t.ppf((1 + level) / 2, len(means) - 1) * statistics.stdev(means) / len(means) ** 0.5
    return statistics.mean(means) - half, statistics.mean(means) + half


def seeds_bootstrap_interval(per_seed: list[list[float]], *, crossed: bool = False) -> tuple[float, float]:
    """``crossed_bootstrap_interval`` where the seeds share their prompts, else ``bootstrap_interval``."""
    return (crossed_bootstrap_interval if crossed else bootstrap_interval)(per_seed)


def paired_points(first: list[list[float]], second: list[list[float]], *, crossed: bool = False) -> dict:
    """The per-prompt difference ``first - second`` of two methods on the same seeds and prompts,
    in points: its ``seed_mean``, the t interval over seeds (None with one seed) and the
    bootstrap interval (crossed where the seeds share their prompts)."""
    differences = [[a - b for a, b in zip(x, y)] for x, y in zip(first, second)]
    t_points = [100 * x for x in t_interval(differences)] if len(differences) > 1 else [None, None]
    return {"difference_points": 100 * seed_mean(differences), "t_points": t_points,
            "bootstrap_points": [100 * x for x in seeds_bootstrap_interval(differences, crossed=crossed)]}


def first_reaching(curve: list[tuple[int, float, float]], threshold: float) -> tuple[int, float] | tuple[None, None]:
    """(step, seconds) of the first validation point of ``curve`` — (step, value, seconds)
    entries in step order — whose value reaches ``threshold``; (None, None) if none does."""
    for step, value, seconds in curve:
        if value >= threshold:
            return step, seconds
    return None, None


def median_or_none(values: list[float | None]) -> float | None:
    """The median where a missing value (never reached) counts as infinitely large; None
    when that median is itself missing (at least half the values are)."""
    ordered = sorted((value is None, value or 0.0) for value in values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        missing, value = ordered[middle]
        return None if missing else value
    (low_missing, low), (high_missing, high) = ordered[middle - 1], ordered[middle]
    return None if low_missing or high_missing else (low + high) / 2
