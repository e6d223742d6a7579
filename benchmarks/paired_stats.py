"""Intervals for RL quality results measured on several seeds, each on its own prompts.

A result is a list of seeds, each a list of per-prompt values (a gain, or a paired
difference of two methods on the same prompt). Prompts of one seed are not independent of
that seed's run, so the bootstrap is two-level: draw the seeds with replacement, then, inside
every drawn seed, its prompts with replacement; the statistic is the mean over the drawn
seeds of their prompt means. Its percentile interval covers the run-to-run spread (seeds)
and the prompt sample (prompts) together.
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
