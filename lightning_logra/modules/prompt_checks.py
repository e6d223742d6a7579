"""Checks of a training module's prompt data against what the module needs, made when the
two meet at Lightning's setup (the reference answers of the built-in math reward, the code
reward's tests, the model's positions), and a warning when no reward function scored a whole
batch."""

from __future__ import annotations

import warnings

from lightning_logra.data import PromptDataModule
from lightning_logra.rewards.code import trusts_asserts
from lightning_logra.rewards.code_tests import problem_in_tests
from lightning_logra.rewards.math import math_reward
from lightning_logra.rewards.runner import RewardRunner, RewardScores, RewardWarning


def check_answer_column(data: PromptDataModule, runner: RewardRunner) -> None:
    """The built-in math reward scores a row by its ``answer``: a split where no row has one
    would train on all-zero rewards, so it is refused."""
    if math_reward not in runner.functions:
        return
    for split, dataset in data.datasets.items():
        if all(column["answer"] is None for column in dataset.columns):
            raise ValueError(
                f"{data.sources[split][0]}: no {split} row has an 'answer' column, which the built-in math reward "
                "compares completions with: rename the dataset's reference column to it with the data module's "
                "field_map (e.g. {'solution': 'answer'}), or pass reward functions that do not read it")


def check_tests_column(data: PromptDataModule, runner: RewardRunner) -> None:
    """The code rewards score a row by its ``tests``: a malformed row, or an assert that only
    the program's own process could run without ``trust_asserts``, is refused before the
    first step, naming the split and the row (1-based, counted after invalid rows skipped)."""
    for trust in {trusts_asserts(function) for function in runner.functions} - {None}:
        for split, dataset in data.datasets.items():
            for row, columns in enumerate(dataset.columns, start=1):
                problem = problem_in_tests(columns.get("tests"), trust_asserts=trust)
                if problem is not None:
                    raise ValueError(f"{data.sources[split][0]}: {split} row {row}: 'tests' for the code reward: "
                                     f"{problem}")


def drop_prompts_past_positions(data: PromptDataModule, model_config, tokenizer, max_new_tokens: int,
                                tool_tokens: int = 0) -> None:
    """Drop (and count) prompts that, with ``max_new_tokens`` generated after them, would go
    past the model's ``max_position_embeddings``: generating past them fails deep inside
    the model (or, with rotary positions, samples from positions it never learnt).
    ``tool_tokens``: what listing the tools adds to each prompt (multi-turn rollouts)."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is None:
        return
    room = positions - max_new_tokens - tool_tokens
    tools = f" and the {tool_tokens} tokens listing the tools" if tool_tokens else ""
    if room < 1:
        verb = "leave" if tool_tokens else "leaves"
        raise ValueError(f"rollout.max_new_tokens = {max_new_tokens}{tools} {verb} no room for a prompt in the model's "
                         f"{positions} positions (max_position_embeddings)")
    data.drop_long_prompts(room, tokenizer, reason=f"the model's {positions} positions less rollout.max_new_tokens "
                                                   f"= {max_new_tokens}{tools}")


def warn_if_unscored(scores: RewardScores, columns: dict[str, list], runner: RewardRunner) -> bool:
    """Warn (a ``RewardWarning``) when every reward function returned None for every sample
    of a batch, which then all score 0, as TRL does; names the columns that are None in every
    row, typically the one a reward reads. Returns whether it warned."""
    if not scores.total or scores.unscored < len(scores.total):
        return False
    empty = [key for key, values in columns.items() if all(value is None for value in values)]
    cause = (f"the columns {empty} are None in every row: check the dataset's columns (PromptDataModule.field_map "
             "renames them)") if empty else "check what they read from the dataset's columns"
    warnings.warn(f"no reward function ({', '.join(runner.names)}) scored any of the {len(scores.total)} samples "
                  f"of a batch, which all count as 0; {cause}", RewardWarning, stacklevel=3)
    return True
