"""One rollout batch as the trainer sees it, and one optimizer step's micro-batched
forward/backward on some of its rows: the GRPO step that ``GRPOModule`` runs, and that the
benchmarks replay, in plain torch.

Shapes: ``B`` rollout rows, ``T`` tokens per row; per-token tensors are ``B x (T - 1)``,
position ``t`` scoring token ``t + 1`` (``sequence_logprobs``' layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_logra.core.kl import LogprobPairs
from lightning_logra.core.probe import ProbeBatch
from lightning_logra.core.reliability import memory_phase
from lightning_logra.rl.collectives import global_counts
from lightning_logra.rl.config import LossConfig
from lightning_logra.rl.logprobs import sequence_logprobs
from lightning_logra.rl.losses import micro_batch_loss, normalised_per_token
from lightning_logra.rl.metrics import PassTotals
from lightning_logra.rollout.base import Rollouts

# What shrinks the forward/backward's memory, for the error an out-of-memory there raises.
BACKWARD_HINT = "micro_batch_size, activation_checkpointing=true, logprob_chunk_positions"


@dataclass
class RolloutBatch:
    """Scored rollouts with everything the loss reads.

    ``mask``: the loss-bearing completion tokens (``loss.mask_truncated`` applied).
    ``rollout_logprobs``: the engine's log-probs of those positions. ``advantages``: one per
    row. ``reference_logprobs``: the KL reference's (``loss.kl_coef > 0``). ``old_logprobs``:
    the policy's before the first update (the PPO ratio's denominator) when a batch trains
    more than one update; with one update the update's own log-probs serve.
    """

    rollouts: Rollouts
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    reference_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None

    def probe_batch(self, rows: slice, *, num_generations: int, temperature: float) -> ProbeBatch:
        """The rows' responses for LoGRA's KL probe, scored at the positions that generated
        their tokens, at the sampling temperature. Rows come one per prompt first (then each
        prompt's second sample, ...), so the probe's first responses answer different prompts."""
        rollouts = self.rollouts
        attention_mask = rollouts.attention_mask[rows]
        logits_mask = torch.zeros_like(attention_mask, dtype=torch.bool)
        logits_mask[:, :-1] = self.mask[rows]
        count = attention_mask.shape[0]
        order = torch.arange(count, device=attention_mask.device).view(-1, num_generations).T.reshape(-1)
        return ProbeBatch(
            input_ids=rollouts.input_ids[rows][order],
            attention_mask=attention_mask[order],
            logits_mask=logits_mask[order],
            position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0)[order],
            temperature=float(temperature),
        )

    def logprob_pairs(self, rows: slice, trainer_logprobs: torch.Tensor) -> LogprobPairs:
        """Rollout vs trainer log-probs of the completion tokens of EOS-terminated responses."""
        ended = self.rollouts.ended_with_eos[rows, None]
        return LogprobPairs(self.rollout_logprobs[rows], trainer_logprobs, self.mask[rows] & ended)


@dataclass(frozen=True)
class MicroBatching:
    """How one update's rows go through forward/backward: ``micro_batch_size`` rows at a time,
    log-probs at ``temperature`` in chunks of ``chunk_size`` positions, the loss of
    ``loss`` (``tis``: truncated importance sampling in the clipped losses)."""

    loss: LossConfig
    micro_batch_size: int
    temperature: float
    chunk_size: int
    max_completion_length: int
    tis: bool


def backward_micro_batches(
    policy: nn.Module,
    batch: RolloutBatch,
    rows: slice,
    settings: MicroBatching,
    *,
    backward: Callable[[torch.Tensor], None],
    passes: PassTotals,
    world: int = 1,
) -> torch.Tensor | None:
    """Forward and ``backward`` every micro-batch of ``rows``, each loss weighted so that the
    sum over micro-batches and ``world`` ranks is the update-wide mean; add each pass to
    ``passes``. Returns the rows' detached trainer log-probs, or None (and runs nothing)
    when no rank has a token to train on there."""
    mask = batch.mask
    row_count, tokens = global_counts(mask[rows])
    if tokens == 0:
        return None
    input_ids, attention_mask = batch.rollouts.input_ids, batch.rollouts.attention_mask
    parts = []
    for start in range(rows.start, rows.stop, settings.micro_batch_size):
        part = slice(start, min(start + settings.micro_batch_size, rows.stop))
        with memory_phase("backward", BACKWARD_HINT):
            logprobs, entropy = sequence_logprobs(policy, input_ids[part], attention_mask[part],
                                                  temperature=settings.temperature, chunk_size=settings.chunk_size,
                                                  return_entropy=True)
        parts.append(logprobs.detach())
        if not mask[part].any():
            # Every completion here is masked, but other micro-batches (ranks) train: a zero
            # loss keeps this backward, and FSDP2's collectives, in step with theirs.
            loss, stats, weight = torch.where(mask[part], logprobs, 0.0).sum(), {}, 0.0
        else:
            old = parts[-1] if batch.old_logprobs is None else batch.old_logprobs[part]
            loss, stats = micro_batch_loss(
                settings.loss, logprobs, old, batch.rollout_logprobs[part], batch.advantages[part], mask[part],
                None if batch.reference_logprobs is None else batch.reference_logprobs[part],
                max_completion_length=settings.max_completion_length, tis=settings.tis)
            # Each part's loss is normalised over its own tokens (rows); reweight so that the sum
            # over parts and ranks is the update-wide mean (data parallelism averages).
            weight = mask[part].sum() / tokens if normalised_per_token(settings.loss) else (logprobs.shape[0] / row_count)
        with memory_phase("backward", BACKWARD_HINT):
            backward(loss * weight * world)
        passes.add(entropy, mask[part], stats)
    return torch.cat(parts)
