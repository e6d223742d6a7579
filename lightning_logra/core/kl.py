"""Predicted-KL control: how far will this update move the policy, and how far may it go?

KL(alpha * Delta) ~= alpha^2 * KL(Delta) to second order, where KL(Delta) is the softmax
Fisher quadratic form of the logits' change (measured by the forward-mode probe in
``probe.py``). ``KLController`` holds the budget schedule and the rollout/trainer mismatch
EMA and turns (prediction, budget) into the step scale alpha.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_logra.core.config import LoGRAConfig


def kl_per_position(logits: torch.Tensor, tangent: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """0.5 * sum_v p_v (u_v - E_p[u])^2 per position (last dim = vocabulary), in float32
    (float64 inputs stay float64).

    u is centred on its p-mean before it is squared, so nothing cancels: the float32 form
    is within a few 1e-6 relative of the float64 one at vocabularies of 32k-152k
    (``tests/core/test_kl.py``), at a third of its time. Per-position values are summed in
    float64 by the caller.
    """
    # In place on copies: this runs on (positions x vocabulary) blocks, where each extra
    # temporary is as large as the block itself.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    p = torch.softmax(logits.to(dtype) / temperature, dim=-1)
    u = tangent.to(dtype, copy=True).div_(temperature)
    mean = torch.linalg.vecdot(p, u).unsqueeze(-1)
    return 0.5 * torch.linalg.vecdot(p, u.sub_(mean).square_())


def predicted_kl(
    logits: torch.Tensor,
    tangent: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean predicted KL over the positions selected by ``mask`` (all positions if None),
    averaged in float64."""
    per_position = kl_per_position(logits, tangent, temperature=temperature).to(torch.float64)
    if mask is None:
        return per_position.mean()
    mask = mask.to(torch.bool)
    if not mask.any():
        return per_position.new_zeros(())
    return per_position[mask].mean()


