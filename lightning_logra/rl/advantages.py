"""Advantages of RL post-training (plain torch): GRPO's group-normalised ones, the paper's
running-mean REINFORCE baseline, and the authors' newer scaling by response length.

Rewards come one per sample; a non-finite advantage (or baseline) raises
``NonFiniteRewards`` before anything trains on it.
"""

import math

import torch


class NonFiniteRewards(ValueError):
    """Rewards whose advantages (or running baseline) are not finite in float32: training on
    them would make the weights NaN, so the step stops instead (``GRPOModule`` adds the reward
    functions' names)."""


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
       ``failure_reward=None`` leaves rewards as they are. With ``success_threshold`` (the
       authors' newer code: 1.0, for fractional rewards such as a share of tests passed), a
       reward at or above it becomes 1 and every other one ``failure_reward``.
    2. Advantage = shaped reward - current baseline (which starts at 0), so a sample never
       enters its own baseline.
    3. Update ``b <- (1 - weight) * b + weight * mean(shaped rewards)``.

    Pass the rewards of all data-parallel ranks (gathered) so that every rank keeps the
    same baseline. The baseline lives in ``state_dict()`` for checkpoints. Rewards that would
    make the advantages or the baseline non-finite raise ``NonFiniteRewards`` and leave the
    baseline as it was.
    """

    def __init__(self, weight: float = 0.1, failure_reward: float | None = -0.01,
                 success_threshold: float | None = None) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if success_threshold is not None and failure_reward is None:
            raise ValueError("success_threshold maps every other reward to failure_reward: give a failure_reward")
        self.weight = weight
        self.failure_reward = failure_reward
        self.success_threshold = success_threshold
        self.value = 0.0

    def shape(self, rewards: torch.Tensor) -> torch.Tensor:
        rewards = rewards.float()
        if self.failure_reward is None:
            return rewards
        if self.success_threshold is not None:  # the authors' newer mapping: success or failure, nothing between
            return torch.where(rewards >= self.success_threshold, torch.ones_like(rewards),
                               torch.full_like(rewards, self.failure_reward))
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


def length_scaled(advantages: torch.Tensor, mask: torch.Tensor, reference_length: float) -> torch.Tensor:
    """The authors' newer length-normalised advantage: each sequence's advantage times
    ``reference_length / its completion tokens`` (``mask``: ``B x T``, the trained tokens),
    so that under a token-mean loss every sequence weighs the same whatever its length; a
    row without tokens keeps its advantage (it trains on nothing)."""
    if reference_length <= 0:
        raise ValueError(f"reference_length must be > 0, got {reference_length}")
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"length_scaled needs one advantage per row of the mask, got {tuple(advantages.shape)} "
                         f"for a mask of {tuple(mask.shape)}")
    lengths = mask.sum(dim=1).float()
    return torch.where(lengths > 0, advantages * reference_length / lengths.clamp(min=1), advantages)

