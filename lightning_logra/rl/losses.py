"""Policy-gradient losses and advantages for RL post-training (plain torch).

All losses take per-token tensors of shape ``B x T`` (``logprobs`` from the trainer,
``old_logprobs``/``rollout_logprobs`` from sampling) and a ``mask`` that is 1 exactly on
the completion tokens to train on: prompt and padding positions never contribute,
whatever values they hold. ``advantages`` is one value per sequence (``B``) or per token
(``B x T``). Each loss returns ``(loss, stats)`` with detached scalar tensors in ``stats``.
"""

import math

import torch

from lightning_logra.rl.config import LossConfig

AGGREGATIONS = ("token", "sequence")


class NonFiniteRewards(ValueError):
    """Rewards whose advantages (or running baseline) are not finite in float32: training on
    them would make the weights NaN, so the step stops instead (``GRPOModule`` adds the reward
    functions' names)."""


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x) - x - 1`` per token of log ratios ``x = log q - log p``: never negative, and
    its mean over tokens sampled from p is an unbiased estimate of KL(p || q)."""
    return log_ratio.exp() - log_ratio - 1


def _check_finite(what: str, values: torch.Tensor, rewards: torch.Tensor) -> None:
    if not torch.isfinite(values).all():
        bad = int((~torch.isfinite(values)).sum())
        raise NonFiniteRewards(f"{what}: {bad} of {values.numel()} values are not finite in float32; the rewards "
                               f"range over [{rewards.min().item():.4g}, {rewards.max().item():.4g}]")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: ``(r - group mean) / (group std + eps)``, groups laid out consecutively.

    ``rewards`` is ``[p0 s0, p0 s1, ..., p1 s0, ...]`` (``B = prompts * group_size``). The std is
    the sample std (Bessel-corrected, as ``torch.std``). Dr. GRPO uses ``normalize_std=False``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group advantages, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().reshape(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    _check_finite("group advantages", centered, rewards)
    return centered.reshape(-1)


class RunningBaseline:
    """REINFORCE baseline: a running mean of (shaped) rewards, as in the paper's RL setting.

    ``advantages(rewards)`` does three things in order:

    1. Failure shaping: every reward ``<= 0`` becomes ``failure_reward`` (-0.01 in the paper),
       so a failed sample is pushed down slightly even before the baseline has grown.
       ``failure_reward=None`` leaves rewards as they are.
    2. Advantage = shaped reward - current baseline (which starts at 0), so a sample never
       enters its own baseline.
    3. Update ``b <- (1 - weight) * b + weight * mean(shaped rewards)``.

    Pass the rewards of all data-parallel ranks (gathered) so that every rank keeps the
    same baseline. The baseline lives in ``state_dict()`` for checkpoints. Rewards that would
    make the advantages or the baseline non-finite raise ``NonFiniteRewards`` and leave the
    baseline as it was.
    """

    def __init__(self, weight: float = 0.1, failure_reward: float | None = -0.01) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.failure_reward = failure_reward
        self.value = 0.0

    def shape(self, rewards: torch.Tensor) -> torch.Tensor:
        rewards = rewards.float()
        if self.failure_reward is None:
            return rewards
        return torch.where(rewards <= 0, torch.full_like(rewards, self.failure_reward), rewards)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        if rewards.dim() != 1 or rewards.numel() == 0:
            raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(rewards.shape)}")
        shaped = self.shape(rewards)
        advantages = shaped - self.value
        value = (1 - self.weight) * self.value + self.weight * shaped.mean().item()
        _check_finite(f"running baseline advantages (baseline {self.value:.4g})", advantages, rewards)
        if not math.isfinite(value):
            raise NonFiniteRewards(f"running baseline: the rewards' mean {shaped.mean().item()} would make the "
                                   f"baseline {value}; it keeps {self.value:.4g}")
        self.value = value
        return advantages

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        value = float(state["value"])
        if not math.isfinite(value):
            raise ValueError(f"running baseline state: value {value} is not finite (a checkpoint saved after "
                             "non-finite rewards); it cannot be resumed from")
        self.value = value


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
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``.

    ``aggregation="token"``: sum over all completion tokens / their number.
    ``aggregation="sequence"``: mean over sequences of each sequence's token mean (rows
    without completion tokens are left out). With ``ref_logprobs`` and ``kl_coef > 0`` the
    k3 estimate ``exp(ref - lp) - (ref - lp) - 1`` of KL(policy || reference) is added per token.
    With ``rollout_logprobs`` each token's loss is multiplied by the truncated importance
    weight ``min(exp(old_logprobs - rollout_logprobs), tis_cap)`` (see ``tis_weights``).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         rollout_logprobs=rollout_logprobs)
    per_token, stats = _clipped_token_loss(
        logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef, rollout_logprobs, tis_cap
    )
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
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dr. GRPO: the GRPO per-token loss summed and divided by the constant
    ``num_sequences * max_completion_length``, so long answers are not down-weighted.
    Pair it with ``group_advantages(..., normalize_std=False)``. ``rollout_logprobs`` and
    ``tis_cap`` as in ``grpo_loss``.
    """
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                         rollout_logprobs=rollout_logprobs)
    per_token, stats = _clipped_token_loss(
        logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef, rollout_logprobs, tis_cap
    )
    return per_token.sum() / (logprobs.shape[0] * max_completion_length), stats


