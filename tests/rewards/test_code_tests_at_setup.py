"""The code reward's ``tests`` column is checked when a training module meets its data, before
any step: a malformed row, or an assert the sandbox cannot judge outside the program without
``trust_asserts``, is refused naming its split and row."""

import json

import pytest

from lightning_logra.data import PromptDataModule
from lightning_logra.modules.prompt_checks import check_tests_column
from lightning_logra.rewards import RewardConfig, RewardRunner
from tests.helpers.grpo import fit_grpo, grpo_module

CODE_REWARD = "lightning_logra.rewards.code:code_execution_reward"
TRUSTING_CODE_REWARD = "lightning_logra.rewards.code:code_execution_reward_trusting_asserts"
GOOD = ["assert f(1) == 2", {"function": "f", "input": [2], "output": 3}, {"stdin": "", "stdout": "ok"}]


def data_with_tests(folder, rows_tests: list, tokenizer=None) -> PromptDataModule:
    path = folder / "code.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Write f, number {i}.", "tests": tests}) + "\n"
                            for i, tests in enumerate(rows_tests)))
    data = PromptDataModule(train=str(path), tokenizer=tokenizer, batch_size=2)
    data.setup("fit")
    return data


@pytest.mark.parametrize(("bad", "problem"), [
    ("assert f(1) == 2", r"must be None or a non-empty list, got str"),
    (["assert f(1) in (2, 3)"], r"item 0 \('assert f\(1\) in \(2, 3\)'\) is not of the form .* trust_asserts=True"),
    ([{"function": "f", "input": 2, "output": 3}], r"item 0: 'input' must be a list"),
])
def test_a_bad_row_is_named(tmp_path, bad, problem):
    data = data_with_tests(tmp_path, [GOOD, None, bad, GOOD])
    with pytest.raises(ValueError, match=rf"code.jsonl: train row 3: 'tests' for the code reward: {problem}"):
        check_tests_column(data, RewardRunner([CODE_REWARD]))


def test_the_trusting_variant_accepts_any_assert_and_other_rewards_check_nothing(tmp_path):
    data = data_with_tests(tmp_path, [GOOD, ["assert f(1) in (2, 3)"]])
    check_tests_column(data, RewardRunner([TRUSTING_CODE_REWARD]))
    other_data = data_with_tests(tmp_path, [GOOD, "not a list"])
    check_tests_column(other_data, RewardRunner(["tests.helpers.grpo:zero_reward"]))


def test_the_training_module_refuses_a_bad_row_before_any_step(model_folder, tmp_path):
    path = tmp_path / "code.jsonl"
    rows = [{"prompt": "Write f.", "tests": GOOD}, {"prompt": "Write g.", "tests": ["assert g(1) is None"]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    grpo = grpo_module(model_folder, reward=RewardConfig(functions=[CODE_REWARD]))
    with pytest.raises(ValueError, match=r"code.jsonl: train row 2: 'tests' for the code reward: item 0 .* "
                                         r"trust_asserts=True"):
        fit_grpo(grpo, model_folder, steps=1, data_options={"train": str(path), "val": None})
