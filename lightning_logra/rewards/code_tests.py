"""The tests of ``code_execution_reward``: read from a row, turned into what the sandbox may
see (inputs only), and judged outside it (see ``rewards.code``).

A row's item becomes one of

- ``CallTest``: call a function with literal arguments, compare the returned value, plain
  JSON data, with the expected one; from ``{"function", "input", "output"}`` dicts and from
  asserts of the form ``assert name(<literals>) == <literal>``;
- ``OutputTest``: run the program with ``stdin``, compare what it prints with ``stdout``;
- a string: any other assert, run inside the program's process (only with ``trust_asserts``).

Nothing here runs the tests' text: asserts are parsed with ``ast`` and their values read with
``ast.literal_eval``, reports with ``json.loads``.
"""

from __future__ import annotations

import ast
import json
import math
from typing import NamedTuple

TRUST_HINT = ("any other assert runs in the program's own process, where the program can forge its outcome: "
              "pass trust_asserts=True (in a config: lightning_logra.rewards.code:"
              "code_execution_reward_trusting_asserts) to run such asserts anyway")


class CallTest(NamedTuple):
    """Call ``function`` with the positional ``arguments`` (the source of a Python literal
    tuple, all the sandbox sees) and compare the result with ``expected`` (plain data,
    which never enters the sandbox)."""

    function: str
    arguments: str
    expected: object


class OutputTest(NamedTuple):
    """Run the program with ``stdin`` as its standard input; compare its standard output
    with ``stdout`` (which never enters the sandbox) by ``same_output``."""

    stdin: str
    stdout: str


Test = CallTest | OutputTest | str


def parse_tests(tests, *, trust_asserts: bool = False) -> list[Test]:
    """One row's tests as ``CallTest``, ``OutputTest`` and trusted assert strings; raises
    ``ValueError`` saying what is wrong (the caller names the row)."""
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"must be None or a non-empty list, got {type(tests).__name__}")
    return [_parse_item(index, test, trust_asserts) for index, test in enumerate(tests)]


def problem_in_tests(tests, *, trust_asserts: bool = False) -> str | None:
    """What is wrong with one row's tests, or None when they are None or well formed."""
    if tests is None:
        return None
    try:
        parse_tests(tests, trust_asserts=trust_asserts)
    except ValueError as error:
        return str(error)
    return None


def is_plain(value) -> bool:
    """None, a bool, an int, a finite float, a str, or a list or str-keyed dict of them:
    exact types, no subclasses. (Its source also runs in the sandbox's harness.)"""
    kind = type(value)
    if kind is list:
        return all(is_plain(item) for item in value)
    if kind is dict:
        return all(type(key) is str and is_plain(item) for key, item in value.items())
    if kind is float:
        return math.isfinite(value)
    return value is None or kind in (bool, int, str)


def call_verdicts(report: str | None, tests: list[CallTest]) -> list[bool]:
    """Which of ``tests`` passed, read from the harness's report: a JSON list with one entry
    per test, in order, ``{"value": <returned value>}`` or null. A report that is missing,
    not JSON, holds a NaN or an int too long to read, or has the wrong shape fails them all;
    an entry that is not exactly ``{"value": ...}`` fails its test."""
    try:
        entries = json.loads(report, parse_constant=_refuse_constant) if report is not None else None
    except (ValueError, RecursionError):
        return [False] * len(tests)
    if type(entries) is not list or len(entries) != len(tests):
        return [False] * len(tests)
    return [type(entry) is dict and entry.keys() == {"value"} and _equal(entry["value"], test.expected)
            for entry, test in zip(entries, tests)]