def reinforce_baseline_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with truncated importance sampling (the paper's loss), no PPO ratio:

    ``w = min(exp(logprobs.detach() - rollout_logprobs), tis_cap)`` corrects for the
    rollout engine sampling from slightly different numbers than the trainer computes;
    ``loss = -sum(w * A * logprobs * mask) / sum(mask)``.
    """
    mask = _check_inputs(logprobs, advantages, mask, old_logprobs=rollout_logprobs)
    weight, stats = tis_weights(logprobs.detach(), rollout_logprobs, mask, tis_cap)
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
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the PPO clip on a sequence-level ratio ``s = exp(mean_t(logprobs - old_logprobs))``
    (the geometric mean of the token ratios, so length does not inflate it), loss
    ``-min(s * A, clip(s, 1 - eps_low, 1 + eps_high) * A)`` averaged over sequences.

    Sequence ratios stay close to 1, hence clip ranges of ``3e-4``/``4e-4`` rather than
    GRPO's ``0.2``. ``advantages`` is one value per sequence. With ``rollout_logprobs`` the
    importance weight is sequence-level too: ``min(exp(mean_t(old - rollout)), tis_cap)``.
    The k3 KL penalty (``ref_logprobs``, ``kl_coef``) is each sequence's token mean.
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
    advantages = advantages[rows]
    per_row = -torch.minimum(ratio * advantages, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages)
    clipped = ((ratio < 1 - epsilon_low) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
    stats = {"clip_fraction": clipped.float().mean()}
    if rollout_logprobs is not None:
        sequence_weight = row_mean(old_logprobs - rollout_logprobs).exp()
        per_row = per_row * sequence_weight.clamp(max=tis_cap)
        stats["tis_weight_mean"] = sequence_weight.clamp(max=tis_cap).mean()
        stats["tis_capped_fraction"] = (sequence_weight > tis_cap).float().mean()
    if ref_logprobs is not None:
        kl = row_mean(k3(ref_logprobs - logprobs))
        per_row = per_row + kl_coef * kl
        stats["kl"] = kl.mean()
    return per_row.mean(), {key: value.detach() for key, value in stats.items()}


def tis_weights(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, tis_cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights ``min(exp(trainer - rollout), tis_cap)`` per token (0 off
    the mask): they correct for the rollout engine sampling from slightly different numbers
    than the trainer computes, without letting one token's ratio blow up the step."""
    if tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    ratio = torch.where(mask, trainer_logprobs.detach() - rollout_logprobs, 0.0).exp()
    weight = torch.where(mask, ratio.clamp(max=tis_cap), 0.0)
    tokens = mask.sum()
    stats = {
        "tis_weight_mean": weight.sum() / tokens,
        "tis_capped_fraction": ((ratio > tis_cap) & mask).sum() / tokens,
    }
    return weight, stats


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
    importance weight into the clipped losses (``reinforce_baseline`` always has it)."""
    if config.type == "reinforce_baseline":
        return reinforce_baseline_loss(logprobs, rollout_logprobs, advantages, mask, tis_cap=config.tis_cap)
    common = dict(epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, ref_logprobs=ref_logprobs,
                  kl_coef=config.kl_coef, rollout_logprobs=rollout_logprobs if tis else None, tis_cap=config.tis_cap)
    if config.type == "gspo":
        return gspo_loss(logprobs, old_logprobs, advantages, mask, **common)
    if config.type == "dr_grpo":
        return dr_grpo_loss(logprobs, old_logprobs, advantages, mask, max_completion_length=max_completion_length, **common)
    return grpo_loss(logprobs, old_logprobs, advantages, mask, aggregation=config.aggregation, **common)


def normalised_per_token(config: LossConfig) -> bool:
    """Whether the loss is a mean over tokens (else over sequences, or Dr. GRPO's constant),
    which decides how micro-batches and ranks are weighted into one mean."""
    return config.type not in ("dr_grpo", "gspo") and not (config.type == "grpo" and config.aggregation == "sequence")


def _clipped_token_loss(logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high, ref_logprobs, kl_coef,
                        rollout_logprobs=None, tis_cap=2.0):
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
        weight, tis_stats = tis_weights(old_logprobs, rollout_logprobs, mask, tis_cap)
        per_token = per_token * weight
        stats.update(tis_stats)
    if ref_logprobs is not None:
        kl = k3(torch.where(mask, ref_logprobs - logprobs, 0.0))
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
