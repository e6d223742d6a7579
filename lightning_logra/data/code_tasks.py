"""A built-in offline code task: small Python functions to write, with hidden tests.

Each row asks for one function ``f`` ("Write a Python function `f(x)` that returns x
multiplied by 3 plus 2.") and carries ``tests``, five statements ``assert f(<literal>) ==
<literal>`` on inputs the prompt does not show (``code_execution_reward`` calls ``f`` in the
sandbox and compares the value outside it), and ``reference_solution``, a solution that
passes them. Level 1 asks for one operation, level 2 for two. The expected values are
computed here by plain Python functions, never by running the solutions' text: the tests of
the package run each reference solution in the sandbox against its tests. A prompt is a
training or a validation prompt by ``held_out.prompt_split``, for every seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from lightning_logra.data.held_out import check_split, rows_of_split


class Template(NamedTuple):
    """One kind of function: its description and body (``str.format`` with the drawn
    constants ``a``, ``b``), its parameter, how to draw an argument, and what it returns."""

    description: str
    body: str
    parameter: str
    draw: Callable[[random.Random], object]
    compute: Callable[..., object]


def _integer(rng: random.Random) -> int:
    return rng.randint(-20, 20)


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(-9, 9) for _ in range(rng.randint(0, 6))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7)))


TEMPLATES = {
    1: [
        Template("returns x multiplied by {a}", "x * {a}", "x", _integer, lambda x, a, b: x * a),
        Template("returns x plus {a}", "x + {a}", "x", _integer, lambda x, a, b: x + a),
        Template("returns x minus {a}", "x - {a}", "x", _integer, lambda x, a, b: x - a),
        Template("returns the square of x", "x * x", "x", _integer, lambda x, a, b: x * x),
        Template("returns the larger of x and {a}", "max(x, {a})", "x", _integer, lambda x, a, b: max(x, a)),
        Template("returns True if x is even, else False", "x % 2 == 0", "x", _integer, lambda x, a, b: x % 2 == 0),
        Template("returns True if x is greater than {a}, else False", "x > {a}", "x", _integer,
                 lambda x, a, b: x > a),
        Template("returns the sum of the numbers in the list xs", "sum(xs)", "xs", _numbers, lambda xs, a, b: sum(xs)),
        Template("returns the length of the list xs", "len(xs)", "xs", _numbers, lambda xs, a, b: len(xs)),
        Template("returns the string s reversed", "s[::-1]", "s", _word, lambda s, a, b: s[::-1]),
        Template("returns the string s in upper case", "s.upper()", "s", _word, lambda s, a, b: s.upper()),
    ],
    2: [
        Template("returns x multiplied by {a} plus {b}", "x * {a} + {b}", "x", _integer, lambda x, a, b: x * a + b),
        Template("returns x plus {a}, multiplied by {b}", "(x + {a}) * {b}", "x", _integer,
                 lambda x, a, b: (x + a) * b),
        Template("returns the number of elements of the list xs that are greater than {a}",
                 "sum(1 for v in xs if v > {a})", "xs", _numbers, lambda xs, a, b: sum(1 for v in xs if v > a)),
        Template("returns the sum of the squares of the numbers in the list xs", "sum(v * v for v in xs)", "xs",
                 _numbers, lambda xs, a, b: sum(v * v for v in xs)),
        Template("returns a list of the numbers in the list xs multiplied by {a}", "[v * {a} for v in xs]", "xs",
                 _numbers, lambda xs, a, b: [v * a for v in xs]),
        Template("returns the string s repeated {a} times", "s * {a}", "s", _word, lambda s, a, b: s * a),
        Template("returns the first {a} characters of the string s", "s[:{a}]", "s", _word, lambda s, a, b: s[:a]),
    ],
}
TESTS_PER_ROW = 5


CONSTANTS_A = range(2, 10)
CONSTANTS_B = range(1, 10)


def code_rows(n: int, seed: int, *, split: str = "train", level: int = 1) -> list[dict]:
    """``n`` deterministic rows ``{"prompt", "tests", "reference_solution"}`` of ``split``
    (``"train"`` or ``"val"``, see ``held_out``) and ``level`` (1 or 2; see the module
    docstring); the same for a (seed, split).

    The seed shuffles the level's distinct prompts (``code_prompts``), each equally likely,
    and draws each row's test inputs. The spaces are small (tens of prompts per split at
    level 1), so a larger ``n`` repeats prompts, with a warning.
    """
    if n < 0 or level not in TEMPLATES:
        raise ValueError(f"code_rows: need n >= 0 and level in {sorted(TEMPLATES)}; got n={n}, level={level}")
    task = f"code:{level}"
    check_split(task, split)
    rng = random.Random(seed)
    space = _prompt_space(level)
    candidates = (_row(template, constants, rng) for template, constants in rng.sample(space, len(space)))
    return rows_of_split(task, split, n, candidates, exhaustive=True)


def code_prompts(level: int) -> list[str]:
    """Every distinct prompt of ``level`` (for counting them per split)."""
    return [_prompt(template, constants) for template, constants in _prompt_space(level)]


def _prompt_space(level: int) -> list[tuple[Template, dict[str, int]]]:
    """One (template, constants) per distinct prompt of ``level``: a template whose
    description leaves out a constant asks for the same function whatever it is."""
    space = {}
    for template in TEMPLATES[level]:
        for a in CONSTANTS_A:
            for b in CONSTANTS_B:
                constants = {"a": a, "b": b}
                space.setdefault(_prompt(template, constants), (template, constants))
    return list(space.values())


def _prompt(template: Template, constants: dict[str, int]) -> str:
    return f"Write a Python function `f({template.parameter})` that {template.description.format(**constants)}."


def _row(template: Template, constants: dict[str, int], rng: random.Random) -> dict:
    solution = f"def f({template.parameter}):\n    return {template.body.format(**constants)}\n"
    tests = []
    for _ in range(TESTS_PER_ROW):
        argument = template.draw(rng)
        tests.append(f"assert f({argument!r}) == {template.compute(argument, **constants)!r}")
    return {"prompt": _prompt(template, constants), "tests": tests, "reference_solution": solution}
