"""policy/step_kl: how far one optimizer step moved the policy, k3 on the step's own tokens."""

import torch

from lightning_logra.rl.batch import backward_micro_batches, step_kl_terms
from lightning_logra.rl.logprobs import sequence_logprobs
from lightning_logra.rl.metrics import PassTotals
from tests.helpers.models import tiny_qwen2
from tests.helpers.rollouts import micro_batching, rollout_batch

PROMPTS = [3, 5, 2, 4]
COMPLETIONS = [6, 2, 7, 4]


def trained_logprobs(model, batch, settings) -> torch.Tensor:
    """The rows' log-probs as an update's forward/backward computes them (the 'before')."""
    return backward_micro_batches(model, batch, slice(0, len(PROMPTS)), settings, backward=torch.Tensor.backward,
                                  passes=PassTotals.zeros(torch.device("cpu")))


def test_a_step_that_moves_nothing_measures_exactly_zero():
    model, batch, settings = tiny_qwen2(), rollout_batch(PROMPTS, COMPLETIONS), micro_batching()
    before = trained_logprobs(model, batch, settings)
    k3_sum, tokens = step_kl_terms(model, batch, slice(0, len(PROMPTS)), before, settings)
    assert k3_sum.item() == 0.0
    assert tokens.item() == batch.mask.sum().item() == sum(COMPLETIONS)


def test_step_kl_is_k3_of_every_trained_token_after_over_before():
    batch = rollout_batch(PROMPTS, COMPLETIONS)
    rows = slice(1, 3)  # a mini-batch: the rows of one update
    for settings in (micro_batching(), micro_batching(tokens=16)):  # padded and packed micro-batches
        moved = tiny_qwen2()
        before = trained_logprobs(moved, batch, settings)[rows]
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=0.05)
        k3_sum, tokens = step_kl_terms(moved, batch, rows, before, settings)
        # Independently: the whole batch in one padded forward, float64 k3 on the masked tokens.
        with torch.no_grad():
            after = sequence_logprobs(moved, batch.rollouts.input_ids, batch.rollouts.attention_mask,
                                      temperature=settings.temperature)[rows]
        log_ratio = (after - before).double()[batch.mask[rows]]
        want = (log_ratio.exp() - 1 - log_ratio).sum()
        assert tokens.item() == batch.mask[rows].sum().item()
        assert want > 1e-3  # the perturbation moved the policy measurably
        # float32 log-probs from different micro-batch shapes agree to ~1e-6 per token.
        torch.testing.assert_close(k3_sum, want, rtol=1e-4, atol=1e-7)


def test_k3_is_never_negative_and_its_mean_estimates_the_kl():
    # Tokens drawn from p ("before"); q = p moved: mean k3 of log q/p approaches KL(p || q).
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=generator), dim=0).double()
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(50, generator=generator).double(), dim=0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=generator)
    log_ratio = torch.log(q[samples]) - torch.log(p[samples])
    k3 = log_ratio.exp() - 1 - log_ratio
    exact = (p * (p.log() - q.log())).sum()
    assert (k3 >= 0).all()
    # 200k samples: the estimate's standard error here is about 0.3% of the KL.
    assert abs(k3.mean() - exact) < 0.02 * exact
