import math

import pytest
import torch

from lightning_logra.rl.advantages import NonFiniteRewards, RunningBaseline, group_advantages
from lightning_logra.rl.losses import Corrections, dr_grpo_loss, grpo_loss, gspo_loss, reinforce_baseline_loss

INF = float("inf")


def test_group_advantages_center_and_scale_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0])
    # Group 1: mean 1/2, sample std sqrt(1/3). Group 2 (size 4): [3, 1, 1, 1] mean 3/2,
    # sample std sqrt((2.25 + 3 * 0.25) / 3) = 1.
    expected = [math.sqrt(3) / 2, -math.sqrt(3) / 2, -math.sqrt(3) / 2, math.sqrt(3) / 2, 1.5, -0.5, -0.5, -0.5]
    torch.testing.assert_close(group_advantages(rewards, 4, eps=0.0), torch.tensor(expected))
    unscaled = group_advantages(rewards, 4, normalize_std=False)
    torch.testing.assert_close(unscaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5]))


def test_group_advantages_of_identical_rewards_are_zero():
    torch.testing.assert_close(group_advantages(torch.ones(4), 2), torch.zeros(4))


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [(torch.ones(5), 2, "groups of 2"), (torch.ones(4), 1, "group_size"), (torch.ones(2, 2), 2, "1-D")],
)
def test_group_advantages_reject_bad_input(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size)


def test_running_baseline_shapes_failures_then_updates():
    baseline = RunningBaseline(weight=0.1, failure_reward=-0.01)
    # Shaped: [1, -0.01, -0.01, 1]; baseline still 0, so the advantages equal the shaped rewards.
    advantages = baseline.advantages(torch.tensor([1.0, 0.0, -1.0, 1.0]))
    torch.testing.assert_close(advantages, torch.tensor([1.0, -0.01, -0.01, 1.0]))
    assert baseline.value == pytest.approx(0.1 * 0.495)
    torch.testing.assert_close(baseline.advantages(torch.tensor([1.0, 0.5])), torch.tensor([1 - 0.0495, 0.5 - 0.0495]))
    assert baseline.value == pytest.approx(0.9 * 0.0495 + 0.1 * 0.75)
    restored = RunningBaseline()
    restored.load_state_dict(baseline.state_dict())
    assert restored.value == baseline.value


def test_running_baseline_without_shaping_keeps_rewards():
    baseline = RunningBaseline(weight=0.5, failure_reward=None)
    torch.testing.assert_close(baseline.advantages(torch.tensor([0.0, -2.0])), torch.tensor([0.0, -2.0]))
    assert baseline.value == -0.5


def clipping_case():
    """Two rows; row 0 has A = +1 and 3 completion tokens, row 1 A = -2 and a prompt token.

    Row 0 ratios 1.5 (clipped to 1.2), 0.9, 1.0 -> per-token loss -1.2, -0.9, -1.0.
    Row 1 ratios -, 0.5 (min(-1.0, 0.8 * -2) = -1.6 -> +1.6, clipped), 1.1 -> +2.2.
    The prompt position holds inf in old_logprobs: it must not leak into the loss.
    """
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -0.2]], requires_grad=True)
    ratios = torch.tensor([[1.5, 0.9, 1.0], [1.0, 0.5, 1.1]])
    old_logprobs = logprobs.detach() - ratios.log()
    old_logprobs[1, 0] = INF
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    return logprobs, old_logprobs, advantages, mask


def test_grpo_loss_token_aggregation_clips_and_masks():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    loss, stats = grpo_loss(logprobs, old_logprobs, advantages, mask)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.9 - 1.0 + 1.6 + 2.2) / 5))
    torch.testing.assert_close(stats["clip_fraction"], torch.tensor(2 / 5))
    loss.backward()
    # d/dlp of -ratio * A is -ratio * A on unclipped tokens, 0 on clipped and masked ones.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.9, -1.0], [0.0, 0.0, 2.2]]) / 5)


def test_grpo_loss_sequence_aggregation_averages_row_means():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    loss, _ = grpo_loss(logprobs, old_logprobs, advantages, mask, aggregation="sequence")
    torch.testing.assert_close(loss, torch.tensor(((-1.2 - 0.9 - 1.0) / 3 + (1.6 + 2.2) / 2) / 2))


