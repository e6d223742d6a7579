"""Verdicts a program cannot forge: whatever a completion does inside the sandbox, it passes a
test only by producing the expected value (or output) for the test's input. Each forgery is
run against the same tests written as asserts and as ``{"function", "input", "output"}``
dicts; each scored 1 before the expected values were kept out of the sandbox."""

import pytest

from lightning_logra.rewards import code as code_reward
from lightning_logra.rewards.code import code_execution_reward
from lightning_logra.sandbox import SandboxLimits, namespaces_problem, run_python

NAMESPACES = namespaces_problem()
pytestmark = pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
CASES = [(2, 4), (-3, 9), (0, 0), (5, 25)]
TESTS = {
    "asserts": [f"assert f({x}) == {y}" for x, y in CASES],
    "dicts": [{"function": "f", "input": [x], "output": y} for x, y in CASES],
}
HONEST = "def f(x):\n    return x * x\n"
FORGERIES = {
    "eq_always_true": "class Anything:\n    def __eq__(self, other):\n        return True\n"
                      "def f(x):\n    return Anything()\n",
    "int_subclass_eq_always_true": "class Number(int):\n    def __eq__(self, other):\n        return True\n"
                                   "    __hash__ = int.__hash__\ndef f(x):\n    return Number(0)\n",
    "claims_class_int": "class Fake:\n    __class__ = property(lambda self: int)\n"
                        "    def __eq__(self, other):\n        return True\ndef f(x):\n    return Fake()\n",
    "serialisation_hooks": "class Hooked(dict):\n    def __reduce__(self):\n        return (int, (4,))\n"
                           "    def __json__(self):\n        return 4\n"
                           "    def __eq__(self, other):\n        return True\n"
                           "def f(x):\n    return Hooked()\n",
    "report_then_exit": "import os\nopen('report.txt', 'w').write('[1, 1, 1, 1]')\nos._exit(0)\n",
    "report_of_true_values_then_exit": ("import json, os\n"
                                        "open('report.txt', 'w').write(json.dumps([{'value': True}] * 4))\n"
                                        "os._exit(0)\n"),
    "patches_json": "import json\nreal = json.dump\njson.dump = lambda obj, file, *a, **k: real([1] * len(obj), file)\n"
                    "json.dumps = lambda *a, **k: '[1, 1, 1, 1]'\ndef f(x):\n    return None\n",
    "patches_print_and_stdout": "import builtins, sys\nbuiltins.print = lambda *a, **k: None\n"
                                "sys.stdout.write = lambda text: len(text)\ndef f(x):\n    return None\n",
    "prints_fake_results": "print('[1, 1, 1, 1]')\nprint('{\"value\": 4}')\ndef f(x):\n    print('PASS')\n",
    # Reads every file of its working directory (the tests were in task.json) for 'f(x) == y'
    # and '"input": [x], "output": y', and answers from what it found.
    "reads_its_working_directory": (
        "import os, re\nanswers = {}\nfor name in os.listdir('.'):\n"
        "    text = open(name, errors='replace').read() if os.path.isfile(name) else ''\n"
        "    for x, y in re.findall(r'f\\((-?\\d+)\\) == (-?\\d+)', text) + "
        "re.findall(r'\"input\": \\[(-?\\d+)\\], \"output\": (-?\\d+)', text):\n"
        "        answers[int(x)] = int(y)\ndef f(x):\n    return answers[x]\n"),
    # Searches the interpreter's memory (the harness's objects) for its own test.
    "reads_the_harness_memory": (
        "import ast, gc\ndef f(x):\n    for thing in gc.get_objects():\n"
        "        if isinstance(thing, dict) and thing.get('input') == [x] and 'output' in thing:\n"
        "            return thing['output']\n"
        "        if isinstance(thing, list):\n            for item in thing:\n"
        "                if isinstance(item, str) and item.startswith(f'assert f({x}) == '):\n"
        "                    return ast.literal_eval(item.split(' == ', 1)[1])\n"),
    "exits_at_import": "raise SystemExit(0)\ndef f(x):\n    return x * x\n",
    "infinite_recursion": "def f(x):\n    return f(x)\n",
    "huge_result": "def f(x):\n    return 'x' * 10**6\n",
}


@pytest.mark.parametrize("form", sorted(TESTS))
def test_an_honest_solution_scores_1(form):
    assert code_execution_reward([HONEST], tests=[TESTS[form]]) == [1.0]


@pytest.mark.parametrize("form", sorted(TESTS))
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_forgery_scores_0(forgery, form):
    assert code_execution_reward([f"```python\n{FORGERIES[forgery]}```"], tests=[TESTS[form]]) == [0.0]


GARBAGE_REPORTS = {
    "not_json": "'nonsense ['",
    "nan": "'[NaN, {\"value\": NaN}, {\"value\": Infinity}, null]'",
    "deep_nesting": "'[' * 30000 + ']' * 30000",
    "huge_int": "'[{\"value\": ' + '9' * 5000 + '}]'",
    "invalid_utf8": "b'\\xff\\xfe[1, 1]'.decode('latin-1')",
    "five_entries": "'[{\"value\": 4}, {\"value\": 9}, {\"value\": 0}, {\"value\": 25}, {\"value\": 1}]'",
    "object": "'{\"0\": {\"value\": 4}}'",
}