def same_output(output: str, expected: str) -> bool:
    """Outputs compared line by line, trailing whitespace (``\\r`` included) removed from
    each line and blank lines at the end ignored."""
    return _lines(output) == _lines(expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _equal(result, expected) -> bool:
    """Python's ``==``, as the tests compared before (``True == 1``, ``4.0 == 4``, floats
    exactly), on plain data decoded here: no object of the program's takes part."""
    try:
        return result == expected
    except RecursionError:  # nested past the interpreter's limit
        return False


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not plain JSON data")


def _parse_item(index: int, test, trust_asserts: bool) -> Test:
    if isinstance(test, str):
        return _parse_assert(index, test, trust_asserts)
    if isinstance(test, dict):
        if set(test) == {"stdin", "stdout"}:
            for key in ("stdin", "stdout"):
                if not isinstance(test[key], str):
                    raise ValueError(f"item {index}: {key!r} must be a string, got {type(test[key]).__name__}")
                if not _is_utf8(test[key]):
                    raise ValueError(f"item {index}: {key!r} is not UTF-8 text (it holds a lone surrogate)")
            return OutputTest(test["stdin"], test["stdout"])
        if set(test) == {"function", "input", "output"}:
            return _parse_call(index, test)
        raise ValueError(f"item {index} must have exactly the keys 'function', 'input', 'output' or 'stdin', "
                         f"'stdout', got {sorted(map(str, test))}")
    raise ValueError(f"item {index} must be a string or a dict, got {type(test).__name__}")


def _parse_call(index: int, test: dict) -> CallTest:
    function, arguments = test["function"], test["input"]
    if not isinstance(function, str) or not function.isidentifier():
        raise ValueError(f"item {index}: 'function' must be a function name, got {function!r}")
    if not isinstance(arguments, list):
        raise ValueError(f"item {index}: 'input' must be a list of positional arguments, got "
                         f"{type(arguments).__name__}")
    for key in ("input", "output"):
        problem = _plain_problem(test[key])
        if problem is not None:
            raise ValueError(f"item {index}: {key!r} {problem}")
    return CallTest(function, repr(tuple(arguments)), test["output"])


def _parse_assert(index: int, test: str, trust_asserts: bool) -> CallTest | str:
    if not test.strip():
        raise ValueError(f"item {index} is an empty string")
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise ValueError(f"item {index} is not Python: {type(error).__name__}: {error}") from None
    call = _call_in_assert(module)
    if isinstance(call, CallTest):
        return call
    if trust_asserts:
        return test
    shown = test if len(test) <= 80 else test[:77] + "..."
    raise ValueError(f"item {index} ({shown!r}) is not of the form `assert name(<literals>) == <literal>` "
                     f"({call}); {TRUST_HINT}")


def _call_in_assert(module: ast.Module) -> CallTest | str:
    """The call test an ``assert name(<literals>) == <literal>`` statement makes, or why the
    statement is not one."""
    if len(module.body) != 1 or not isinstance(module.body[0], ast.Assert) or module.body[0].msg is not None:
        return "not one assert statement without a message"
    compare = module.body[0].test
    if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)):
        return "not one == comparison"
    call, expected = compare.left, compare.comparators[0]
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.keywords \
            or any(isinstance(argument, ast.Starred) for argument in call.args):
        return "the left side is not a call of a plain name with positional arguments"
    try:
        for argument in call.args:
            ast.literal_eval(argument)
        value = ast.literal_eval(expected)
        arguments = ast.unparse(ast.Tuple(elts=call.args, ctx=ast.Load()))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return "an argument or the expected value is not a literal"
    problem = _plain_problem(value)
    if problem is not None:
        return f"the expected value {problem}"
    return CallTest(call.func.id, arguments, value)


def _plain_problem(value) -> str | None:
    """Why ``value`` is not plain JSON data (see ``is_plain``), or None."""
    try:
        json.dumps(value, allow_nan=False)
        if is_plain(value):
            return None
    except (TypeError, ValueError, RecursionError) as error:
        return f"is not plain JSON data ({error})"
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return ("is not plain JSON data (None, bool, int, finite float, str, and lists and str-keyed dicts of them): "
            f"{shown}")