def measured_kl_per_position(logits_before: torch.Tensor, logits_after: torch.Tensor, *,
                             temperature: float = 1.0) -> torch.Tensor:
    """Exact KL(p_before || p_after) over the full vocabulary at each position, in float64."""
    log_p = torch.log_softmax(logits_before.to(torch.float64) / temperature, dim=-1)
    log_q = torch.log_softmax(logits_after.to(torch.float64) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def measured_kl(
    logits_before: torch.Tensor,
    logits_after: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact KL(p_before || p_after) over the full vocabulary, averaged over positions."""
    per_position = measured_kl_per_position(logits_before, logits_after, temperature=temperature)
    if mask is None:
        return per_position.mean()
    return per_position[mask.to(torch.bool)].mean()


def kl_step_scale(prediction: float, *, budget: float, alpha_max: float = 3.0) -> float:
    """alpha = min(alpha_max, sqrt(budget / prediction)); 1 when the prediction is exactly 0."""
    prediction = float(prediction)
    if not (math.isfinite(budget) and budget > 0):
        raise FloatingPointError(f"KL budget must be a finite number > 0, got {budget}")
    if math.isnan(prediction) or prediction < 0.0:
        raise FloatingPointError(f"predicted KL must be a finite number >= 0, got {prediction}")
    if math.isinf(prediction):
        raise FloatingPointError("predicted KL is infinite; refusing to scale the update")
    if prediction == 0.0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / prediction))


def scheduled_budget(config: LoGRAConfig, update: int) -> float:
    """Cosine from kl_budget to kl_budget_final over schedule_steps updates, then flat."""
    start, final, horizon = config.kl_budget, config.kl_budget_final, config.schedule_steps
    progress = min(update / (horizon - 1), 1.0) if horizon > 1 else 1.0
    return final + 0.5 * (start - final) * (1.0 + math.cos(math.pi * progress))


class LogprobPairs(NamedTuple):
    """Per-token log-probs of the same completion tokens under the rollout engine and the
    trainer, and the mask of the tokens to compare (EOS-terminated completions): the
    mismatch term's input."""

    rollout: torch.Tensor
    trainer: torch.Tensor
    mask: torch.Tensor


def mismatch_sums(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(sum of rollout - trainer log-probs, token count, non-finite pairs left out) over the
    masked tokens, float64: the numbers to all-reduce before taking the mean across ranks.

    A pair whose gap is not finite (an ``-inf`` log-prob of a token one side could not have
    drawn) would make the EMA infinite for good: it is left out of the mean and counted (ours).
    """
    mask = mask.to(torch.bool)
    gap = rollout_logprobs.to(torch.float64) - trainer_logprobs.to(torch.float64)
    finite = torch.isfinite(gap)
    used = mask & finite
    return torch.stack([gap[used].sum(), used.sum().to(torch.float64), (mask & ~finite).sum().to(torch.float64)])


def observed_mismatch(
    rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """max(0, mean(rollout - trainer)) over the masked tokens (EOS-terminated responses)
    whose log-probs are both finite."""
    return observed_mismatch_from_sums(mismatch_sums(rollout_logprobs, trainer_logprobs, mask))


def observed_mismatch_from_sums(sums: torch.Tensor) -> float:
    gap_sum, count = sums[:2].tolist()
    return max(0.0, gap_sum / count) if count > 0 else 0.0


def update_mismatch(previous: float, observed: float, *, ema_weight: float = 0.3) -> float:
    return (1.0 - ema_weight) * previous + ema_weight * observed


def effective_budget(budget: float, mismatch: float, *, floor: float = 0.5) -> float:
    """Subtract the rollout/trainer mismatch from the budget, keeping at least floor * budget."""
    return max(budget - mismatch, floor * budget)


@dataclass(frozen=True)
class Budget:
    """The KL budget of one update and the mismatch EMA it was computed with."""

    scheduled: float  # the cosine schedule's value
    effective: float  # after subtracting the mismatch (= scheduled when nothing is subtracted)
    mismatch: float  # the EMA after this step's observation; committed only if the step is applied
    nonfinite_pairs: int = 0  # log-prob pairs left out of the observation because their gap is not finite


class KLController:
    """Budget schedule + rollout/trainer mismatch EMA -> step scale (spec section 7).

    ``budget`` is pure: the EMA it returns becomes the controller's state through
    ``commit`` once the update has been applied, so a skipped step changes nothing.
    """

    def __init__(self, config: LoGRAConfig) -> None:
        self.config = config
        self.mismatch = 0.0

    def budget(self, update: int, mismatch_sums: torch.Tensor | None = None,
               process_group: dist.ProcessGroup | None = None) -> Budget:
        """The budget of update number ``update``. ``mismatch_sums`` (from ``mismatch_sums``,
        local to this rank) are all-reduced over ``process_group``; a step with no
        EOS-terminated token anywhere, or no pairs at all, leaves the EMA and the budget
        untouched, as the reference does."""
        config = self.config
        scheduled = scheduled_budget(config, update)
        if not config.mismatch_subtraction or mismatch_sums is None:
            return Budget(scheduled, scheduled, self.mismatch)
        sums = mismatch_sums.to(torch.float64).clone()
        if process_group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
        nonfinite = int(sums[2].item()) if len(sums) > 2 else 0
        if sums[1] == 0:
            return Budget(scheduled, scheduled, self.mismatch, nonfinite)
        mismatch = update_mismatch(self.mismatch, observed_mismatch_from_sums(sums), ema_weight=config.mismatch_ema_weight)
        return Budget(scheduled, effective_budget(scheduled, mismatch, floor=config.mismatch_budget_floor), mismatch,
                      nonfinite)

    def scale(self, prediction: float, budget: Budget) -> float:
        return kl_step_scale(prediction, budget=budget.effective, alpha_max=self.config.alpha_max)

    def commit(self, budget: Budget) -> None:
        self.mismatch = budget.mismatch
