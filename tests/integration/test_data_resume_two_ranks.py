"""A fit resumed on another number of ranks trains the rest of the epoch's rows, each once:
the data position is a count of rows consumed by all ranks together."""

import pytest

from tests.helpers.data import epoch_order, fit_prompts
from tests.helpers.distributed import run_lightning_on_two_ranks

ROWS = 16  # in batches of 2: 4 steps an epoch on 2 ranks, 8 on 1


def _fit_on_two_ranks(rank, world, folder, max_steps, ckpt_path, every_n_steps):
    return fit_prompts(folder, max_steps, ckpt_path, train_size=ROWS, every_n_steps=every_n_steps, devices=2)


def pairs(prompts: list[str]) -> list[list[str]]:
    return [prompts[i : i + 2] for i in range(0, len(prompts), 2)]


@pytest.mark.distributed
def test_two_ranks_resumed_on_one_train_the_rest_of_the_epoch_once(tmp_path):
    first = run_lightning_on_two_ranks(_fit_on_two_ranks, tmp_path / "two", 2, None, 2)
    assert first == [pairs(epoch_order(ROWS, 0, 2, rank)[:4]) for rank in (0, 1)]
    resumed = fit_prompts(tmp_path / "one", 7, tmp_path / "two" / "epoch=0-step=2.ckpt", train_size=ROWS,
                          every_n_steps=100)
    trained = [prompt for rank in first for batch in rank for prompt in batch]
    rest = [prompt for batch in resumed[:4] for prompt in batch]
    assert sorted(trained + rest) == sorted(epoch_order(ROWS, 0, 1, 0))  # each row of epoch 0 once
    assert resumed[4] == epoch_order(ROWS, 1, 1, 0)[:2]  # then epoch 1 from its start


@pytest.mark.distributed
def test_one_rank_resumed_on_two_trains_the_rest_of_the_epoch_once(tmp_path):
    first = fit_prompts(tmp_path / "one", 3, train_size=ROWS, every_n_steps=3)
    order = epoch_order(ROWS, 0, 1, 0)
    assert first == pairs(order[:6])
    resumed = run_lightning_on_two_ranks(_fit_on_two_ranks, tmp_path / "two", 6,
                                         tmp_path / "one" / "epoch=0-step=3.ckpt", 100)
    for rank in (0, 1):
        # The 10 rows left, 5 a rank: 2 full batches each (the fifth row waits for a later
        # epoch), then epoch 1 from its start.
        assert resumed[rank][:2] == pairs(order[6:][rank::2][:4])
        assert resumed[rank][2] == epoch_order(ROWS, 1, 2, rank)[:2]
