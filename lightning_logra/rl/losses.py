"""Policy-gradient losses for RL post-training (plain torch); advantages are in ``advantages``.

All losses take per-token tensors of shape ``B x T`` (``logprobs`` from the trainer,
``old_logprobs``/``rollout_logprobs`` from sampling) and a ``mask`` that is 1 exactly on
the completion tokens to train on: prompt and padding positions never contribute,
whatever values they hold. ``advantages`` is one value per sequence (``B``) or per token
(``B x T``). Each loss returns ``(loss, stats)`` with detached scalar tensors in ``stats``.

Options every loss takes: ``corrections`` (``LossConfig``'s ``importance_sampling_mode`` /
``tis_cap`` / ``tis_min``) weigh each token by the rollout/trainer ratio (``importance``)
and choose the KL penalty's per-token estimate (``kl_estimator``: ``kl_estimators``);
``sequence_keep`` (``B x 1``, 1 or 0: the off-policy mask, ``importance.off_policy_keep``)
drops whole sequences. Both leave the loss's normaliser as it is (as TRL does).
"""

from dataclasses import dataclass

import torch

from lightning_logra.rl.advantages import NonFiniteRewards
from lightning_logra.rl.config import LossConfig
from lightning_logra.rl.importance import importance_weights, off_policy_keep
from lightning_logra.rl.kl_estimators import kl_estimate

AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class Corrections:
    """How a loss weighs its tokens beyond the policy gradient: the importance weights of the
    rollout engine's samples (when ``rollout_logprobs`` are given to the loss) and the KL
    penalty's estimator (see the module docstring)."""

    importance_sampling_mode: str = "token_truncate"
    tis_cap: float = 2.0
    tis_min: float | None = None
    kl_estimator: str = "k3"

    @classmethod
    def of(cls, config: LossConfig) -> "Corrections":
        return cls(config.importance_sampling_mode, config.tis_cap, config.tis_min, config.kl_estimator)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    aggregation: str = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    corrections: Corrections = Corrections(),
    sequence_keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``.

    ``aggregation="token"``: sum over all completion tokens / their number.
    ``aggregation="sequence"``: mean over sequences of each sequence's token mean (rows
    without completion tokens are left out). With ``ref_logprobs`` and ``kl_coef > 0`` the
    estimate (``corrections.kl_estimator``, k3 by default: ``exp(ref - lp) - (ref - lp) - 1``) of
    KL(policy || reference) is added per token. With ``rollout_logprobs`` each token's loss is
    multiplied by its importance weight of ``exp(old_logprobs - rollout_logprobs)``
    (``corrections``; by default ``min(ratio, 2)`` per token: see ``importance_weights``).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         rollout_logprobs=rollout_logprobs)
    per_token, stats = _clipped_token_loss(
        logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef, rollout_logprobs,
        corrections, sequence_keep)
    if aggregation == "token":
        loss = per_token.sum() / mask.sum()
    else:
        tokens_per_row = mask.sum(dim=1)
        has_tokens = tokens_per_row > 0
        loss = (per_token.sum(dim=1)[has_tokens] / tokens_per_row[has_tokens]).mean()
    return loss, stats


