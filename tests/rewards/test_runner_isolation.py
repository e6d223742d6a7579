"""RewardRunner against misbehaving rewards (issue 23): GIL-holding work, outputs that fail
while read, scores past float32's range, repeated timeouts."""

import itertools
import threading
import time

import pytest

from lightning_logra.rewards import RewardRunner, RewardWarning, math_reward
from tests.helpers import chaos_rewards as chaos


def test_runner_kills_a_function_that_holds_the_gil_past_the_timeout():
    runner = RewardRunner([chaos.big_number_reward, chaos.constant_reward], timeout_s=1.0)
    runner(["small", "small"])  # starts the workers
    started = time.monotonic()
    with pytest.warns(RewardWarning, match="'big_number_reward' did not return within timeout_s=1.0 s"):
        scores = runner(["big", "small"])
    assert time.monotonic() - started < 1.0 + 4.0  # the function alone would take ~30 s
    assert scores.total == [0.5, 0.5]
    assert scores.failures == 2
    assert runner(["small", "small"]).failures == 0  # a fresh worker takes the next batch


@pytest.mark.parametrize("answer", ["1e9999999", "10^{10^{10}}", "10**10**10", "2^{9999999}", "99999999!",
                                    "1" * 5000])
def test_math_reward_never_computes_an_unbounded_number(answer):
    started = time.monotonic()
    assert math_reward([f"so \\boxed{{{answer}}}"], ["5"]) == [0.0]
    assert time.monotonic() - started < 2.0
    assert math_reward([f"so \\boxed{{{answer}}}"], [answer]) == [1.0]  # the same text still matches


def test_math_reward_still_compares_bounded_powers_and_numbers():
    assert math_reward(["\\boxed{2^{10}}", "\\boxed{1e3}", "\\boxed{5!}"], ["1024", "1000", "120"]) == [1.0] * 3


@pytest.mark.parametrize(("function", "problem"), [
    (chaos.big_int_reward, "raised OverflowError while its output was read"),
    (chaos.generator_reward, "raised ValueError while its output was read: generator broke"),
    (chaos.endless_generator_reward, "returned more than 2 scores for 2 completions"),
    (lambda completions, **kwargs: itertools.count(), "returned more than 2 scores for 2 completions"),
    (lambda completions, **kwargs: [10**400] * len(completions), "raised OverflowError while its output was read"),
], ids=["big-int", "raising-generator", "endless-generator", "endless-generator-in-a-thread", "big-int-in-a-thread"])
def test_runner_reads_outputs_where_the_function_ran(function, problem):
    runner = RewardRunner([function, chaos.constant_reward], timeout_s=1.0)
    with pytest.warns(RewardWarning, match=problem):
        scores = runner(["a", "b"])
    assert scores.total == [0.5, 0.5]
    assert scores.failures == 2


def test_runner_refuses_scores_past_float32_range():
    runner = RewardRunner([chaos.huge_finite_reward, chaos.constant_reward])
    with pytest.warns(RewardWarning, match=r"'huge_finite_reward' returned 1e\+39 for sample 0 .*float32"):
        scores = runner(["a", "b"])
    assert scores.per_function["huge_finite_reward"] == [None, None]
    assert (scores.total, scores.failures) == ([0.5, 0.5], 2)


def test_runner_fails_a_weighted_total_past_float32_range():
    runner = RewardRunner([chaos.float32_max_reward, chaos.constant_reward], weights=[2.0, 1.0])
    with pytest.warns(RewardWarning, match=r"weighted sum of the reward functions gave sample 0 the total 6e\+38, not finite in float32"):
        scores = runner(["a", "b"])
    assert scores.per_function["float32_max_reward"] == [3e38, 3e38]
    assert (scores.total, scores.failures, scores.unscored) == ([0.0, 0.0], 2, 0)


def test_runner_stops_after_consecutive_timeouts_of_one_function():
    release, hang = threading.Event(), threading.Event()

    def sometimes_hanging_reward(completions, **kwargs):
        if hang.is_set():
            release.wait(30)
        return [1.0] * len(completions)

    runner = RewardRunner([sometimes_hanging_reward], timeout_s=0.1, max_consecutive_timeouts=2)
    try:
        hang.set()
        with pytest.warns(RewardWarning):
            runner(["a"])
        hang.clear()
        assert runner(["a"]).failures == 0  # an answer resets the count
        hang.set()
        runner(["a"])
        with pytest.raises(RuntimeError, match=r"'sometimes_hanging_reward' did not return .* on 2 batches in a row"):
            runner(["a"])
    finally:
        release.set()


def test_runner_rejects_a_bad_timeout_limit():
    with pytest.raises(ValueError, match="max_consecutive_timeouts must be an integer >= 1, got 0"):
        RewardRunner([chaos.constant_reward], max_consecutive_timeouts=0)



def test_math_reward_keeps_math_verify_timeouts_on_in_a_main_thread(monkeypatch):
    from lightning_logra.rewards import math as math_rewards

    if math_rewards.math_verify is None:
        pytest.skip("math_verify is not installed (optional extra 'math')")
    calls = []
    real_parse = math_rewards.math_verify.parse
    monkeypatch.setattr(math_rewards.math_verify, "parse", lambda *args, **kwargs: calls.append(kwargs) or real_parse(*args, **kwargs))
    math_reward(["so \\boxed{\\sqrt{4}}"], ["2"])
    worker = threading.Thread(target=math_reward, args=(["so \\boxed{\\sqrt{4}}"], ["2"]))
    worker.start()
    worker.join()
    assert calls == [{}, {}, {"parsing_timeout": None}, {"parsing_timeout": None}]
