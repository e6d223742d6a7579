"""Every way a reward function can misbehave, at once, through a real GRPOModule on the tiny
model (issue 23): each step's rewards take at most the timeout plus 1 s per function, every
failure is counted and warned about once, and the weights stay finite. Worker processes: one
per plain reward function, forked from a forkserver."""

import pytest
import torch

from lightning_logra.rewards import RewardConfig, RewardWarning
from lightning_logra.rl.advantages import NonFiniteRewards
from tests.helpers.grpo import fit_grpo, grpo_module, rewards

CHAOS = ["hanging_reward", "gil_holding_reward", "raising_reward", "wrong_length_reward", "nan_reward",
         "huge_finite_reward", "generator_reward", "non_list_reward"]
TIMEOUT_S = 1.0


def test_chaos_rewards_cost_at_most_their_timeout_and_leave_the_weights_finite(model_folder):
    # Two functions time out on every step: a limit of 4 timeouts in a row lets 3 steps run.
    functions = [f"tests.helpers.chaos_rewards:{name}" for name in CHAOS] + rewards("varied_reward")
    reward = RewardConfig(functions=functions, timeout_s=TIMEOUT_S, max_consecutive_timeouts=4)
    grpo = grpo_module(model_folder, reward=reward)
    grpo.reward_runner.start()  # the forkserver's first start imports the package: not a step's cost
    caught = []
    trainer, logged = fit_grpo(grpo, model_folder, steps=3, caught_warnings=caught)
    assert trainer.global_step == 3 and len(logged) == 3
    for metrics in logged:
        assert metrics["perf/rewards_s"] < TIMEOUT_S + 1.0 * len(CHAOS)
        assert metrics["reward/failures"] == 4 * len(CHAOS)  # 4 samples a step, each function fails them all
        assert metrics["reward/varied_reward/mean"] == pytest.approx(metrics["reward/mean"])
    assert all(torch.isfinite(parameter).all() for parameter in grpo.policy.parameters())
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, RewardWarning)]
    assert sorted(message.split("'")[1] for message in messages) == sorted(CHAOS)  # one warning per function


def test_reward_functions_that_keep_timing_out_stop_the_run(model_folder):
    grpo = grpo_module(model_folder, reward=RewardConfig(functions=["tests.helpers.chaos_rewards:hanging_reward"],
                                                         timeout_s=TIMEOUT_S, max_consecutive_timeouts=2))
    grpo.reward_runner.start()
    with pytest.raises(RuntimeError, match=r"'hanging_reward' did not return within timeout_s=1.0 s on 2 batches"):
        fit_grpo(grpo, model_folder, steps=3)


def test_rewards_whose_advantages_overflow_stop_the_step_naming_the_reward_function(model_folder):
    # 3e38 is finite in float32, but a group's mean of two of them is not.
    grpo = grpo_module(model_folder, reward=RewardConfig(functions=["tests.helpers.chaos_rewards:float32_max_reward"]))
    with pytest.raises(NonFiniteRewards, match=r"group advantages: 4 of 4 values are not finite .*"
                                               r"scale down the rewards of 'float32_max_reward' \(weight 1.0\)"):
        fit_grpo(grpo, model_folder, steps=1)
    assert all(torch.isfinite(parameter).all() for parameter in grpo.policy.parameters())
