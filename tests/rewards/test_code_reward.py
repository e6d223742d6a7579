"""code_execution_reward: the code it takes from a completion, the fraction of tests passed,
its rows' format, batches run side by side, and its use by import path."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lightning_logra.rewards import RewardRunner, RewardWarning, code_execution_reward, extract_code
from lightning_logra.rewards import code as code_reward
from lightning_logra.rewards.code import usable_cpus
from lightning_logra.rewards.code_tests import problem_in_tests
from lightning_logra.sandbox import SandboxLimits, namespaces_problem

NAMESPACES = namespaces_problem()
needs_sandbox = pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
SQUARE = "def f(x):\n    return x * x\n"
SQUARE_TESTS = ["assert f(2) == 4", "assert f(-3) == 9", "assert f(0) == 0", "assert f(5) == 25"]


@pytest.mark.parametrize(("text", "code"), [
    ("Here:\n```python\ndef f(x):\n    return 1\n```\nDone.", "def f(x):\n    return 1\n"),
    ("```py\na = 1\n```\n```python\nb = 2\n```\n```\nc = 3\n```", "b = 2\n"),  # the last python block
    ("```\nfirst = 1\n```\ntext\n```\nlast = 2\n```", "last = 2\n"),  # else the last block
    ("```python\ndef f(x):\n    return x +", "def f(x):\n    return x +"),  # cut at max_new_tokens
    ("def f(x):\n    return x", "def f(x):\n    return x"),  # no fence: the text, as it compiles
    ("The answer is f(x) = x squared.", None),
    ("", None),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


@needs_sandbox
def test_the_score_is_the_fraction_of_tests_passed():
    half_right = "```python\ndef f(x):\n    return x * x if x > 0 else 0\n```"  # f(-3) wrong, f(0), f(2), f(5) right
    completions = [f"```python\n{SQUARE}```", half_right, "```python\nraise ValueError\n```", "no code here"]
    assert code_execution_reward(completions, tests=[SQUARE_TESTS] * 4) == [1.0, 0.75, 0.0, 0.0]


@needs_sandbox
def test_input_output_pairs_call_the_named_function():
    tests = [[{"function": "add", "input": [1, 2], "output": 3}, {"function": "add", "input": [[1], [2]],
                                                                   "output": [1, 2]},
              {"function": "add", "input": [1, 1], "output": 3}]]
    assert code_execution_reward(["def add(a, b):\n    return a + b"], tests=tests) == [pytest.approx(2 / 3)]


@needs_sandbox
def test_rows_without_tests_are_not_scored_and_conversational_completions_work():
    completions = [[{"role": "assistant", "content": f"```python\n{SQUARE}```"}], "anything"]
    assert code_execution_reward(completions, tests=[SQUARE_TESTS, None]) == [1.0, None]


@needs_sandbox
def test_a_forged_report_of_the_wrong_shape_scores_0():
    """A program that writes its own report and exits before the tests run gets nothing
    from a report that does not have one 0/1 per test."""
    forged = "```python\nimport os\nopen('report.txt', 'w').write('[1]')\nos._exit(0)\n```"
    assert code_execution_reward([forged], tests=[SQUARE_TESTS]) == [0.0]


@pytest.mark.parametrize(("tests", "problem"), [
    ("assert f(1) == 1", r"must be None or a non-empty list, got str"),
    ([], r"must be None or a non-empty list"),
    ([3], r"item 0 must be a string or a dict, got int"),
    (["  "], r"item 0 is an empty string"),
    (["assert f(1 == 1"], r"item 0 is not Python: SyntaxError"),
    (["assert f(x) == 1"], r"item 0 \('assert f\(x\) == 1'\) is not of the form "
                           r"`assert name\(<literals>\) == <literal>` "
                           r"\(an argument or the expected value is not a literal\); .* trust_asserts=True"),
    (["assert f(1) == (1, 2)"], r"the expected value is not plain JSON data"),
    ([{"function": "f", "input": 1, "output": 1}], r"item 0: 'input' must be a list"),
    ([{"function": "f x", "input": [1], "output": 1}], r"item 0: 'function' must be a function name"),
    ([{"function": "f", "input": [1]}], r"item 0 must have exactly the keys 'function', 'input', 'output' or 'stdin'"),
    ([{"function": "f", "input": [{1}], "output": 1}], r"item 0: 'input' is not plain JSON data"),
    ([{"function": "f", "input": [1], "output": float("nan")}], r"item 0: 'output' is not plain JSON data"),
    ([{"stdin": 1, "stdout": "1"}], r"item 0: 'stdin' must be a string, got int"),
    ([{"stdin": "", "stdout": "\ud800"}], r"item 0: 'stdout' is not UTF-8 text"),
])
def test_a_malformed_row_is_described(tests, problem):
    assert re.search(problem, problem_in_tests(tests))


def test_trusted_asserts_are_well_formed_only_with_trust_asserts():
    assert problem_in_tests(["assert f(1) in (1, 2)"], trust_asserts=True) is None
    assert "trust_asserts=True" in problem_in_tests(["assert f(1) in (1, 2)"])


@needs_sandbox
def test_a_malformed_row_scores_0_with_a_warning_naming_it_and_the_others_are_scored():
    completion = f"```python\n{SQUARE}```"
    warning = r"tests of row 1: must be None or a non-empty list, got str; the row scores 0"
    with pytest.warns(RewardWarning, match=warning):
        scores = code_execution_reward([completion] * 3, tests=[SQUARE_TESTS, "assert f(1) == 1", None])
    assert scores == [1.0, 0.0, None]


def test_a_dataset_without_tests_is_named():
    with pytest.raises(TypeError, match="needs the dataset's 'tests' column"):
        code_execution_reward(["a"], answer=["1"])


def test_completions_and_rows_must_align():
    with pytest.raises(ValueError, match="2 completions but 1 rows of tests"):
        code_execution_reward(["a", "b"], tests=[SQUARE_TESTS])


@needs_sandbox
@pytest.mark.skipif(usable_cpus() < 2, reason="needs 2 usable CPUs to run programs side by side")
def test_a_batch_runs_one_program_per_usable_cpu_at_once():
    sleeper = "```python\nimport time\ntime.sleep(2.5)\ndef f(x):\n    return x * x\n```"
    limits = SandboxLimits(timeout_s=30.0, cpu_time_s=30)
    started = time.monotonic()
    assert code_execution_reward([sleeper] * 2, tests=[SQUARE_TESTS] * 2, sandbox_limits=limits) == [1.0, 1.0]
    assert time.monotonic() - started < 2 * 2.5  # one after the other would take 5 s and more


def test_programs_at_once_are_the_cpus_this_process_may_use_not_the_hosts(monkeypatch):
    """On a 128-core host whose container may use 3 of them, 3 programs run at once."""
    monkeypatch.setattr(code_reward.os, "sched_getaffinity", lambda pid: {4, 9, 17})
    monkeypatch.setattr(code_reward.os, "cpu_count", lambda: 128)
    pools = []

    class RecordingPool(ThreadPoolExecutor):
        def __init__(self, max_workers=None, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(code_reward, "ThreadPoolExecutor", RecordingPool)
    assert usable_cpus() == 3
    assert code_execution_reward(["no code here"], tests=[SQUARE_TESTS]) == [0.0]
    assert pools == [3]


@needs_sandbox
def test_the_reward_runs_by_import_path_in_a_reward_worker():
    runner = RewardRunner(["lightning_logra.rewards.code:code_execution_reward"], timeout_s=60.0)
    try:
        scores = runner([f"```python\n{SQUARE}```", "nothing"], tests=[SQUARE_TESTS, SQUARE_TESTS])
    finally:
        runner.close()
    assert scores.total == [1.0, 0.0] and scores.failures == 0