def dr_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_completion_length: int,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    corrections: Corrections = Corrections(),
    sequence_keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr. GRPO: the GRPO per-token loss summed and divided by the constant
    ``num_sequences * max_completion_length``, so long answers are not down-weighted.
    Pair it with ``group_advantages(..., normalize_std=False)``. ``rollout_logprobs`` and
    ``corrections`` as in ``grpo_loss``.
    """
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         rollout_logprobs=rollout_logprobs)
    per_token, stats = _clipped_token_loss(
        logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef, rollout_logprobs,
        corrections, sequence_keep)
    return per_token.sum() / (logprobs.shape[0] * max_completion_length), stats


def reinforce_baseline_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    corrections: Corrections = Corrections(),
    sequence_keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with truncated importance sampling (the paper's loss), no PPO ratio:

    ``w = min(exp(logprobs.detach() - rollout_logprobs), tis_cap)`` corrects for the
    rollout engine sampling from slightly different numbers than the trainer computes;
    ``loss = -sum(w * A * logprobs * mask) / sum(mask)``. ``corrections`` may weigh the
    ratio otherwise (see ``importance_weights``).
    """
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=rollout_logprobs)
    weight, stats = importance_weights(logprobs, rollout_logprobs, mask, mode=corrections.importance_sampling_mode,
                                       cap=corrections.tis_cap, floor=corrections.tis_min)
    if sequence_keep is not None:
        weight = weight * sequence_keep
    per_token = torch.where(mask, -weight * _per_token(advantages) * logprobs, 0.0)
    return per_token.sum() / mask.sum(), stats


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 3e-4,
    epsilon_high: float = 4e-4,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    corrections: Corrections = Corrections(),
    sequence_keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the PPO clip on a sequence-level ratio ``s = exp(mean_t(logprobs - old_logprobs))``
    (the geometric mean of the token ratios, so length does not inflate it), loss
    ``-min(s * A, clip(s, 1 - eps_low, 1 + eps_high) * A)`` averaged over sequences.

    Sequence ratios stay close to 1, hence clip ranges of ``3e-4``/``4e-4`` rather than
    GRPO's ``0.2``. ``advantages`` is one value per sequence. With ``rollout_logprobs`` the
    importance weight is sequence-level too: with the default ``token_truncate`` mode
    ``min(exp(mean_t(old - rollout)), tis_cap)``, with the ``sequence_*`` modes those of
    ``importance_weights`` (``token_mask`` is refused: it has no sequence-level form). The KL
    penalty (``ref_logprobs``, ``kl_coef``) is each sequence's token mean.
    """
    if advantages.dim() != 1:
        raise ValueError(f"gspo needs one advantage per sequence, got shape {tuple(advantages.shape)}")
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         rollout_logprobs=rollout_logprobs)
    tokens_per_row = mask.sum(dim=1)
    rows = tokens_per_row > 0

    def row_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, values, 0.0).sum(dim=1)[rows] / tokens_per_row[rows]

    ratio = row_mean(logprobs - old_logprobs).exp()
    row_advantages = advantages[rows]
    per_row = -torch.minimum(ratio * row_advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * row_advantages)
    clipped = ((ratio < 1 - epsilon_low) & (row_advantages < 0)) | ((ratio > 1 + epsilon_high) & (row_advantages > 0))
    stats = {"clip_fraction": clipped.float().mean()}
    if rollout_logprobs is not None:
        mode = corrections.importance_sampling_mode
        if mode == "token_mask":
            raise ValueError("gspo weighs whole sequences: importance_sampling_mode token_mask has no sequence-level "
                             "form; use token_truncate (its geometric-mean ratio), sequence_truncate or sequence_mask")
        log_ratio = torch.where(mask, old_logprobs - rollout_logprobs, 0.0).sum(dim=1)[rows]
        if mode == "token_truncate":  # GSPO's own: the geometric mean of the token ratios
            log_ratio = log_ratio / tokens_per_row[rows]
        sequence_ratio = log_ratio.exp()
        outside = sequence_ratio > corrections.tis_cap
        if corrections.tis_min is not None:
            outside = outside | (sequence_ratio < corrections.tis_min)
        if mode.endswith("truncate"):
            weight = sequence_ratio.clamp(min=corrections.tis_min, max=corrections.tis_cap)
        else:
            weight = torch.where(outside, 0.0, sequence_ratio)
        stats["tis_weight_mean"], stats["tis_capped_fraction"] = weight.mean(), outside.float().mean()
        per_row = per_row * weight
    if sequence_keep is not None:
        per_row = per_row * sequence_keep.squeeze(1)[rows]
    if ref_logprobs is not None:
        kl = row_mean(kl_estimate(ref_logprobs - logprobs, corrections.kl_estimator))
        per_row = per_row + kl_coef * kl
        stats["kl"] = kl.mean()
    return per_row.mean(), {key: value.detach() for key, value in stats.items()}


def micro_batch_loss(
    config: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    *,
    max_completion_length: int,
    tis: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss ``config.type`` names, with its settings; ``tis`` puts the rollout/trainer
    importance weight into the clipped losses (``reinforce_baseline`` always has it). The
    off-policy mask (``off_policy_mask_threshold``) compares the trainer with the rollout
    engine's log-probs, the policy that sampled, whether or not ``tis`` is on."""
    corrections, keep, stats = Corrections.of(config), None, {}
    if config.off_policy_mask_threshold is not None:
        keep, stats = off_policy_keep(advantages, logprobs, rollout_logprobs, mask.bool(),
                                      config.off_policy_mask_threshold)
    if config.type == "reinforce_baseline":
        loss, loss_stats = reinforce_baseline_loss(logprobs, rollout_logprobs, advantages, mask,
                                                   corrections=corrections, sequence_keep=keep)
        return loss, {**loss_stats, **stats}
    common = dict(epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, ref_logprobs=ref_logprobs,
                  kl_coef=config.kl_coef, rollout_logprobs=rollout_logprobs if tis else None, corrections=corrections,
                  sequence_keep=keep)
    if config.type == "gspo":
        loss, loss_stats = gspo_loss(logprobs, old_logprobs, advantages, mask, **common)
    elif config.type == "dr_grpo":
        loss, loss_stats = dr_grpo_loss(logprobs, old_logprobs, advantages, mask,
                                        max_completion_length=max_completion_length, **common)
    else:
        loss, loss_stats = grpo_loss(logprobs, old_logprobs, advantages, mask, aggregation=config.aggregation, **common)
    return loss, {**loss_stats, **{key: value.detach() for key, value in stats.items()}}


