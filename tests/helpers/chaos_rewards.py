"""Reward functions that misbehave in every way RewardRunner must survive (issue 23), plain
module-level functions (so the runner gives each a worker process), importable as
``"tests.helpers.chaos_rewards:<name>"``. Standard library only: a worker forked to replace a
killed one imports this module in milliseconds."""

import itertools
import math
import time

# Squarings of a 20,000-bit number, one C call that holds the GIL: ~30 s on a loaded 2-core
# machine (2,000 exponent bits took 5 s there), far past any timeout in these tests.
GIL_HOLDING_EXPONENT_BITS = 12_000


def hanging_reward(completions, **kwargs):
    time.sleep(3600)


def gil_holding_reward(completions, **kwargs):
    """Holds the GIL in one big-integer operation."""
    pow(3, 1 << GIL_HOLDING_EXPONENT_BITS, (1 << 20_000) + 1)
    return [0.0] * len(completions)


def big_number_reward(completions, **kwargs):
    """``gil_holding_reward`` for completions that say "big" (so that a first batch without
    it can start the worker)."""
    if any("big" in str(completion) for completion in completions):
        return gil_holding_reward(completions)
    return [0.0] * len(completions)


def raising_reward(completions, **kwargs):
    raise RuntimeError("chaos")


def wrong_length_reward(completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def nan_reward(completions, **kwargs):
    return [math.nan] * len(completions)


def huge_finite_reward(completions, **kwargs):
    """Finite in float64, inf in float32."""
    return [1e39] * len(completions)


def float32_max_reward(completions, **kwargs):
    """Finite in float32 alone; two of them sum past float32's range."""
    return [3e38] * len(completions)


def generator_reward(completions, **kwargs):
    """A generator that raises while it is read."""
    yield 1.0
    raise ValueError("generator broke")


def endless_generator_reward(completions, **kwargs):
    return itertools.count()


def big_int_reward(completions, **kwargs):
    """An int that no float holds."""
    return [10**400] * len(completions)


def non_list_reward(completions, **kwargs):
    return {"score": 1.0}


def constant_reward(completions, **kwargs):
    return [0.5] * len(completions)
