"""Reward for code: run a completion's program in the sandbox and judge what it returns,
outside the sandbox, against the row's tests.

``code_execution_reward(completions, tests, **kwargs)`` follows TRL's convention: the tests
come from the dataset's ``tests`` column, one entry per row, either None (a row of another
task: not scored) or a non-empty list whose items are

- a dict ``{"function": "f", "input": [2], "output": 8}``: the program's function ``f``
  called with the positional arguments ``input`` passes when it returns ``output``;
- a string ``assert f(<literals>) == <literal>`` (e.g. ``"assert f(2) == 8"``): read with
  ``ast`` and run as the dict above;
- a dict ``{"stdin": "1 2\\n", "stdout": "3\\n"}``: the program, run with ``stdin`` as its
  standard input, passes when it prints ``stdout`` (see ``code_tests.same_output``);
- any other assert string: run after the program in its namespace, passing when it raises
  nothing, only with ``trust_asserts=True`` (``code_execution_reward_trusting_asserts``).

The score is the fraction of the row's tests that passed. The program is the completion's
code: the last fenced block marked ``python`` (``py``, ``python3``), else the last fenced
block, else the whole text when it compiles; a final fence left open by a completion cut
at ``max_new_tokens`` counts up to the end. Each run is one program in
``lightning_logra.sandbox`` (under ``DEFAULT_LIMITS``: 3 s, 2 CPU seconds, 512 MiB), as
many at a time as this process has usable CPUs: one run for a row's function calls (the
program, then each call in turn), one per stdin test, one for its trusted asserts. A run
that does not exit with status 0, or hits a limit, fails all of its tests.

What a program can do to its score: expected values and outputs never enter the sandbox.
The harness there reports each call's returned value as JSON (plain data only: None, bool,
int, finite float, str, lists and str-keyed dicts; anything else fails that test), and the
comparison happens here (``code_tests.call_verdicts``). The program runs in the same
interpreter as that harness, so it can rewrite the report, exit early or patch anything;
but a report only claims what the functions returned, and a test passes only when the
claim equals the hidden expected value: to forge it is to compute it. A stdin test's
verdict channel is the program's own output, also compared here. Trusted asserts run in the
program's process, which can forge their outcome. (What the sandbox lets a program read is
the sandbox's matter: see the code-rewards guide, "Threat model: verdicts".)
"""

from __future__ import annotations

import inspect
import json
import os
import re
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from lightning_logra.rewards.code_tests import (
    CallTest,
    OutputTest,
    Test,
    call_verdicts,
    is_plain,
    parse_tests,
    same_output,
)
from lightning_logra.rewards.completions import completion_text
from lightning_logra.rewards.runner import RewardWarning
from lightning_logra.sandbox import REPORT_FILE, SandboxLimits, SandboxResult, run_python

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")
# Small functions finish in milliseconds; the interpreter's start takes most of a run.
DEFAULT_LIMITS = SandboxLimits(timeout_s=3.0, cpu_time_s=2)
CALLS_FILE, COMPLETION_FILE, STDIN_FILE, STDERR_FILE, TASK_FILE = (
    "calls.json", "completion.py", "stdin.txt", "stderr.txt", "task.json")


def _after_the_program(task_file: str, rest: str) -> str:
    """A harness: read ``task_file`` (JSON: the program's ``code`` and what to run after
    it), run the program in a namespace of its own (``ran``: whether it finished), then
    ``rest``."""
    return f"""
import ast, json, math
with open({task_file!r}, encoding="utf-8") as file:
    task = json.load(file)
namespace = {{"__name__": "__main__"}}
try:
    exec(compile(task["code"], "<completion>", "exec"), namespace)
    ran = True
except BaseException:
    ran = False
""" + rest


