"""Reward for code: run a completion's program against the row's tests in the sandbox.

``code_execution_reward(completions, tests, **kwargs)`` follows TRL's convention: the tests
come from the dataset's ``tests`` column, one entry per row, either None (a row of another
task: not scored) or a non-empty list whose items are

- a string: Python statements, typically ``"assert f(2) == 8"``, run after the program in
  its namespace; the test passes when they raise nothing;
- a dict ``{"function": "f", "input": [2], "output": 8}``: the program's function ``f``
  called with the positional arguments ``input`` (a list) passes when the result equals
  ``output`` (``==``; JSON-like values, so a tuple result does not equal a list).

The score is the fraction of the row's tests that passed: 0 when the program does not
run, raises, times out or exceeds a limit. Each completion runs as one program in
``lightning_logra.sandbox`` (under ``DEFAULT_LIMITS``: 3 s, 2 CPU seconds, 512 MiB), one
per CPU core at a time. The program is the completion's code: the last fenced block marked ``python``
(``py``, ``python3``), else the last fenced block, else the whole text when it compiles;
a final fence left open by a completion cut at ``max_new_tokens`` counts up to the end.

The sandbox protects the machine, not the score's honesty: the tests run in the same
process as the program, which could forge their outcome (e.g. write the report itself
and exit). The tests are meant to check small functions honestly written; a policy that
learns to cheat shows it in its completions.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from lightning_logra.rewards.completions import completion_text
from lightning_logra.sandbox import REPORT_FILE, SandboxLimits, run_python

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")
TASK_FILE = "task.json"
# Small functions finish in milliseconds; the interpreter's start takes most of a run.
DEFAULT_LIMITS = SandboxLimits(timeout_s=3.0, cpu_time_s=2)
# Run in the sandbox beside the program (trusted, standard library only): runs the program,
# then each test in its namespace, and writes one 0/1 per test to the report file.
HARNESS = f"""
import json
with open({TASK_FILE!r}, encoding="utf-8") as file:
    task = json.load(file)
namespace = {{"__name__": "__main__"}}
try:
    exec(compile(task["code"], "<completion>", "exec"), namespace)
    ran = True
except BaseException:
    ran = False
passed = []
for test in task["tests"]:
    try:
        if not ran:
            ok = False
        elif isinstance(test, str):
            exec(compile(test, "<test>", "exec"), namespace)
            ok = True
        else:
            ok = namespace[test["function"]](*test["input"]) == test["output"]
        passed.append(1 if ok is True else 0)
    except BaseException:
        passed.append(0)
with open({REPORT_FILE!r}, "w", encoding="utf-8") as file:
    json.dump(passed, file)
"""


def code_execution_reward(completions: list, tests: list | None = None, sandbox_limits: SandboxLimits | None = None,
                          **kwargs) -> list[float | None]:
    """The fraction of each row's ``tests`` that its completion's code passes, None where
    the row has no tests (see the module docstring), each program run under
    ``sandbox_limits`` (``DEFAULT_LIMITS`` by default). Raises ``ValueError`` naming the
    first malformed row; other columns in ``kwargs`` are ignored."""
    if tests is None:
        raise TypeError("code_execution_reward needs the dataset's 'tests' column (tests=[...], one list per row; "
                        "PromptDataModule.field_map renames a column to it)")
    if len(completions) != len(tests):
        raise ValueError(f"code_execution_reward: got {len(completions)} completions but {len(tests)} rows of tests")
    for row, row_tests in enumerate(tests):
        problem = problem_in_tests(row_tests)
        if problem is not None:
            raise ValueError(f"code_execution_reward: tests of row {row}: {problem}")
    codes = [extract_code(_text_of(completions, row)) for row in range(len(completions))]
    runnable = [row for row, code in enumerate(codes) if code is not None and tests[row] is not None]
    # The threads only wait for their sandboxed processes, which run one per core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        scored = pool.map(lambda row: passed_fraction(codes[row], tests[row], sandbox_limits), runnable)
        fractions = dict(zip(runnable, scored))
    return [None if row_tests is None else fractions.get(row, 0.0) for row, row_tests in enumerate(tests)]


def passed_fraction(code: str, tests: list, limits: SandboxLimits | None = None) -> float:
    """Run ``code`` and then ``tests`` in one sandboxed program; the fraction that passed."""
    task = json.dumps({"code": code, "tests": tests})
    result = run_python(HARNESS, limits or DEFAULT_LIMITS, files={TASK_FILE: task})
    try:
        passed = json.loads(result.report) if result.status == "ok" and result.report else []
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(passed, list) or len(passed) != len(tests) or any(p not in (0, 1) for p in passed):
        return 0.0
    return sum(passed) / len(tests)


def extract_code(text: str) -> str | None:
    """The program in a completion (see the module docstring), or None when it has none."""
    blocks = [(match[1].lower(), match[2]) for match in FENCE.finditer(text)]
    tagged = [code for tag, code in blocks if tag in PYTHON_TAGS]
    if tagged or blocks:
        return (tagged or [code for _, code in blocks])[-1]
    try:
        compile(text, "<completion>", "exec")
    except (SyntaxError, ValueError):
        return None
    return text if text.strip() else None


def problem_in_tests(tests) -> str | None:
    """What is wrong with one row's tests, or None when they are None or well formed."""
    if tests is None:
        return None
    if not isinstance(tests, (list, tuple)) or not tests:
        return f"must be None or a non-empty list, got {type(tests).__name__}"
    for index, test in enumerate(tests):
        if isinstance(test, str):
            if not test.strip():
                return f"item {index} is an empty string"
        elif isinstance(test, dict):
            if set(test) != {"function", "input", "output"}:
                return f"item {index} must have exactly the keys 'function', 'input', 'output', got {sorted(test)}"
            if not isinstance(test["function"], str) or not test["function"].isidentifier():
                return f"item {index}: 'function' must be a function name, got {test['function']!r}"
            if not isinstance(test["input"], list):
                kind = type(test["input"]).__name__
                return f"item {index}: 'input' must be a list of positional arguments, got {kind}"
            try:
                json.dumps(test)
            except (TypeError, ValueError) as error:
                return f"item {index} is not JSON-serialisable: {error}"
        else:
            return f"item {index} must be a string or a dict, got {type(test).__name__}"
    return None


def _text_of(completions: list, index: int) -> str:
    try:
        return completion_text(completions[index])
    except TypeError:
        kind = type(completions[index]).__name__
        raise TypeError(f"code_execution_reward: completions[{index}] is {kind}, "
                        "expected str or a list of messages") from None
