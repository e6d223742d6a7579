"""RewardConfig: the reward functions GRPOModule scores with, checked when built, naming the
field and what it accepts."""

import dataclasses
import re

import pytest

from lightning_logra.rewards import RewardConfig, RewardRunner, math_reward


def refuses(allowed: str, **values):
    (field, value), = values.items()
    pattern = rf"RewardConfig\.{field} = {re.escape(repr(value))} is invalid: must be {re.escape(allowed)}"
    with pytest.raises(ValueError, match=pattern):
        RewardConfig(**values)


def test_the_default_is_the_built_in_math_reward():
    assert dataclasses.asdict(RewardConfig()) == dict(
        functions=["lightning_logra.rewards.math:math_reward"], weights=None, timeout_s=10.0, max_consecutive_timeouts=3,
        model_device=None, model_dtype=None, model_batch_size=16, model_max_length=None)


def test_functions_are_import_paths_or_callables():
    assert RewardConfig(functions=["my_rewards:score", math_reward]).functions[1] is math_reward
    allowed = "a non-empty list of import paths 'module:function', reward model folders or hub ids (or callables)"
    refuses(allowed, functions=[])
    refuses(allowed, functions=[""])
    refuses(allowed, functions="lightning_logra.rewards.math:math_reward")


def test_weights_are_finite_numbers_one_per_function():
    assert RewardConfig(functions=["a:f", "b:g"], weights=[1.0, 0.5]).weights == [1.0, 0.5]
    with pytest.raises(ValueError, match=r"RewardConfig\.weights = \[1.0, 0.5\] is invalid: must be None or a list "
                                         r"of finite numbers, one per function \(1\)"):
        RewardConfig(weights=[1.0, 0.5])
    refuses("None or a list of finite numbers, one per function (1)", weights=[float("inf")])
    refuses("None or a list of finite numbers, one per function (1)", weights=[True])


def test_a_reward_timeout_past_a_day_is_refused_at_construction():
    # threading's waits raise OverflowError past threading.TIMEOUT_MAX, at the first batch.
    refuses("a finite number > 0 and <= 86400 (24 h)", timeout_s=1e10)
    refuses("a finite number > 0 and <= 86400 (24 h)", timeout_s=float("inf"))
    with pytest.raises(ValueError, match=r"timeout_s must be > 0 and <= 86400 \(24 h\), got 10000000000.0"):
        RewardRunner(["tests.helpers.grpo:zero_reward"], timeout_s=1e10)


def test_at_least_one_timeout_is_allowed_in_a_row():
    refuses("an integer >= 1", max_consecutive_timeouts=0)
    refuses("an integer >= 1", max_consecutive_timeouts=True)