def normalised_per_token(config: LossConfig) -> bool:
    """Whether the loss is a mean over tokens (else over sequences, or Dr. GRPO's constant),
    which decides how micro-batches and ranks are weighted into one mean."""
    return config.type not in ("dr_grpo", "gspo") and not (config.type == "grpo" and config.aggregation == "sequence")


def _clipped_token_loss(logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef,
                        rollout_logprobs, corrections: Corrections, sequence_keep):
    # where() rather than multiplying by the mask: masked positions may hold inf/nan.
    ratio = torch.where(mask, logprobs - old_logprobs, 0.0).exp()
    advantages = _per_token(advantages)
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    # Clipping is active (zero gradient) where the ratio left the trust region in the
    # direction the advantage pushes it.
    clipped = ((ratio < 1 - epsilon_low) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
    tokens = mask.sum()
    stats = {"clip_fraction": (clipped & mask).sum() / tokens}
    if rollout_logprobs is not None:
        weight, tis_stats = importance_weights(old_logprobs, rollout_logprobs, mask,
                                               mode=corrections.importance_sampling_mode, cap=corrections.tis_cap,
                                               floor=corrections.tis_min)
        per_token = per_token * weight
        stats.update(tis_stats)
    if sequence_keep is not None:
        per_token = per_token * sequence_keep
    if ref_logprobs is not None:
        kl = kl_estimate(torch.where(mask, ref_logprobs - logprobs, 0.0), corrections.kl_estimator)
        per_token = per_token + kl_coef * kl
        stats["kl"] = (kl.detach() * mask).sum() / tokens
    return torch.where(mask, per_token, 0.0), {k: v.detach() for k, v in stats.items()}


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def _check_inputs(logprobs, advantages, mask, **others) -> torch.Tensor:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be B x T, got shape {tuple(logprobs.shape)}")
    for name, tensor in {"mask": mask, **others}.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logprobs.shape)} like logprobs")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, "
            f"expected ({logprobs.shape[0]},) or {tuple(logprobs.shape)}"
        )
    mask = mask.bool()
    if not mask.any():
        raise ValueError("mask selects no tokens: nothing to train on")
    if not torch.isfinite(advantages).all():
        raise NonFiniteRewards(f"advantages hold {int((~torch.isfinite(advantages)).sum())} non-finite values: "
                               "the rewards they come from are not finite in float32")
    return mask
