import math
import threading
import time

import pytest

from lightning_logra.rewards import RewardRunner, answers_match, extract_answer, load_reward, math_reward
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


# Reward functions used by the runner tests (also loaded by "module:function" spec).
def length_reward(completions, answers):
    return [len(c) / 10 for c in completions]


def raising_reward(completions, answers):
    if "boom" in completions[0]:
        raise RuntimeError("reward crashed")
    return [1.0]


RELEASE = threading.Event()


def hanging_reward(completions, answers):
    if "hang" in completions[0]:
        RELEASE.wait(timeout=30)
    return [0.5]


def malformed_reward(completions, answers):
    return {"nan": [math.nan], "two": [1.0, 1.0], "none": [], "text": ["high"]}.get(completions[0], [2.0])


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


def test_runner_weights_and_sums_rewards():
    runner = RewardRunner(["lightning_logra.rewards:math_reward", length_reward], weights=[1.0, 0.5])
    rewards, failures = runner(["\\boxed{4}", "\\boxed{5}"], ["4", 4])
    assert rewards == pytest.approx([1.0 + 0.5 * 0.9, 0.0 + 0.5 * 0.9])
    assert failures == 0


def test_runner_scores_a_raising_sample_zero_and_counts_it():
    runner = RewardRunner([raising_reward, length_reward])
    rewards, failures = runner(["fine", "boom", "fine"], ["1", "1", "1"])
    assert rewards == pytest.approx([1.4, 0.4, 1.4])
    assert failures == 1


def test_runner_abandons_a_hanging_sample_after_the_timeout(release_hung_workers):
    runner = RewardRunner([hanging_reward], timeout_s=0.2)
    started = time.monotonic()
    rewards, failures = runner(["a", "hang", "b", "hang", "c"], ["1"] * 5)
    elapsed = time.monotonic() - started
    assert rewards == [0.5, 0.0, 0.5, 0.0, 0.5]
    assert failures == 2
    assert 0.4 <= elapsed < 2.0  # two timeouts, and the samples after each hang still scored


def test_runner_counts_malformed_outputs():
    runner = RewardRunner([malformed_reward])
    rewards, failures = runner(["nan", "two", "none", "text", "ok"], ["1"] * 5)
    assert rewards == [0.0, 0.0, 0.0, 0.0, 2.0]
    assert failures == 4


def test_runner_rejects_bad_configuration():
    with pytest.raises(ValueError, match="1 weights for 2 reward functions"):
        RewardRunner([length_reward, length_reward], weights=[1.0])
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    with pytest.raises(ValueError, match="3 completions but 2 answers"):
        RewardRunner([length_reward])(["a", "b", "c"], ["1", "2"])


def test_math_verify_timeout_notice_is_not_shown(monkeypatch, caplog, capsys):
    # math_verify logs a one-time "Timeout is disabled ..." notice from parse and from verify
    # when their timeouts are off, as math_reward's are on purpose (RewardRunner enforces one).
    import logging

    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)  # not yet shown this process
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    caplog.set_level("DEBUG")
    assert math_reward(["so \\boxed{\\sqrt{4}}"], ["2"]) == [1.0]  # only math_verify can tell
    assert math_verify.parser.TIMEOUT_WARNING_SHOWN and math_verify.grader.TIMEOUT_WARNING_SHOWN  # reached
    assert not [record for record in caplog.records if "Timeout is disabled" in record.getMessage()]
    captured = capsys.readouterr()
    assert "Timeout is disabled" not in captured.err + captured.out
    # math_verify's other messages still come through
    logging.getLogger("math_verify.parser").warning("Timeout during parsing: x")
    assert "Timeout during parsing: x" in [record.getMessage() for record in caplog.records]
