"""policy/step_kl (rl/step_kl.py), and the KL budget measured by it: a LoGRA step moves the
policy on its whole batch by about the budget, not only on the rows its probe scored."""

import pytest
import torch

from lightning_logra.core.config import LoGRAConfig
from lightning_logra.core.optimizer import LoGRAOptimizer
from lightning_logra.rl.batch import backward_micro_batches
from lightning_logra.rl.metrics import PassTotals
from lightning_logra.rl.step import run_update
from lightning_logra.rl.step_kl import SAMPLES, completion_kl, draw_tokens, k3_sums, plan_draw
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch

GENERATIONS = 8
PROMPTS = [3] * GENERATIONS + [5] * GENERATIONS
COMPLETIONS = [6, 7, 5, 8, 6, 7, 5, 6, 7, 6, 8, 5, 7, 6, 5, 8]
ROWS = slice(0, len(PROMPTS))


def rare_success_batch(seed: int):
    """Two prompts x 8 samples as GRPO scores binary rewards: the first prompt's samples all
    failed (advantage 0), one of the second's succeeded (+2.47 against -0.35 for the rest)."""
    batch = rollout_batch(PROMPTS, COMPLETIONS, seed=seed)
    batch.advantages = torch.tensor([0.0] * GENERATIONS + [-0.35] * (GENERATIONS - 1) + [2.47])
    return batch


def full_log_softmax(model, batch) -> torch.Tensor:
    """float64 log-softmax at every position of the batch (B x (T-1) x vocabulary)."""
    rollouts = batch.rollouts
    positions = (rollouts.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=rollouts.input_ids, attention_mask=rollouts.attention_mask,
                       position_ids=positions).logits[:, :-1]
    return torch.log_softmax(logits.double() / micro_batching().temperature, dim=-1)


def exact_log_softmax(model, batch) -> torch.Tensor:
    """float64 log-softmax at every trained position of the batch (positions x vocabulary)."""
    return full_log_softmax(model, batch)[batch.mask]


def exact_step_kl(before: torch.Tensor, after: torch.Tensor) -> float:
    return float((before.exp() * (before - after)).sum(-1).mean())


def logra_update(batch, kl_probe: str, probe_responses: int, seed: int):
    """One LoGRA update of a fresh tiny model on the batch; the batch's exact step KL over the
    budget, and the model."""
    torch.manual_seed(seed)
    model = tiny_qwen2().train()
    optimizer = LoGRAOptimizer(model, LoGRAConfig(rank=8, update_ratio=1e-2, kl_budget=1e-5, kl_probe=kl_probe,
                                                  probe_responses=probe_responses, mismatch_subtraction=False))
    before = exact_log_softmax(model, batch)
    update = run_update(model, optimizer, batch, ROWS, micro_batching(size=8), backward=torch.Tensor.backward,
                        passes=PassTotals.zeros(torch.device("cpu")), num_generations=GENERATIONS, logra=True)
    assert update.report.alpha < optimizer.config.alpha_max  # the budget, not alpha_max, set the step
    return exact_step_kl(before, exact_log_softmax(model, batch)) / update.report.budget


def test_the_stratified_probe_holds_the_whole_batch_to_the_budget():
    # Five batches where the step's KL sits in the rare success's row. The authors' probe
    # scores the first response of each prompt and misses it: the batch moves 1.6-2.2x the
    # budget on three of five. Eight responses drawn stratified by advantage (of 16) keep
    # every step within [0.67, 1.5] of it (issue 41's target); the rest of the gap to 1.0 is
    # the second-order prediction's own error (0.88-1.0 with all 16 rows probed).
    reference = [logra_update(rare_success_batch(seed), "reference", 2, seed) for seed in range(5)]
    stratified = [logra_update(rare_success_batch(seed), "stratified", 8, seed) for seed in range(5)]
    assert sum(ratio > 1.5 for ratio in reference) >= 2, reference
    assert all(0.67 <= ratio <= 1.5 for ratio in stratified), stratified


def test_the_weighted_probe_needs_fewer_rows_as_it_never_leaves_the_rare_success_to_chance():
    # With 4 rows of 16, equal-position strata put the success's row in a stratum of 4 and
    # one step of five moves 1.62x the budget; strata of equal expected KL probe it for
    # certain, and every step stays within [0.67, 1.5] (0.71-1.23).
    stratified = [logra_update(rare_success_batch(seed), "stratified", 4, seed) for seed in range(5)]
    weighted = [logra_update(rare_success_batch(seed), "weighted", 4, seed) for seed in range(5)]
    assert any(ratio > 1.5 for ratio in stratified), stratified
    assert all(0.67 <= ratio <= 1.5 for ratio in weighted), weighted


def test_a_step_that_moves_nothing_measures_exactly_zero_over_all_trained_positions():
    model, batch, settings = tiny_qwen2(), rare_success_batch(0), micro_batching(size=3)
    for count in (0, 4):
        draw = draw_tokens(model, batch, ROWS, settings, count=count, generator=torch.Generator().manual_seed(0))
        k3_sum, positions = k3_sums(model, batch, draw, settings)
        assert k3_sum.item() == 0.0
        if count == 0:  # every row, each standing for itself
            assert positions.item() == batch.mask.sum().item()
        else:  # drawn by expected KL share: the weighted positions estimate them (a ratio's denominator)
            assert 0.5 * batch.mask.sum().item() < positions.item() < 2 * batch.mask.sum().item()
        assert draw.tokens.shape[-1] == SAMPLES


