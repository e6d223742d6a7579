"""Importance weights of the rollout engine's samples in the trainer's loss, and the
off-policy sequence mask (plain torch).

The engine that sampled (vLLM, or a worker one step behind) scores tokens with slightly
different numbers than the trainer; the ratio ``exp(trainer - rollout)`` of their log-probs
corrects for it. The modes are TRL's (``vllm_importance_sampling_mode``): per token or per
sequence (the ratio of the whole sequence's probabilities, ``exp(sum_t (trainer - rollout))``),
truncated into ``[floor, cap]`` or masked (a ratio outside it weighs 0).
``token_truncate`` with no floor is the paper's truncated importance sampling.

The off-policy mask (DeepSeek-V3.2) leaves out of the loss each sequence with a negative
advantage whose mean per-token KL from the behaviour policy, ``mean_t(rollout - trainer)``,
is above a threshold: the samples a stale or mismatched engine got most wrong, pushed down.
"""

import torch

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "token_truncate", cap: float = 2.0,
                       floor: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached ``B x T`` weights (0 off the mask) and their stats: ``tis_weight_mean`` over
    the mask, and ``tis_capped_fraction``, the share of its tokens whose ratio was outside
    ``[floor, cap]`` (truncated, or masked)."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    if cap <= 0 or (floor is not None and not 0 <= floor < cap):
        raise ValueError(f"need cap > 0 and 0 <= floor < cap; got cap={cap}, floor={floor}")
    log_ratio = torch.where(mask, trainer_logprobs.detach() - rollout_logprobs, 0.0)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    ratio = log_ratio.exp()
    outside = ratio > cap
    if floor is not None:
        outside = outside | (ratio < floor)
    if mode.endswith("truncate"):
        weight = ratio.clamp(min=floor, max=cap)
    else:
        weight = torch.where(outside, 0.0, ratio)
    weight = torch.where(mask, weight, 0.0)
    tokens = mask.sum()
    return weight, {"tis_weight_mean": weight.sum() / tokens, "tis_capped_fraction": (outside & mask).sum() / tokens}


def off_policy_keep(advantages: torch.Tensor, trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``B x 1`` floats: 1 for the sequences the loss keeps, 0 for those with a negative
    advantage and ``mean_t(rollout - trainer) > threshold`` (rows without tokens are kept:
    they train on nothing); and ``off_policy_masked_fraction``, the share of rows dropped."""
    if advantages.dim() != 1:
        raise ValueError(f"the off-policy mask needs one advantage per sequence, got shape {tuple(advantages.shape)}")
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    tokens = mask.sum(dim=1)
    divergence = torch.where(mask, rollout_logprobs - trainer_logprobs.detach(), 0.0).sum(dim=1) / tokens.clamp(min=1)
    dropped = (advantages < 0) & (divergence > threshold) & (tokens > 0)
    return (~dropped).float().unsqueeze(1), {"off_policy_masked_fraction": dropped.float().mean()}