def test_grpo_loss_epsilon_high_widens_the_upper_clip():
    logprobs = torch.zeros(1, 1)
    old_logprobs = -torch.tensor([[1.25]]).log()  # ratio 1.25, A = 1
    loss, stats = grpo_loss(logprobs, old_logprobs, torch.ones(1), torch.ones(1, 1), epsilon_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(-1.25))
    assert stats["clip_fraction"] == 0
    loss, stats = grpo_loss(logprobs, old_logprobs, torch.ones(1), torch.ones(1, 1))
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert stats["clip_fraction"] == 1


def test_grpo_loss_adds_k3_kl_to_the_reference():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    ref_logprobs = logprobs + torch.tensor([[math.log(2), 0.0, 5.0]])  # last token is masked
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = grpo_loss(logprobs, logprobs, torch.zeros(1), mask, ref_logprobs=ref_logprobs, kl_coef=0.5)
    k3 = 2 - math.log(2) - 1  # exp(d) - d - 1 at d = ln 2; 0 at d = 0
    torch.testing.assert_close(stats["kl"], torch.tensor(k3 / 2))
    torch.testing.assert_close(loss, torch.tensor(0.5 * k3 / 2))


def test_dr_grpo_loss_divides_by_a_constant():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    loss, stats = dr_grpo_loss(logprobs, old_logprobs, advantages, mask, max_completion_length=4)
    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.9 - 1.0 + 1.6 + 2.2) / (2 * 4)))
    torch.testing.assert_close(stats["clip_fraction"], torch.tensor(2 / 5))


def test_reinforce_loss_uses_truncated_importance_weights():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -30.0]], requires_grad=True)
    # Trainer/rollout ratios: 3 (capped at 2), 0.5, 1; the padding position is masked.
    rollout_logprobs = torch.tensor([[-1.0 - math.log(3), -2.0 + math.log(2)], [-0.5, 0.0]])
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = reinforce_baseline_loss(logprobs, rollout_logprobs, advantages, mask, corrections=Corrections(tis_cap=2.0))
    # -w * A * lp: -2 * 1 * -1 = 2, -0.5 * 1 * -2 = 1, -1 * -0.5 * -0.5 = -0.25.
    torch.testing.assert_close(loss, torch.tensor((2 + 1 - 0.25) / 3))
    torch.testing.assert_close(stats["tis_weight_mean"], torch.tensor((2 + 0.5 + 1) / 3))
    torch.testing.assert_close(stats["tis_capped_fraction"], torch.tensor(1 / 3))
    loss.backward()
    # The weight is detached: the gradient is -w * A / n.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, -0.5], [0.5, 0.0]]) / 3)


def test_grpo_loss_weights_each_token_by_its_capped_rollout_ratio():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    # Old-trainer/rollout ratios per token: 3 (capped at 2), 0.5, 1 on row 0; 1, 1 on row 1.
    rollout_logprobs = old_logprobs - torch.tensor([[math.log(3), math.log(0.5), 0.0], [0.0, 0.0, 0.0]])
    loss, stats = grpo_loss(logprobs, old_logprobs, advantages, mask, rollout_logprobs=rollout_logprobs, corrections=Corrections(tis_cap=2.0))
    torch.testing.assert_close(loss, torch.tensor((2 * -1.2 + 0.5 * -0.9 - 1.0 + 1.6 + 2.2) / 5))
    torch.testing.assert_close(stats["tis_weight_mean"], torch.tensor((2 + 0.5 + 1 + 1 + 1) / 5))
    torch.testing.assert_close(stats["tis_capped_fraction"], torch.tensor(1 / 5))
    dr_loss, _ = dr_grpo_loss(logprobs, old_logprobs, advantages, mask, max_completion_length=4,
                              rollout_logprobs=rollout_logprobs, corrections=Corrections(tis_cap=2.0))
    torch.testing.assert_close(dr_loss, loss * 5 / (2 * 4))


