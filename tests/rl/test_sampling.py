"""Dynamic sampling (DAPO) and the soft overlong penalty, on hand-made scored rollouts."""

import pytest
import torch

from lightning_logra.rl.sampling import (
    ScoredRollouts,
    fill_informative_groups,
    informative_groups,
    overlong_penalty,
)
from lightning_logra.rewards import RewardScores
from lightning_logra.rollout import pack_rollouts


def scored(rewards: list[float], tag: str) -> ScoredRollouts:
    """Rows of one-token prompts and completions; the completion text names the row."""
    rows = len(rewards)
    rollouts = pack_rollouts([[1]] * rows, [[2 + row] for row in range(rows)], [[-1.0]] * rows,
                             [f"{tag}{row}" for row in range(rows)], [True] * rows, pad_token_id=0)
    scores = RewardScores(total=list(rewards), per_function={"r": list(rewards)}, failures=1, unscored=0)
    columns = {"prompt_text": [f"{tag}-prompt{row // 2}" for row in range(rows)]}
    return ScoredRollouts(rollouts, columns, scores, torch.tensor(rewards))


def test_overlong_penalty_falls_linearly_over_the_buffer():
    lengths = torch.tensor([0, 12, 13, 14, 16])
    torch.testing.assert_close(overlong_penalty(lengths, max_new_tokens=16, buffer=4, penalty=1.0),
                               torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))


def test_informative_groups_are_those_whose_rewards_differ():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2) == [False, True, False]


def test_dynamic_sampling_replaces_equal_reward_groups_with_new_ones():
    first = scored([1.0, 1.0, 0.0, 1.0], "a")  # group 0 all equal, group 1 informative
    rounds = []

    def more(round_):
        rounds.append(round_)
        return scored([0.0, 0.0, 0.5, 0.0], "b")  # only its group 1 is informative

    batch, stats = fill_informative_groups(first, more, group_size=2, max_rounds=3, pad_token_id=0, any_rank=bool)
    assert rounds == [1]
    assert batch.rollouts.completion_text == ["a2", "a3", "b2", "b3"]
    assert batch.rewards.tolist() == [0.0, 1.0, 0.5, 0.0]
    assert batch.scores.per_function["r"] == [0.0, 1.0, 0.5, 0.0]
    assert batch.columns["prompt_text"] == ["a-prompt1", "a-prompt1", "b-prompt1", "b-prompt1"]
    assert batch.scores.failures == 2  # both rounds' failures count
    assert (stats.extra_rounds, stats.dropped_groups, stats.unfilled_groups) == (1, 2, 0)


def test_dynamic_sampling_fills_up_with_dropped_groups_after_the_last_round():
    first = scored([1.0, 1.0, 0.0, 1.0], "a")
    batch, stats = fill_informative_groups(first, lambda _: scored([0.0, 0.0, 0.0, 0.0], "b"), group_size=2,
                                           max_rounds=2, pad_token_id=0, any_rank=bool)
    assert batch.rollouts.completion_text == ["a2", "a3", "a0", "a1"]
    assert (stats.extra_rounds, stats.dropped_groups, stats.unfilled_groups) == (2, 5, 1)


def test_dynamic_sampling_keeps_a_full_first_batch_as_it_is():
    first = scored([1.0, 0.0, 0.0, 1.0], "a")
    batch, stats = fill_informative_groups(first, lambda _: pytest.fail("no round needed"), group_size=2,
                                           max_rounds=3, pad_token_id=0, any_rank=bool)
    assert batch is first and stats.extra_rounds == 0


def test_dynamic_sampling_runs_rounds_while_any_rank_needs_them():
    first = scored([1.0, 0.0, 0.0, 1.0], "a")  # full here, but another rank is not
    calls = []
    _, stats = fill_informative_groups(first, lambda _: scored([1.0, 0.0, 1.0, 0.0], "b"), group_size=2,
                                       max_rounds=2, pad_token_id=0, any_rank=lambda flag: calls.append(flag) or True)
    assert calls == [False, False] and stats.extra_rounds == 2
