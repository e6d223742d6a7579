"""The code reward's tests outside the sandbox (no namespaces needed): asserts turned into
calls whose expected values stay here, and the reading of a harness's report, which the
program may have written itself."""

import pytest

from lightning_logra.rewards.code_tests import CallTest, OutputTest, call_verdicts, parse_tests, same_output

SQUARES = [CallTest("f", "(2,)", 4), CallTest("f", "(-3,)", 9)]


def test_asserts_become_calls_whose_arguments_are_literal_source():
    tests = ["assert f(2) == 4", "assert g((1, 2), {3}, b'x', -1) == [1, {'a': None}]",
             {"function": "h", "input": [[1], "a", 2.5], "output": True}, {"stdin": "1\n", "stdout": "2\n"}]
    assert parse_tests(tests) == [
        CallTest("f", "(2,)", 4),
        CallTest("g", "((1, 2), {3}, b'x', -1)", [1, {"a": None}]),
        CallTest("h", "([1], 'a', 2.5)", True),
        OutputTest("1\n", "2\n"),
    ]


@pytest.mark.parametrize("test", [
    "assert f(x) == 4", "assert f(1) != 2", "assert f(1) == 2 == 2", "assert o.f(1) == 2", "assert f(1) == 2, 'm'",
    "assert f(*[1]) == 1", "assert f(a=1) == 1", "x = 1", "assert f(1) == 1\nassert f(2) == 2", "assert f(1) == 1e999",
    "assert f(1) == (1, 2)", "assert f(1) == {1: 2}", "assert f(1) in (1, 2)",
])
def test_other_asserts_are_refused_unless_trusted(test):
    with pytest.raises(ValueError, match=r"item 0 .* is not of the form `assert name\(<literals>\) == <literal>`"):
        parse_tests([test])
    assert parse_tests([test], trust_asserts=True) == [test]


@pytest.mark.parametrize(("report", "verdicts"), [
    ('[{"value": 4}, {"value": 9}]', [True, True]),
    ('[{"value": 4.0}, {"value": 8}]', [True, False]),
    ('[null, {"value": 9}]', [False, True]),
    ('[{"value": 4, "passed": true}, {"value": 9}]', [False, True]),  # an entry is exactly {"value": ...}
    ('[{"value": true}, {"value": 9}]', [False, True]),
    ('[{"value": 4}]', [False, False]),  # one entry per test, no fewer
    ('[{"value": 4}, {"value": 9}, {"value": 9}]', [False, False]),  # nor more
    ('{"0": {"value": 4}, "1": {"value": 9}}', [False, False]),
    ('[{"value": 4}, {"value": NaN}]', [False, False]),
    ('[{"value": 4}, {"value": ' + "9" * 5000 + "}]", [False, False]),  # past Python's int digits limit
    ("[" * 30000 + "]" * 30000, [False, False]),
    ("[1, 1]", [False, False]),
    ("\ufffd[1, 1]", [False, False]),
    (None, [False, False]),
])
def test_a_report_claims_values_that_are_compared_here(report, verdicts):
    assert call_verdicts(report, SQUARES) == verdicts


@pytest.mark.parametrize(("output", "expected", "same"), [
    ("3\n", "3", True),
    ("3  \r\n\n\n", "3\n", True),
    ("1 2\n3\n", "1 2\n3", True),
    (" 3\n", "3\n", False),  # leading whitespace counts
    ("3\n\n4\n", "3\n4\n", False),  # blank lines inside count
    ("", "", True),
])
def test_outputs_compare_line_by_line_without_trailing_whitespace(output, expected, same):
    assert same_output(output, expected) is same