def test_gspo_loss_clips_the_geometric_mean_ratio_of_each_sequence():
    # Row 0: token log-ratios ln 1.5, ln 0.9, 0 -> s = (1.35)^(1/3) = 1.1052, A = +1, clipped at 1 + 0.1.
    # Row 1: log-ratios ln 0.5 (masked prompt position ignored), ln 1.1 -> s = 0.55^(1/2), A = -2, clipped at 0.9.
    logprobs, old_logprobs, advantages, mask = clipping_case()
    loss, stats = gspo_loss(logprobs, old_logprobs, advantages, mask, epsilon_low=0.1, epsilon_high=0.1)
    row0, row1 = 1.35 ** (1 / 3), 0.55 ** 0.5
    expected = (-min(row0 * 1, 1.1 * 1) + -min(row1 * -2, 0.9 * -2)) / 2
    torch.testing.assert_close(loss, torch.tensor(expected))
    torch.testing.assert_close(stats["clip_fraction"], torch.tensor(1.0))  # both left the range the way A pushes
    loss, stats = gspo_loss(logprobs, old_logprobs, advantages, mask, epsilon_low=0.5, epsilon_high=0.5)
    torch.testing.assert_close(loss, torch.tensor((-row0 + 2 * row1) / 2))
    assert stats["clip_fraction"] == 0


def test_gspo_loss_has_a_sequence_level_importance_weight():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    rollout_logprobs = old_logprobs - torch.tensor([[math.log(8), 0.0, 0.0], [0.0, math.log(1.44), 0.0]])
    loss, stats = gspo_loss(logprobs, old_logprobs, advantages, mask, epsilon_low=0.5, epsilon_high=0.5,
                            rollout_logprobs=rollout_logprobs, corrections=Corrections(tis_cap=1.5))
    # Sequence weights: 8^(1/3) = 2 (capped at 1.5) and 1.44^(1/2) = 1.2.
    row0, row1 = 1.35 ** (1 / 3), 0.55 ** 0.5
    torch.testing.assert_close(loss, torch.tensor((-row0 * 1.5 + 2 * row1 * 1.2) / 2))
    torch.testing.assert_close(stats["tis_weight_mean"], torch.tensor((1.5 + 1.2) / 2))
    torch.testing.assert_close(stats["tis_capped_fraction"], torch.tensor(0.5))


def test_losses_accept_per_token_advantages():
    logprobs, old_logprobs, advantages, mask = clipping_case()
    per_token = advantages.unsqueeze(1).expand(2, 3)
    torch.testing.assert_close(
        grpo_loss(logprobs, old_logprobs, per_token, mask)[0], grpo_loss(logprobs, old_logprobs, advantages, mask)[0]
    )


def test_losses_name_the_bad_input():
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        grpo_loss(logprobs, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages has shape"):
        grpo_loss(logprobs, logprobs, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask selects no tokens"):
        reinforce_baseline_loss(logprobs, logprobs, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="gspo needs one advantage per sequence"):
        gspo_loss(logprobs, logprobs, torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rollout_logprobs has shape"):
        grpo_loss(logprobs, logprobs, torch.zeros(2), torch.ones(2, 3), rollout_logprobs=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(logprobs, logprobs, torch.zeros(2), torch.ones(2, 3), aggregation="mean")


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_refuse_rewards_whose_mean_overflows_float32(normalize_std):
    with pytest.raises(NonFiniteRewards, match=r"group advantages: 2 of 2 values are not finite in float32; "
                                               r"the rewards range over \[3e\+38, 3e\+38\]"):
        group_advantages(torch.tensor([3e38, 3e38]), 2, normalize_std=normalize_std)


def test_running_baseline_refuses_rewards_that_would_make_it_non_finite_and_keeps_its_value():
    baseline = RunningBaseline(weight=0.5, failure_reward=None)
    baseline.load_state_dict({"value": -3e38})
    with pytest.raises(NonFiniteRewards, match=r"running baseline advantages \(baseline -3e\+38\): 2 of 2 values"):
        baseline.advantages(torch.tensor([3e38, 3e38]))
    assert baseline.value == -3e38
    fresh = RunningBaseline(weight=1.0, failure_reward=None)
    with pytest.raises(NonFiniteRewards, match="running baseline: the rewards' mean inf would make the baseline inf"):
        fresh.advantages(torch.tensor([3e38, 3e38]))
    assert fresh.state_dict() == {"value": 0.0}


def test_running_baseline_refuses_a_non_finite_saved_value():
    with pytest.raises(ValueError, match="running baseline state: value inf is not finite"):
        RunningBaseline().load_state_dict({"value": INF})


@pytest.mark.parametrize("loss", [grpo_loss, gspo_loss, reinforce_baseline_loss])
def test_losses_refuse_non_finite_advantages(loss):
    logprobs = torch.zeros(2, 3)
    with pytest.raises(NonFiniteRewards, match="advantages hold 1 non-finite values"):
        loss(logprobs, logprobs, torch.tensor([1.0, math.nan]), torch.ones(2, 3))