# Runs the program, then each call (a function name and its arguments' literal source;
# no expected value), and reports each returned value that is plain data, in order.
CALLS_HARNESS = _after_the_program(CALLS_FILE, f"""
{inspect.getsource(is_plain)}
entries = []
for call in task["calls"]:
    try:
        value = namespace[call["function"]](*ast.literal_eval(call["arguments"])) if ran else None
        entries.append(json.dumps({{"value": value}}, allow_nan=False) if ran and is_plain(value) else "null")
    except BaseException:
        entries.append("null")
with open({REPORT_FILE!r}, "w", encoding="utf-8") as file:
    file.write("[" + ", ".join(entries) + "]")
""")
# Runs the program as the main program with the test's standard input; its standard error
# goes to a file, so that the captured output is its standard output alone.
OUTPUT_HARNESS = f"""
import os, runpy
for name, descriptor, flags in (({STDIN_FILE!r}, 0, os.O_RDONLY), ({STDERR_FILE!r}, 2, os.O_WRONLY | os.O_CREAT)):
    opened = os.open(name, flags)
    os.dup2(opened, descriptor)
    os.close(opened)
runpy.run_path({COMPLETION_FILE!r}, run_name="__main__")
"""
# Trusted asserts only (the program can forge their outcome): runs the program, then each
# assert in its namespace, and reports one 0/1 per assert.
TRUSTED_ASSERTS_HARNESS = _after_the_program(TASK_FILE, f"""
passed = []
for test in task["tests"]:
    try:
        if ran:
            exec(compile(test, "<test>", "exec"), namespace)
        passed.append(1 if ran else 0)
    except BaseException:
        passed.append(0)
with open({REPORT_FILE!r}, "w", encoding="utf-8") as file:
    json.dump(passed, file)
""")


class Run(NamedTuple):
    """One sandboxed program of a row: ``verdicts`` reads its result as one pass/fail per test."""

    row: int
    program: str
    files: dict[str, str]
    verdicts: Callable[[SandboxResult], list[bool]]


def code_execution_reward(completions: list, tests: list | None = None, sandbox_limits: SandboxLimits | None = None,
                          trust_asserts: bool = False, **kwargs) -> list[float | None]:
    """The fraction of each row's ``tests`` that its completion's code passes, None where
    the row has no tests (see the module docstring), each program run under
    ``sandbox_limits`` (``DEFAULT_LIMITS`` by default). A malformed row scores 0 with a
    ``RewardWarning`` naming it (``code_tests.problem_in_tests`` says what is wrong; a
    training module checks every row at setup); other columns in ``kwargs`` are ignored."""
    if tests is None:
        raise TypeError("code_execution_reward needs the dataset's 'tests' column (tests=[...], one list per row; "
                        "PromptDataModule.field_map renames a column to it)")
    if not isinstance(trust_asserts, bool):
        kind = type(trust_asserts).__name__
        raise TypeError(f"code_execution_reward: trust_asserts must be True or False, got {kind}")
    if len(completions) != len(tests):
        raise ValueError(f"code_execution_reward: got {len(completions)} completions but {len(tests)} rows of tests")
    runs, counts = [], [0] * len(tests)
    for row, row_tests in enumerate(tests):
        code = extract_code(_text_of(completions, row))
        parsed = _parsed(row, row_tests, trust_asserts)
        if code is not None and parsed is not None:
            runs += _row_runs(row, code, parsed)
            counts[row] = len(parsed)
    limits = sandbox_limits or DEFAULT_LIMITS
    # The threads only wait for their sandboxed programs, as many as there are usable CPUs.
    with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
        verdicts = list(pool.map(lambda run: run.verdicts(run_python(run.program, limits, run.files)), runs))
    passed = [0] * len(tests)
    for run, run_verdicts in zip(runs, verdicts):
        passed[run.row] += sum(run_verdicts)
    return [None if row_tests is None else passed[row] / counts[row] if counts[row] else 0.0
            for row, row_tests in enumerate(tests)]