def test_the_estimate_is_k3_of_tokens_drawn_from_the_policy_before_the_step():
    batch, settings = rare_success_batch(1), micro_batching(size=5)
    moved = tiny_qwen2()
    before = exact_log_softmax(moved, batch)
    draw = draw_tokens(moved, batch, ROWS, settings, count=0, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.05)
    after = exact_log_softmax(moved, batch)
    k3_sum, positions = k3_sums(moved, batch, draw, settings)
    # Independently, from the full float64 distributions at the drawn tokens.
    tokens = draw.tokens[batch.mask[draw.rows]]
    log_ratio = after.gather(-1, tokens) - before.gather(-1, tokens)
    want = (log_ratio.exp() - 1 - log_ratio).mean(dim=-1).sum()
    assert positions.item() == batch.mask.sum().item()
    # float32 log-probs from a different batch shape: ~1e-6 per token.
    torch.testing.assert_close(k3_sum, want, rtol=1e-4, atol=1e-7)
    # And the draws follow the pre-step policy: the drawn tokens' log-probs are its own.
    torch.testing.assert_close(draw.logprobs[batch.mask[draw.rows]].double(), before.gather(-1, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("settings", [micro_batching(size=3), micro_batching(tokens=24)], ids=["padded", "packed"])
def test_the_training_forward_draws_from_the_pre_step_policy_and_trains_exactly_as_without(settings):
    batch = rare_success_batch(4)

    def train(draw_at):
        model = tiny_qwen2().train()
        trained = backward_micro_batches(model, batch, ROWS, settings, backward=torch.Tensor.backward,
                                         passes=PassTotals.zeros(torch.device("cpu")), draw_at=draw_at)
        return model, trained, [parameter.grad for parameter in model.parameters()]

    _, plain, plain_gradients = train(None)
    draw = plan_draw(batch, ROWS, count=4, generator=torch.Generator().manual_seed(5))
    model, trained, gradients = train(draw.in_micro_batch)
    # The draws take no gradient and a generator of their own: training is bit for bit the same.
    assert torch.equal(trained, plain)
    assert all(torch.equal(a, b) for a, b in zip(gradients, plain_gradients))
    # Every drawn row was drawn once, in the forward of its micro-batch ...
    slots = torch.cat([part.slots for part in draw.forward_draws]).sort().values
    assert torch.equal(slots, torch.arange(len(draw.rows))) and draw.forward_seconds > 0
    # ... from the policy before any step: the drawn tokens' log-probs are its own (float32
    # head in chunks against float64 over the whole vocabulary: ~1e-6).
    trained_positions = batch.mask[draw.rows]
    tokens = draw.tokens[trained_positions]
    before = full_log_softmax(model, batch)[draw.rows][trained_positions].gather(-1, tokens)
    torch.testing.assert_close(draw.logprobs[trained_positions].double(), before, rtol=0, atol=1e-5)
    # Nothing stepped: k3 after is the round-off between two forwards of other shapes, and
    # the denominator is the drawn rows' trained positions, each row's times its weight.
    k3_sum, positions = k3_sums(model, batch, draw, settings)
    assert 0 <= k3_sum.item() < 1e-9
    assert positions.item() == pytest.approx((draw.weights * trained_positions.sum(dim=1)).sum().item(), rel=1e-12)


def test_its_mean_over_draws_is_the_exact_kl_of_the_step():
    batch, settings = rare_success_batch(2), micro_batching(size=8)
    moved = tiny_qwen2()
    before = exact_log_softmax(moved, batch)
    draws = [draw_tokens(moved, batch, ROWS, settings, count=4, generator=torch.Generator().manual_seed(seed))
             for seed in range(120)]
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.05)
    exact = exact_step_kl(before, exact_log_softmax(moved, batch))
    estimates = torch.tensor([(lambda s: (s[0] / s[1]).item())(k3_sums(moved, batch, draw, settings))
                              for draw in draws])
    # Unbiased: the mean of 120 independent estimates (4 of 16 rows, 4 tokens a position)
    # lies within 4 standard errors of the exact KL.
    standard_error = estimates.std() / len(estimates) ** 0.5
    assert abs(estimates.mean() - exact) < 4 * standard_error
    assert standard_error < 0.05 * exact  # and the check has the power to see a 20% bias


def test_completion_kl_of_a_model_and_itself_is_exactly_zero_and_of_a_moved_one_its_k3():
    batch, settings = rare_success_batch(3), micro_batching(size=4)
    policy, initial = tiny_qwen2(), tiny_qwen2()
    kl_sum, positions = completion_kl(policy, initial, batch.rollouts, settings, torch.Generator().manual_seed(0))
    completion_positions = batch.rollouts.completion_mask[:, 1:].sum().item()
    assert kl_sum.item() == 0.0 and positions.item() == completion_positions
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.05)
    estimates = torch.tensor([(lambda s: (s[0] / s[1]).item())(
        completion_kl(policy, initial, batch.rollouts, settings, torch.Generator().manual_seed(seed)))
        for seed in range(40)])
    # KL(policy || initial): tokens drawn from the moved policy, so its own distributions weigh them.
    moved_batch = rare_success_batch(3)
    moved_batch.mask = batch.rollouts.completion_mask[:, 1:].bool()
    exact = exact_step_kl(exact_log_softmax(policy, moved_batch), exact_log_softmax(initial, moved_batch))
    standard_error = estimates.std() / len(estimates) ** 0.5
    assert abs(estimates.mean() - exact) < 4 * standard_error and standard_error < 0.05 * exact
