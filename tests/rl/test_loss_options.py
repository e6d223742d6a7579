"""The loss options peers expose (issue 44 part 3): KL estimators against their closed forms,
TRL's importance-sampling modes, the off-policy sequence mask, the entropy bonus, the
authors' length-normalised advantage and success threshold; each exact where the math is."""

import math

import pytest
import torch

from lightning_logra.rl.advantages import RunningBaseline, length_scaled
from lightning_logra.rl.batch import backward_micro_batches
from lightning_logra.rl.config import LossConfig
from lightning_logra.rl.importance import importance_weights, off_policy_keep
from lightning_logra.rl.kl_estimators import kl_estimate
from lightning_logra.rl.losses import Corrections, grpo_loss, gspo_loss, micro_batch_loss
from lightning_logra.rl.metrics import PassTotals
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch


def test_each_kl_estimator_averages_to_its_closed_form_over_the_policy():
    # Every token of a 4-token vocabulary, weighted by its policy probability: the exact
    # expectation of each estimator under sampling from the policy.
    policy = torch.tensor([0.5, 0.25, 0.15, 0.10])
    reference = torch.tensor([0.25, 0.25, 0.25, 0.25])
    log_ratio = reference.log() - policy.log()
    kl = float((policy * (policy / reference).log()).sum())

    def expectation(estimator):
        return float((policy * kl_estimate(log_ratio, estimator)).sum())

    assert expectation("k1") == pytest.approx(kl, rel=1e-6)
    assert expectation("k3") == pytest.approx(kl, rel=1e-6)
    assert expectation("low_var") == pytest.approx(kl, rel=1e-6)  # nothing here reaches its clamps
    assert expectation("k2") == pytest.approx(float((policy * (policy / reference).log().square()).sum()) / 2, rel=1e-6)
    # low_var clamps a token far off the reference at 10; k3 does not.
    far = torch.tensor([30.0])
    assert float(kl_estimate(far, "low_var")) == 10.0 and float(kl_estimate(far, "k3")) > 1e12
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_estimate(far, "k4")


def test_the_kl_penalty_uses_the_chosen_estimator():
    logprobs = torch.zeros(1, 2)
    reference = torch.tensor([[math.log(2.0), 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for estimator, per_token in (("k1", -math.log(2.0)), ("k2", math.log(2.0) ** 2 / 2), ("k3", 1 - math.log(2.0))):
        _, stats = grpo_loss(logprobs, logprobs, torch.zeros(1), mask, ref_logprobs=reference, kl_coef=1.0,
                             corrections=Corrections(kl_estimator=estimator))
        assert float(stats["kl"]) == pytest.approx(per_token / 2), estimator


def ratios(*values):
    return torch.tensor([values]).log()


def test_importance_sampling_modes_truncate_or_mask_per_token_or_per_sequence():
    # Two rows of two tokens; trainer - rollout log ratios give token ratios [0.5, 4] and [1.5, 1.0].
    trainer = torch.cat([ratios(0.5, 4.0), ratios(1.5, 1.0)])
    rollout = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)

    def weights(mode, floor=None):
        weight, stats = importance_weights(trainer, rollout, mask, mode=mode, cap=3.0, floor=floor)
        return weight.flatten().tolist(), float(stats["tis_capped_fraction"])

    close = pytest.approx
    assert weights("token_truncate") == (close([0.5, 3.0, 1.5, 1.0]), 0.25)
    assert weights("token_truncate", floor=0.8) == (close([0.8, 3.0, 1.5, 1.0]), 0.5)
    assert weights("token_mask", floor=0.8) == (close([0.0, 0.0, 1.5, 1.0]), 0.5)
    # Per sequence: row ratios 0.5 * 4 = 2 and 1.5 * 1 = 1.5, both inside [0, 3].
    assert weights("sequence_truncate") == (close([2.0, 2.0, 1.5, 1.5]), 0.0)
    assert weights("sequence_mask", floor=1.8) == (close([2.0, 2.0, 0.0, 0.0]), 0.5)
    with pytest.raises(ValueError, match="floor < cap"):
        importance_weights(trainer, rollout, mask, cap=1.0, floor=1.0)


def test_the_default_mode_is_todays_truncated_importance_sampling_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    old, rollout = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    mask = torch.rand(3, 5, generator=generator) > 0.3
    weight, _ = importance_weights(old, rollout, mask)
    expected = torch.where(mask, torch.where(mask, old - rollout, 0.0).exp().clamp(max=2.0), 0.0)
    assert torch.equal(weight, expected)


def test_the_off_policy_mask_drops_negative_advantage_sequences_far_from_the_behaviour_policy():
    trainer = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -3.0], [-1.0, 0.0]])
    rollout = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, -1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    advantages = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    # Mean rollout - trainer per row: 1, 1, 1 (over its 2 tokens: 0 and 2), no tokens.
    keep, stats = off_policy_keep(advantages, trainer, rollout, mask, threshold=0.5)
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 0.0, 1.0] and float(stats["off_policy_masked_fraction"]) == 0.5
    keep, _ = off_policy_keep(advantages, trainer, rollout, mask, threshold=1.0)  # not above: kept
    assert keep.squeeze(1).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_micro_batch_loss_leaves_masked_sequences_out_with_the_normaliser_unchanged():
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[0.0, 0.0], [-2.0, -2.0]])  # row 0 is 1 nat per token off the behaviour policy
    mask = torch.ones(2, 2, dtype=torch.bool)
    advantages = torch.tensor([-1.0, 1.0])
    config = LossConfig(off_policy_mask_threshold=0.5)
    loss, stats = micro_batch_loss(config, logprobs, logprobs.detach(), rollout, advantages, mask, None,
                                   max_completion_length=2, tis=False)
    # Only row 1's two tokens count, over all 4 tokens: -(1 * ratio 1) * 2 / 4.
    assert loss.item() == pytest.approx(-0.5) and float(stats["off_policy_masked_fraction"]) == 0.5
    loss.backward()
    assert logprobs.grad[0].tolist() == [0.0, 0.0] and logprobs.grad[1].tolist() == [-0.25, -0.25]


