"""Dynamic sampling with mini-batches on two processes: each rank drops its own groups, yet
both run the same sampling rounds and updates and keep the same weights."""

import pytest
import torch

from lightning_logra import LoGRACallback, LoGRAConfig, LoGRAFSDPStrategy
from lightning_logra.modules import BatchingConfig, RolloutConfig
from tests.helpers.distributed import run_lightning_on_two_ranks
from tests.helpers.grpo import fit_grpo, grpo_module, reward_config


def _two_rank_dynamic_mini_batches(rank, world, folder):
    grpo = grpo_module(folder, batching=BatchingConfig(micro_batch_size=2, mini_batches=2),
                       reward=reward_config("odd_answer_reward"),
                       rollout=RolloutConfig(num_generations=2, max_new_tokens=6, dynamic_sampling=True, max_sampling_rounds=2))
    strategy = LoGRAFSDPStrategy(logra=LoGRAConfig(rank=8, update_ratio=1e-3))
    trainer, logged = fit_grpo(grpo, folder, steps=4, strategy=strategy, callbacks=[LoGRACallback()], devices=2)
    weights = [s.weight.full_tensor() for s in strategy.logra_optimizer.sketches]
    return trainer.global_step, strategy.logra_optimizer.update_count, sum(step["sampling/dropped_groups"] for step in logged), weights


@pytest.mark.distributed
def test_two_processes_agree_on_sampling_rounds_and_updates(model_folder):
    # Each rank drops its own groups, yet both run the same generation rounds (generation under
    # FSDP2 is a collective: a mismatch would hang) and updates, and their weights stay equal.
    (steps0, updates0, dropped0, weights0), (steps1, updates1, dropped1, weights1) = run_lightning_on_two_ranks(
        _two_rank_dynamic_mini_batches, model_folder)
    assert steps0 == steps1 == 4 and updates0 == updates1 == 4
    assert dropped0 == dropped1 > 0  # groups were dropped (metrics are summed over ranks)
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))