@pytest.mark.parametrize("garbage", sorted(GARBAGE_REPORTS))
def test_a_garbage_report_scores_0_and_raises_nothing(garbage):
    program = f"import os\nopen('report.txt', 'w', encoding='latin-1').write({GARBAGE_REPORTS[garbage]})\nos._exit(0)\n"
    assert code_execution_reward([program], tests=[TESTS["dicts"]]) == [0.0]


def test_a_program_that_is_not_utf8_scores_0_and_raises_nothing():
    """A lone surrogate: such a program never compiles, and could not be written to a file."""
    program = "```python\ndef f(x):\n    return x * x  # \ud800\n```"
    tests = [TESTS["asserts"] + [{"stdin": "", "stdout": ""}]]
    assert code_execution_reward([program], tests=tests) == [0.0]


def test_a_report_that_links_elsewhere_scores_0():
    program = "import os\nos.symlink('/etc/hostname', 'report.txt')\nos._exit(0)\n"
    assert code_execution_reward([program], tests=[TESTS["asserts"]]) == [0.0]


def test_expected_values_never_enter_the_sandbox(monkeypatch):
    """Everything sent into the sandbox (the program run and the files beside it) is free of
    the tests' expected values and outputs."""
    sent = []

    def recording_run(program, limits=None, files=None):
        sent.extend([program, *(files or {}).values()])
        return run_python(program, limits, files)

    monkeypatch.setattr(code_reward, "run_python", recording_run)
    tests = [["assert f(2) == 48151623", {"function": "f", "input": [3], "output": "EXPECTED-OUTPUT-MARKER"},
              {"stdin": "1\n", "stdout": "EXPECTED-STDOUT-MARKER"}]]
    assert code_execution_reward(["def f(x):\n    return x\nprint(input())"], tests=tests) == [0.0]
    assert sent and not [text for text in sent if "48151623" in text or "MARKER" in text]


@pytest.mark.parametrize(("returned", "expected", "passes"), [
    ("1", "True", True),  # Python's ==, as before: True == 1
    ("True", "1", True),
    ("4.0", "4", True),  # ints and floats compare by value
    ("0.1 + 0.2", "0.3", False),  # floats exactly, as before
    ("(1, 2)", "[1, 2]", False),  # a tuple is not a list, as before
    ("[1, True]", "[1, 1]", True),
    ("[1, 2]", "[2, 1]", False),
    ("{'a': 1}", "{'a': 1, 'b': 2}", False),
    ("{'a': [1, None]}", "{'a': [1, None]}", True),
    ("None", "None", True),
    ("'ab'", "'ab'", True),
    ("float('nan')", "0.0", False),
])
def test_returned_values_are_compared_as_plain_data(returned, expected, passes):
    program = f"def f():\n    return {returned}\n"
    assert code_execution_reward([program], tests=[[f"assert f() == {expected}"]]) == [1.0 if passes else 0.0]


STDIN_TESTS = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "10 -4\n", "stdout": "6"}]


@pytest.mark.parametrize(("program", "score"), [
    ("a, b = map(int, input().split())\nprint(a + b)", 1.0),
    ("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, '  ')\nprint()\n"
     "print('noise', file=sys.stderr)", 1.0),  # trailing spaces, blank lines and stderr do not count
    ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)", 0.0),  # a failed run fails
    ("print(3)", 0.5),
    ("import os\nprint(*[open(n, errors='replace').read() for n in os.listdir('.') if os.path.isfile(n)])", 0.0),
])
def test_stdin_tests_compare_the_programs_output_outside_the_sandbox(program, score):
    assert code_execution_reward([program], tests=[STDIN_TESTS]) == [score]


def test_a_row_mixes_the_kinds_of_tests():
    tests = [["assert f(2) == 4", {"function": "f", "input": [3], "output": 9}, {"stdin": "", "stdout": "ready"},
              "assert f(1) == 2"]]
    assert code_execution_reward(["def f(x):\n    return x * x\nprint('ready')"], tests=tests) == [0.75]


TRUSTED = ["assert f(2) in (4, 5)", "assert f(3) == 9"]


def test_other_asserts_need_trust_asserts(recwarn):
    assert code_execution_reward([HONEST], tests=[TRUSTED]) == [0.0]
    assert "tests of row 0: item 0" in str(recwarn.pop().message)
    assert code_execution_reward([HONEST], tests=[TRUSTED], trust_asserts=True) == [1.0]


def test_trust_asserts_must_be_a_bool():
    """A dataset column of that name (a list, one value per row) must not switch it on."""
    with pytest.raises(TypeError, match="trust_asserts must be True or False, got list"):
        code_execution_reward([HONEST], tests=[TRUSTED], trust_asserts=[True])


def test_the_trusting_variant_runs_other_asserts():
    assert code_reward.code_execution_reward_trusting_asserts([HONEST], tests=[TRUSTED]) == [1.0]


def test_a_run_past_the_limits_fails_its_tests_only():
    """A stdin test whose run hangs fails; the row's other tests still count."""
    tests = [["assert f(2) == 4", {"stdin": "loop", "stdout": ""}]]
    program = "import sys\ndef f(x):\n    return x * x\nif sys.stdin.read() == 'loop':\n    while True:\n        pass"
    limits = SandboxLimits(timeout_s=1.0, cpu_time_s=1)
    assert code_execution_reward([program], tests=tests, sandbox_limits=limits) == [0.5]
