"""The built-in code task: deterministic rows whose hidden tests are all judged outside the
sandbox, whose reference solutions pass them, and its ``code:<level>`` source."""

import re

import pytest

from lightning_logra.data import PromptDataModule, code_rows
from lightning_logra.data.code_tasks import TEMPLATES, TESTS_PER_ROW, code_prompts
from lightning_logra.data.held_out import split_counts
from lightning_logra.rewards.code import code_execution_reward
from lightning_logra.rewards.code_tests import CallTest, parse_tests
from lightning_logra.sandbox import namespaces_problem

NAMESPACES = namespaces_problem()


def test_rows_are_deterministic_with_a_seed():
    assert code_rows(20, seed=3) == code_rows(20, seed=3)
    assert code_rows(20, seed=3) != code_rows(20, seed=4)
    assert code_rows(5, seed=3, level=2) == code_rows(5, seed=3, level=2)


@pytest.mark.parametrize("level", sorted(TEMPLATES))
def test_rows_ask_for_f_and_hide_well_formed_tests(level):
    for row in code_rows(30, seed=0, level=level):
        assert row["prompt"].startswith("Write a Python function `f(") and row["prompt"].endswith(".")
        assert len(row["tests"]) == TESTS_PER_ROW and all(test.startswith("assert f(") for test in row["tests"])
        # Every test is judged outside the sandbox: no assert needs trust_asserts.
        assert all(isinstance(test, CallTest) and test.function == "f" for test in parse_tests(row["tests"]))
        assert row["reference_solution"].startswith("def f(")


@pytest.mark.skipif(NAMESPACES is not None, reason=f"no sandbox namespaces here: {NAMESPACES}")
@pytest.mark.parametrize("level", sorted(TEMPLATES))
def test_every_reference_solution_passes_its_own_tests_in_the_sandbox(level):
    # Every prompt of the level, once: each split's.
    counts = split_counts(code_prompts(level))
    rows = [row for split, count in counts.items() for row in code_rows(count, seed=1, split=split, level=level)]
    # One row of each template (their solutions differ but in the constants).
    by_template = {}
    for row in rows:
        by_template.setdefault(re.sub(r"\d", "", row["reference_solution"]), row)
    assert len(by_template) == len(TEMPLATES[level])
    chosen = list(by_template.values())
    completions = [f"```python\n{row['reference_solution']}```" for row in chosen]
    assert code_execution_reward(completions, tests=[row["tests"] for row in chosen]) == [1.0] * len(chosen)


def test_the_code_source_carries_the_tests_column():
    data = PromptDataModule(train="code:2", val="code", batch_size=2, train_size=4, val_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["answer"] == [None, None] and all(len(tests) == TESTS_PER_ROW for tests in batch["tests"])
    assert data.datasets["val"].columns[0]["prompt"] == code_rows(2, seed=0, split="val")[0]["prompt"]


@pytest.mark.parametrize("source", ["code:3", "code:x"])
def test_an_unknown_code_level_is_named(source):
    with pytest.raises(ValueError, match=rf"'{source}': write code:<level>, level 1 or 2"):
        PromptDataModule(train=source).setup("fit")


def test_code_rows_refuses_a_bad_level():
    with pytest.raises(ValueError, match="level in \\[1, 2\\]; got n=1, level=5"):
        code_rows(1, seed=0, level=5)
