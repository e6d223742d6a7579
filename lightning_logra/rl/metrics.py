"""The metrics of one GRPO step, summed over data-parallel ranks in one collective."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_logra.rl.sampling import SamplingStats, ScoredRollouts


class PhaseClock:
    """Wall-clock seconds of the consecutive phases of one step (this rank's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last lap to ``phase`` (phases may recur: sampling rounds, updates)."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._last)
        self._last = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count ``seconds`` of a timed ``source`` phase as ``target``'s (work of one phase
        done inside another's, e.g. ``policy/step_kl``'s draws in the training forward)."""
        self.seconds[source] -= seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds


@dataclass
class PassTotals:
    """Sums over every micro-batch forward/backward of one step (all its updates)."""

    entropy: torch.Tensor
    tokens: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    updates: int = 0
    skipped_updates: int = 0
    # With GRPOModule's logging.step_kl: k3 summed over every update's trained tokens, and their count.
    step_kl: torch.Tensor | None = None
    step_kl_tokens: torch.Tensor | None = None

    @classmethod
    def zeros(cls, device: torch.device) -> "PassTotals":
        return cls(entropy=torch.zeros((), device=device), tokens=torch.zeros((), dtype=torch.long, device=device))

    def add(self, entropy: torch.Tensor, mask: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        tokens = mask.sum()
        self.entropy += (entropy.detach() * mask).sum()
        self.tokens += tokens
        for key, value in stats.items():
            self.stats[key] = self.stats.get(key, 0) + value * tokens

    def add_step_kl(self, k3_sum: torch.Tensor, tokens: torch.Tensor) -> None:
        self.step_kl = k3_sum if self.step_kl is None else self.step_kl + k3_sum
        self.step_kl_tokens = tokens if self.step_kl_tokens is None else self.step_kl_tokens + tokens


def step_metrics(
    scored: ScoredRollouts,
    mask: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    trainer_logprobs: torch.Tensor,
    passes: PassTotals,
    *,
    num_generations: int,
    phase_seconds: dict[str, float],
    started: float,
    sampling: SamplingStats | None,
) -> dict[str, float]:
    """Rewards, completions, the policy's entropy and rollout/trainer gap (at the weights
    that sampled), loss statistics, per-phase seconds; with tools, turns and tool calls per
    sample, failed tool calls and rollouts that could not start; with measured step KL,
    ``policy/step_kl``. ``mask`` marks the trained tokens; completion lengths count generated
    tokens only (never tool results)."""
    rollouts, rewards, device = scored.rollouts, scored.rewards, scored.rewards.device
    lengths = rollouts.completion_mask.sum(dim=1).float()
    groups = rewards.view(-1, num_generations)
    tokens = mask.sum()
    gap = torch.where(mask, rollout_logprobs - trainer_logprobs, 0.0)
    names = sorted(passes.stats)
    functions = list(scored.scores.per_function.items())
    local = _flat([
        rewards.sum(), rewards.square().sum(), float(rewards.numel()),
        (groups.std(dim=1, unbiased=False) == 0).float().sum(), float(groups.shape[0]),
        lengths.sum(), (~rollouts.ended_with_eos).float().sum(), tokens.float(), passes.entropy,
        gap.sum(), gap.abs().sum(), float(scored.scores.failures),
        float(scored.scores.unscored), passes.tokens.float(),
        *[passes.stats[key] for key in names],
        *[value for _, values in functions for value in _moments(values)],
        *((float(sampling.extra_rounds), float(sampling.dropped_groups), float(sampling.unfilled_groups))
          if sampling is not None else ()),
        *_conversation_totals(rollouts),
        *((passes.step_kl, passes.step_kl_tokens.double()) if passes.step_kl is not None else ()),
    ], device)
    longest = lengths.max().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    values = local.tolist()
    (reward_sum, reward_square, count, zero_std, group_count, length_sum, truncated, token_count, entropy,
     gap_sum, gap_abs, failed, unscored, pass_tokens) = values[:14]
    rest = values[14:]
    reward_mean = reward_sum / count
    metrics = {
        "reward/mean": reward_mean,
        "reward/std": math.sqrt(max(reward_square / count - reward_mean**2, 0.0)),
        "reward/zero_std_groups": zero_std / group_count,
        "reward/failures": failed,
        "reward/unscored": unscored,
        "completion/length_mean": length_sum / count,
        "completion/length_max": float(longest),
        "completion/clipped_fraction": truncated / count,
        "policy/entropy": entropy / max(pass_tokens, 1.0),
        "policy/rollout_trainer_logprob_gap": gap_sum / max(token_count, 1.0),
        "policy/rollout_trainer_logprob_gap_abs": gap_abs / max(token_count, 1.0),
        "train/updates": float(passes.updates),
        "train/skipped_updates": float(passes.skipped_updates),
        "perf/tokens_per_second": token_count / max(time.perf_counter() - started, 1e-9),
        **{f"perf/{phase}_s": seconds for phase, seconds in phase_seconds.items()},
    }
    for key in names:
        metrics[f"policy/{key}"] = rest.pop(0) / max(pass_tokens, 1.0)
    for name, _ in functions:
        total, square, scored_count = rest.pop(0), rest.pop(0), rest.pop(0)
        if scored_count:
            mean = total / scored_count
            metrics[f"reward/{name}/mean"] = mean
            metrics[f"reward/{name}/std"] = math.sqrt(max(square / scored_count - mean**2, 0.0))
    if sampling is not None:
        metrics["sampling/extra_rounds"], metrics["sampling/dropped_groups"], metrics["sampling/unfilled_groups"] = \
            rest[:3]
        rest = rest[3:]
    if rollouts.conversations is not None:
        turns, calls, failures, failed_rollouts = rest[:4]
        rest = rest[4:]
        metrics["turns/mean"] = turns / count
        metrics["tools/calls_per_sample"] = calls / count
        metrics["tools/failures"] = failures
        metrics["tools/failed_rollouts"] = failed_rollouts
    if passes.step_kl is not None:
        k3_sum, kl_tokens = rest
        metrics["policy/step_kl"] = k3_sum / max(kl_tokens, 1.0)
    return metrics


def _conversation_totals(rollouts) -> tuple[float, ...]:
    """Multi-turn rollouts: the sums of assistant turns, tool calls, failed tool calls and
    rollouts that could not start (``Conversation.failure``)."""
    if rollouts.conversations is None:
        return ()
    conversations = rollouts.conversations
    return (float(sum(c.turns for c in conversations)), float(sum(c.tool_calls for c in conversations)),
            float(sum(c.tool_failures for c in conversations)),
            float(sum(c.failure is not None for c in conversations)))


def _moments(values: list[float | None]) -> tuple[float, float, float]:
    """Sum, sum of squares and count of the scores that apply (not None)."""
    present = [value for value in values if value is not None]
    return sum(present), sum(value * value for value in present), float(len(present))


def _flat(values: list, device: torch.device) -> torch.Tensor:
    """One float64 vector (one collective) of tensor and Python scalars."""
    return torch.stack([
        v.double() if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64, device=device) for v in values
    ])
