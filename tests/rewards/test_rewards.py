import asyncio
import math
import threading
import time

import pytest

from lightning_logra.rewards import (
    RewardRunner,
    RewardWarning,
    answers_match,
    extract_answer,
    format_completions,
    load_reward,
    math_reward,
)
from lightning_logra.rewards import math as math_rewards


@pytest.fixture(params=["fallback", "math_verify"])
def comparison(request, monkeypatch):
    """Run a test with the built-in comparison and, where installed, with math_verify."""
    if request.param == "fallback":
        monkeypatch.setattr(math_rewards, "math_verify", None)
    elif math_rewards.math_verify is None:
        pytest.skip("math_verify is not installed (optional extra 'math')")
    return request.param


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So the total is \\boxed{42}.", "42"),
        ("First \\boxed{1}, then correcting: \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}} is the value", "\\frac{\\sqrt{2}}{2}"),
        ("Natalia sold 48/2 = 24 clips in May.\n48 + 24 = 72\n#### 72", "72"),
        ("#### 1,000\n", "1,000"),
        ("Adding them up, the answer is 17. I am confident.", "17"),
        ("The final answer is: $-\\frac{1}{3}$.", "-\\frac{1}{3}"),
        ("The answer is 3.5. Done", "3.5"),
        ("I think 12 + 5 gives 17, or maybe 18", "18"),
        ("He pays $1,250 in total", "1,250"),
        ("Truncated \\boxed{12", "12"),  # unbalanced box: falls back to the last number
        ("I don't know.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("predicted", "reference", "same"),
    [
        ("1,000", "1000", True),
        ("0.75", "3/4", True),
        ("\\frac{3}{4}", "0.75", True),
        ("\\dfrac{3}{4}", "3/4", True),
        ("-5.", "-5", True),
        ("$12", "12", True),
        ("12 dollars", "12", True),
        ("x = 5", "5", True),
        ("50\\%", "50", True),
        ("\\text{Yes}", "yes", True),
        ("-5", "5", False),
        ("0.33", "1/3", False),
        ("2x", "2", False),
        ("1,2", "12", False),
        ("seven", "7", False),
    ],
)
def test_answers_match(comparison, predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_math_verify_decides_symbolic_equivalence(comparison):
    # Beyond numbers and normalised strings only math_verify can tell.
    assert answers_match("x + 1", "1 + x") is (comparison == "math_verify")


COMPLETIONS = [
    ("Let me compute. 7 * 6 = 42. The answer is \\boxed{42}.", "42", 1.0),
    ("48 + 24 = 72\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K reference
    ("Half of the cake is left, the answer is 0.5.", "\\frac{1}{2}", 1.0),
    ("The total comes to $1,250.", "1250", 1.0),
    ("So we get \\boxed{-3}", "3", 0.0),
    ("I am not sure about this one.", "9", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("<|im_end|>", "4", 0.0),
    ("The answer is 12", 12, 1.0),  # numeric reference from a JSON row
]


def test_math_reward_on_a_table_of_completions(comparison):
    completions, answers, expected = zip(*COMPLETIONS)
    assert math_reward(list(completions), list(answers)) == list(expected)


def test_math_reward_rejects_bad_input():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        math_reward(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"completions\[1\] is NoneType"):
        math_reward(["1", None], ["1", "1"])


def test_math_reward_takes_answer_as_a_keyword_and_ignores_other_columns():
    assert math_reward(["\\boxed{4}", "5"], answer=["4", "4"], prompts=["a", "b"], task=["x", "y"]) == [1.0, 0.0]


def test_math_reward_reads_conversational_completions():
    completions = [[{"role": "assistant", "content": "so \\boxed{7}"}], [{"role": "assistant", "content": "8"}]]
    assert math_reward(completions, answer=["7", "7"]) == [1.0, 0.0]


def test_math_reward_returns_none_where_the_row_has_no_answer():
    assert math_reward(["\\boxed{3}", "\\boxed{3}"], answer=[None, "3"]) == [None, 1.0]


def test_math_reward_needs_exactly_one_way_of_passing_answers():
    with pytest.raises(TypeError, match="needs the reference answers"):
        math_reward(["1"])
    with pytest.raises(TypeError, match="not both"):
        math_reward(["1"], ["1"], answer=["1"])


def test_format_completions_is_conversational_per_row():
    prompts = ["What is 1 + 1?", [{"role": "user", "content": "What is 2 + 2?"}]]
    assert format_completions(prompts, ["2", "4"]) == ["2", [{"role": "assistant", "content": "4"}]]
    with pytest.raises(ValueError, match="2 prompts but 1 completion texts"):
        format_completions(prompts, ["2"])


# Reward functions used by the runner tests (also loaded by "module:function" spec).
def length_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def raising_reward(completions, **kwargs):
    raise ValueError("reward crashed")


RELEASE = threading.Event()


def hanging_reward(completions, **kwargs):
    RELEASE.wait(timeout=30)
    return [0.5] * len(completions)


def short_reward(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def malformed_reward(completions, **kwargs):
    return [{"nan": math.nan, "text": "high", "none": None}.get(c, 2.0) for c in completions]


def only_long_reward(completions, **kwargs):
    return [1.0 if len(c) > 3 else None for c in completions]


@pytest.fixture
def release_hung_workers():
    RELEASE.clear()
    yield
    RELEASE.set()


def test_load_reward_imports_specs():
    assert load_reward("lightning_logra.rewards:math_reward") is math_reward
    with pytest.raises(ValueError, match="must look like"):
        load_reward("lightning_logra.rewards.math_reward")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module'"):
        load_reward("no_such_module:fn")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        load_reward("lightning_logra.rewards:missing")
    with pytest.raises(TypeError, match="not callable"):
        load_reward("lightning_logra.rewards.math:NUMBER")


def test_runner_weights_and_sums_scores():
    runner = RewardRunner(["lightning_logra.rewards:math_reward", length_reward], weights=[1.0, 0.5])
    scores = runner(["\\boxed{4}", "\\boxed{5}"], answer=["4", "4"])
    assert scores.total == pytest.approx([1.0 + 0.5 * 0.9, 0.0 + 0.5 * 0.9])
    assert (scores.failures, scores.unscored) == (0, 0)


def test_runner_reports_raw_unweighted_scores_per_function():
    runner = RewardRunner([math_reward, length_reward], weights=[2.0, 0.5])
    scores = runner(["\\boxed{4}", "\\boxed{5}"], answer=["4", "4"])
    assert scores.per_function == {"math_reward": [1.0, 0.0], "length_reward": [0.9, 0.9]}


def test_runner_names_functions_of_the_same_name_apart():
    runner = RewardRunner([math_reward, length_reward, "lightning_logra.rewards:math_reward"])
    assert runner.names == ["math_reward", "length_reward", "math_reward_2"]


def test_runner_calls_each_function_once_per_batch():
    calls = []

    def counting_reward(completions, **kwargs):
        calls.append(len(completions))
        return [0.0] * len(completions)

    RewardRunner([counting_reward])(["a", "b", "c", "d"], answer=["1"] * 4)
    assert calls == [4]


def test_runner_passes_completions_and_columns_as_keywords():
    received = {}

    def recording_reward(completions, **kwargs):
        received.update(kwargs, completions=completions)
        return [0.0, 0.0]

    columns = {
        "prompts": ["Hi", [{"role": "user", "content": "Yo"}]],
        "completion_ids": [[1, 2], [3]],
        "answer": ["1", None],
        "task": ["math", "chat"],
    }
    RewardRunner([recording_reward])(["a", [{"role": "assistant", "content": "b"}]], **columns)
    assert received == {"completions": ["a", [{"role": "assistant", "content": "b"}]], **columns}


def test_runner_skips_none_in_the_weighted_sum():
    scores = RewardRunner([only_long_reward, length_reward], weights=[3.0, 1.0])(["abcd", "ab"])
    assert scores.total == pytest.approx([3.0 + 0.4, 0.2])
    assert scores.per_function["only_long_reward"] == [1.0, None]
    assert (scores.failures, scores.unscored) == (0, 0)


def test_runner_scores_a_sample_no_function_scored_zero_and_counts_it():
    scores = RewardRunner([only_long_reward, math_reward])(["abcd", "ab"], answer=[None, None])
    assert scores.total == [1.0, 0.0]
    assert (scores.failures, scores.unscored) == (0, 1)


def test_runner_fails_the_batch_of_a_raising_function():
    runner = RewardRunner([raising_reward, length_reward])
    message = "'raising_reward' raised ValueError: reward crashed; its 3 scores count as 0"
    with pytest.warns(RewardWarning, match=message):
        scores = runner(["a", "bb", "ccc"])
    assert scores.total == pytest.approx([0.1, 0.2, 0.3])
    assert scores.per_function["raising_reward"] == [None, None, None]
    assert (scores.failures, scores.unscored) == (3, 0)


def test_runner_abandons_a_hanging_function_after_the_timeout(release_hung_workers):
    runner = RewardRunner([hanging_reward, length_reward], timeout_s=0.2)
    runner.start()  # worker processes: their start is not part of the timeout
    started = time.monotonic()
    with pytest.warns(RewardWarning, match=r"'hanging_reward' did not return within timeout_s=0.2 s; its 2 scores"):
        scores = runner(["a", "b"])
    assert time.monotonic() - started < 2.0
    assert scores.total == pytest.approx([0.1, 0.1])
    assert scores.failures == 2


def test_runner_fails_the_batch_of_a_wrong_length_output():
    with pytest.warns(RewardWarning, match="'short_reward' returned 2 scores for 3 completions; its 3 scores count"):
        scores = RewardRunner([short_reward])(["a", "b", "c"])
    assert scores.per_function == {"short_reward": [None, None, None]}
    assert scores.failures == 3


def test_runner_fails_only_the_scores_that_are_not_finite_numbers():
    with pytest.warns(RewardWarning, match=r"'malformed_reward' returned nan for sample 0 .*; 2 of its 4 scores count"):
        scores = RewardRunner([malformed_reward])(["nan", "ok", "text", "none"])
    assert scores.per_function == {"malformed_reward": [None, 2.0, None, None]}
    assert scores.total == [0.0, 2.0, 0.0, 0.0]
    assert (scores.failures, scores.unscored) == (2, 1)


def test_runner_reports_a_failure_of_a_function_once(recwarn):
    runner = RewardRunner([raising_reward])
    runner(["a"])
    scores = runner(["a", "b"])
    assert len([w for w in recwarn if issubclass(w.category, RewardWarning)]) == 1
    assert scores.failures == 2  # still counted every batch


def test_runner_runs_async_functions_concurrently():
    spans = {}

    def timed(name):
        async def reward(completions, **kwargs):
            started = time.monotonic()
            await asyncio.sleep(0.3)
            spans[name] = (started, time.monotonic())
            return [1.0] * len(completions)

        reward.__name__ = name
        return reward

    scores = RewardRunner([timed("first"), timed("second"), length_reward])(["ab"])
    assert scores.total == pytest.approx([2.2])
    (start_a, end_a), (start_b, end_b) = spans.values()
    assert max(start_a, start_b) < min(end_a, end_b)  # both were sleeping at the same time


def test_runner_fails_the_batch_of_a_hanging_async_function():
    async def slow_reward(completions, **kwargs):
        await asyncio.sleep(30)

    with pytest.warns(RewardWarning, match="'slow_reward' did not return within timeout_s=0.2 s"):
        scores = RewardRunner([slow_reward, length_reward], timeout_s=0.2)(["abc"])
    assert scores.total == pytest.approx([0.3])
    assert scores.failures == 1


def test_runner_reports_an_async_function_that_raises_timeout_error_as_raised():
    async def impatient_reward(completions, **kwargs):
        raise TimeoutError("judge unreachable")

    with pytest.warns(RewardWarning, match="'impatient_reward' raised TimeoutError: judge unreachable"):
        RewardRunner([impatient_reward])(["a"])


def test_runner_rejects_bad_configuration():
    with pytest.raises(ValueError, match="1 weights for 2 reward functions"):
        RewardRunner([length_reward, length_reward], weights=[1.0])
    with pytest.raises(ValueError, match=r"reward_weights\[1\] must be finite, got inf"):
        RewardRunner([length_reward, length_reward], weights=[1.0, math.inf])
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardRunner([length_reward], timeout_s=0)


def test_runner_rejects_columns_not_aligned_with_completions():
    with pytest.raises(ValueError, match="reward column 'answer' has 2 values for 3 completions"):
        RewardRunner([length_reward])(["a", "b", "c"], answer=["1", "2"])
    with pytest.raises(TypeError, match="reward column 'answer' must be a list aligned with completions, got str"):
        RewardRunner([length_reward])(["a"], answer="1")


@pytest.fixture
def math_verify_log_levels():
    """trl's accuracy_reward raises math_verify's log levels when run off the main thread;
    put them back for the tests that follow."""
    import logging

    loggers = [logging.getLogger(name) for name in ("math_verify.parser", "math_verify.grader")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def test_trl_think_format_reward_runs_through_the_runner():
    runner = RewardRunner(["trl.rewards:think_format_reward"], weights=[0.5])
    completions = format_completions([[{"role": "user", "content": "Q"}]] * 2, ["<think>hm</think>4", "4"])
    scores = runner(completions, prompts=[[{"role": "user", "content": "Q"}]] * 2, answer=["4", "4"])
    assert scores.per_function == {"think_format_reward": [1.0, 0.0]}
    assert scores.total == [0.5, 0.0]


def test_trl_accuracy_reward_reads_the_solution_column(math_verify_log_levels):
    from trl.rewards import accuracy_reward

    prompts = [[{"role": "user", "content": "What is 1/3?"}]] * 2
    texts = ["My answer is \\boxed{\\frac{1}{3}}", "My answer is \\boxed{\\frac{1}{2}}"]
    completions = format_completions(prompts, texts)
    scores = RewardRunner([accuracy_reward])(completions, prompts=prompts, solution=["\\frac{1}{3}"] * 2)
    assert scores.per_function == {"accuracy_reward": [1.0, 0.0]}
    assert scores.failures == 0


def test_math_verify_timeout_notice_is_not_shown(monkeypatch, caplog, capsys):
    # math_verify logs a one-time "Timeout is disabled ..." notice from parse and from verify
    # when their timeouts are off, as math_reward's are on purpose off the main thread, where
    # math_verify's SIGALRM timeouts cannot work (RewardRunner's timeout applies there).
    import logging

    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)  # not yet shown this process
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    caplog.set_level("DEBUG")
    scores = []
    worker = threading.Thread(target=lambda: scores.append(math_reward(["so \\boxed{\\sqrt{4}}"], ["2"])))
    worker.start()
    worker.join()
    assert scores == [[1.0]]  # only math_verify can tell
    assert math_verify.parser.TIMEOUT_WARNING_SHOWN and math_verify.grader.TIMEOUT_WARNING_SHOWN  # reached
    assert not [record for record in caplog.records if "Timeout is disabled" in record.getMessage()]
    captured = capsys.readouterr()
    assert "Timeout is disabled" not in captured.err + captured.out
    # math_verify's other messages still come through
    logging.getLogger("math_verify.parser").warning("Timeout during parsing: x")
    assert "Timeout during parsing: x" in [record.getMessage() for record in caplog.records]