def code_execution_reward_trusting_asserts(completions: list, tests: list | None = None,
                                           sandbox_limits: SandboxLimits | None = None, **kwargs) -> list[float | None]:
    """``code_execution_reward`` with ``trust_asserts=True``, for configs, which name a reward
    by its import path: asserts of any form run in the program's process, where the program
    can forge their outcome."""
    return code_execution_reward(completions, tests, sandbox_limits, trust_asserts=True, **kwargs)


def trusts_asserts(function) -> bool | None:
    """Whether ``function``, one of this module's code rewards, runs asserts of any form;
    None for any other function (for the checks of a dataset at setup)."""
    if function is code_execution_reward:
        return False
    return True if function is code_execution_reward_trusting_asserts else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, e.g. a container's cpuset), not all
    the host's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity outside Linux
        return os.cpu_count() or 1


def extract_code(text: str) -> str | None:
    """The program in a completion (see the module docstring), or None when it has none."""
    blocks = [(match[1].lower(), match[2]) for match in FENCE.finditer(text)]
    tagged = [code for tag, code in blocks if tag in PYTHON_TAGS]
    if tagged or blocks:
        code = (tagged or [code for _, code in blocks])[-1]
        try:
            code.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: it never compiles, and cannot be written to a file
            return None
        return code
    try:
        compile(text, "<completion>", "exec")  # a lone surrogate raises UnicodeEncodeError, a ValueError
    except (SyntaxError, ValueError):
        return None
    return text if text.strip() else None


def _row_runs(row: int, code: str, tests: list[Test]) -> list[Run]:
    """The sandboxed programs that test ``code`` against one row's parsed ``tests``."""
    calls = [test for test in tests if isinstance(test, CallTest)]
    asserts = [test for test in tests if isinstance(test, str)]
    runs = [Run(row, OUTPUT_HARNESS, {COMPLETION_FILE: code, STDIN_FILE: test.stdin}, _output_verdict(test.stdout))
            for test in tests if isinstance(test, OutputTest)]
    if calls:
        task = {"code": code, "calls": [{"function": call.function, "arguments": call.arguments} for call in calls]}
        runs.append(Run(row, CALLS_HARNESS, {CALLS_FILE: json.dumps(task)}, _call_verdicts(calls)))
    if asserts:
        task = json.dumps({"code": code, "tests": asserts})
        runs.append(Run(row, TRUSTED_ASSERTS_HARNESS, {TASK_FILE: task}, _assert_verdicts(len(asserts))))
    return runs


def _call_verdicts(calls: list[CallTest]) -> Callable[[SandboxResult], list[bool]]:
    return lambda result: call_verdicts(result.report if result.status == "ok" else None, calls)


def _output_verdict(expected: str) -> Callable[[SandboxResult], list[bool]]:
    return lambda result: [result.status == "ok" and not result.output_truncated
                           and same_output(result.output, expected)]


def _assert_verdicts(count: int) -> Callable[[SandboxResult], list[bool]]:
    def read(result: SandboxResult) -> list[bool]:
        try:
            passed = json.loads(result.report) if result.status == "ok" and result.report else []
        except (ValueError, RecursionError):
            return [False] * count
        if not isinstance(passed, list) or len(passed) != count or any(p not in (0, 1) for p in passed):
            return [False] * count
        return [p == 1 for p in passed]

    return read


def _parsed(row: int, row_tests, trust_asserts: bool) -> list[Test] | None:
    """The row's parsed tests; None for a row without tests, or, with a warning, a malformed one."""
    if row_tests is None:
        return None
    try:
        return parse_tests(row_tests, trust_asserts=trust_asserts)
    except ValueError as error:
        warnings.warn(f"code_execution_reward: tests of row {row}: {error}; the row scores 0", RewardWarning,
                      stacklevel=3)
        return None


def _text_of(completions: list, index: int) -> str:
    try:
        return completion_text(completions[index])
    except TypeError:
        kind = type(completions[index]).__name__
        raise TypeError(f"code_execution_reward: completions[{index}] is {kind}, "
                        "expected str or a list of messages") from None