def test_gspo_takes_the_sequence_modes_and_config_refuses_token_mask_for_it():
    logprobs = torch.zeros(2, 2)
    rollout = torch.cat([ratios(0.5, 0.5), ratios(2.0, 2.0)]) * -1  # old - rollout = log ratios 0.5,0.5 and 2,2
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, stats = gspo_loss(logprobs, logprobs, torch.ones(2), mask, rollout_logprobs=rollout,
                         corrections=Corrections(importance_sampling_mode="sequence_mask", tis_cap=3.0))
    # Sequence ratios 0.25 and 4: the second is masked (weight 0).
    assert float(stats["tis_weight_mean"]) == pytest.approx(0.125) and float(stats["tis_capped_fraction"]) == 0.5
    _, stats = gspo_loss(logprobs, logprobs, torch.ones(2), mask, rollout_logprobs=rollout,
                         corrections=Corrections(tis_cap=3.0))  # GSPO's own geometric mean: 0.5 and 2
    assert float(stats["tis_weight_mean"]) == pytest.approx(1.25) and float(stats["tis_capped_fraction"]) == 0.0
    with pytest.raises(ValueError, match="importance_sampling_mode = 'token_mask' is invalid"):
        LossConfig(type="gspo", importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match="tis_min = 2.0 is invalid: must be below tis_cap"):
        LossConfig(tis_min=2.0)


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_the_entropy_bonus_subtracts_the_mean_entropy_of_the_trained_tokens(loss_type):
    """Whatever the loss's own normaliser (tokens for grpo, sequences for gspo), the bonus's
    gradient is that of -coef x the mean entropy over every trained token of the update,
    summed over micro-batches of 2 rows."""
    batch = rollout_batch([3, 2, 4, 3], [5, 2, 3, 4], seed=1)
    model = tiny_qwen2().train()
    grads = {}
    for coef in (0.0, 0.3):
        model.zero_grad()
        backward_micro_batches(model, batch, slice(0, 4), micro_batching(LossConfig(type=loss_type, entropy_coef=coef)),
                               backward=torch.Tensor.backward, passes=PassTotals.zeros(torch.device("cpu")))
        grads[coef] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, entropy = micro_batching().logprobs(model, batch.rollouts.input_ids, batch.rollouts.attention_mask,
                                           return_entropy=True)
    (-0.3 * torch.where(batch.mask, entropy, 0.0).sum() / batch.mask.sum()).backward()
    for with_bonus, without, parameter in zip(grads[0.3], grads[0.0], model.parameters()):
        torch.testing.assert_close(with_bonus - without, parameter.grad, rtol=1e-4, atol=1e-6)


def test_length_scaled_advantages_and_the_authors_success_threshold():
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    scaled = length_scaled(torch.tensor([0.8, -0.21, 0.5]), mask, 1024.0)
    torch.testing.assert_close(scaled, torch.tensor([0.8 * 512, -0.21 * 1024 / 6, 0.5]))
    baseline = RunningBaseline(weight=0.1, failure_reward=-0.01, success_threshold=1.0)
    baseline.value = 0.2
    advantages = baseline.advantages(torch.tensor([1.0, 0.5, 0.0, 1.5]))
    torch.testing.assert_close(advantages, torch.tensor([0.8, -0.21, -0.21, 0.8]))
    assert baseline.value == pytest.approx(0.9 * 0.2 + 0.1 * (2 - 0.02) / 4)
    # Today's mapping keeps the fractional reward.
    assert RunningBaseline(weight=0.1).advantages(torch.tensor([0.5, 0.0])).tolist() == pytest.approx([0.5, -0.01])
