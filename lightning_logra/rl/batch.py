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
from lightning_logra.rl.collectives import global_counts, max_over_ranks
from lightning_logra.rl.config import LossConfig
from lightning_logra.rl.logprobs import ForwardDraw, packed_sequence_logprobs, sequence_logprobs
from lightning_logra.rl.losses import micro_batch_loss, normalised_per_token
from lightning_logra.rl.metrics import PassTotals
from lightning_logra.rl.packing import row_micro_batches, token_micro_batches
from lightning_logra.rollout.base import Rollouts

# What shrinks the forward/backward's memory, for the error an out-of-memory there raises.
BACKWARD_HINT = ("batching.micro_batch_size (or batching.micro_batch_tokens), activation_checkpointing=true, "
                 "batching.logprob_chunk_positions")


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

    def probe_batch(self, rows: slice, *, num_generations: int, temperature: float, packed: bool = False) -> ProbeBatch:
        """The rows' responses for LoGRA's KL probe, scored at the positions that generated
        their tokens, at the sampling temperature (``packed``: see ``ProbeBatch``). Rows come
        one per prompt first (then each prompt's second sample, ...), so the reference
        probe's first responses answer different prompts; each row's key is its advantage,
        which the stratified and weighted probes sort by (rows of rare outcomes carry most of a
        step's KL)."""
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
            packed=packed,
            row_keys=self.advantages[rows][order],
        )

    def logprob_pairs(self, rows: slice, trainer_logprobs: torch.Tensor) -> LogprobPairs:
        """Rollout vs trainer log-probs of the completion tokens of EOS-terminated responses."""
        ended = self.rollouts.ended_with_eos[rows, None]
        return LogprobPairs(self.rollout_logprobs[rows], trainer_logprobs, self.mask[rows] & ended)


@dataclass(frozen=True)
class MicroBatching:
    """How one update's rows go through forward/backward: ``micro_batch_size`` rows at a time
    (left-padded), or with ``micro_batch_tokens`` rows of at most that many real tokens
    together as one packed row; log-probs at ``temperature`` in chunks of ``chunk_size``
    positions, the loss of ``loss`` (``tis``: truncated importance sampling in the clipped
    losses)."""

    loss: LossConfig
    micro_batch_size: int
    temperature: float
    chunk_size: int
    max_completion_length: int
    tis: bool
    micro_batch_tokens: int | None = None

    def micro_batches(self, attention_mask: torch.Tensor, rows: slice) -> list[torch.Tensor]:
        """The rows ``rows`` of a padded batch, as index tensors one per micro-batch."""
        if self.micro_batch_tokens is None:
            return row_micro_batches(rows, self.micro_batch_size, attention_mask.device)
        return token_micro_batches(attention_mask, rows, self.micro_batch_tokens)

    def logprobs(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 return_entropy: bool = False,
                 draw: ForwardDraw | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's ``B x (T-1)`` log-probs: packed with ``micro_batch_tokens``, else
        padded (``draw``: fresh tokens drawn in the same forward)."""
        compute = sequence_logprobs if self.micro_batch_tokens is None else packed_sequence_logprobs
        return compute(model, input_ids, attention_mask, temperature=self.temperature, chunk_size=self.chunk_size,
                       return_entropy=return_entropy, draw=draw)


def batch_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   settings: MicroBatching) -> torch.Tensor:
    """Log-probs of a whole padded batch (no grad: old or reference log-probs), micro-batched
    as training is; every rank runs as many forwards as the rank with the most (FSDP2)."""
    parts = settings.micro_batches(attention_mask, slice(0, input_ids.shape[0]))
    logprobs = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, device=input_ids.device)
    for index in range(max_over_ranks(len(parts), input_ids.device)):
        part = parts[min(index, len(parts) - 1)]
        values = settings.logprobs(model, input_ids[part], attention_mask[part])
        if index < len(parts):
            logprobs[part] = values
    return logprobs


def backward_micro_batches(
    policy: nn.Module,
    batch: RolloutBatch,
    rows: slice,
    settings: MicroBatching,
    *,
    backward: Callable[[torch.Tensor], None],
    passes: PassTotals,
    world: int = 1,
    draw_at: Callable[[torch.Tensor], ForwardDraw | None] | None = None,
) -> torch.Tensor | None:
    """Forward and ``backward`` every micro-batch of ``rows``, each loss weighted so that the
    sum over micro-batches and ``world`` ranks is the update-wide mean; add each pass to
    ``passes``. ``draw_at(part)``, given a micro-batch's row indices, may return tokens to
    draw in its forward (``policy/step_kl``'s, from the policy before the step). Returns the
    rows' detached trainer log-probs, or None (and runs nothing) when no rank has a token to
    train on there."""
    mask = batch.mask
    totals = global_counts(mask[rows])
    if totals[2] == 0:
        return None
    input_ids, attention_mask = batch.rollouts.input_ids, batch.rollouts.attention_mask
    parts = settings.micro_batches(attention_mask, rows)
    trained = torch.zeros(rows.stop - rows.start, input_ids.shape[1] - 1, device=input_ids.device)
    for index in range(max_over_ranks(len(parts), input_ids.device)):
        part = parts[min(index, len(parts) - 1)]
        draw = draw_at(part) if draw_at is not None and index < len(parts) else None
        with memory_phase("backward", BACKWARD_HINT):
            logprobs, entropy = settings.logprobs(policy, input_ids[part], attention_mask[part], return_entropy=True,
                                                  draw=draw)
        if index >= len(parts) or not mask[part].any():
            # Nothing to train on here (this rank's micro-batches ran out, or every completion
            # is masked) while other micro-batches (ranks) train: a zero loss keeps this
            # backward, and FSDP2's collectives, in step with theirs.
            with memory_phase("backward", BACKWARD_HINT):
                backward(torch.where(mask[part], logprobs, 0.0).sum() * 0.0)
            if index < len(parts):
                trained[part - rows.start] = logprobs.detach()
                passes.add(entropy, mask[part], {})
            continue
        trained[part - rows.start] = logprobs.detach()
        old = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs[part]
        loss, stats = micro_batch_loss(
            settings.loss, logprobs, old, batch.rollout_logprobs[part], batch.advantages[part], mask[part],
            None if batch.reference_logprobs is None else batch.reference_logprobs[part],
            max_completion_length=settings.max_completion_length, tis=settings.tis)
        objective = loss * _part_weight(settings.loss, mask[part], totals)
        if settings.loss.entropy_coef > 0:
            # The bonus is the update-wide mean entropy of the trained tokens, whatever the
            # loss's own normaliser: this part's share of it.
            objective = objective - settings.loss.entropy_coef * torch.where(mask[part], entropy, 0.0).sum() / totals[2]
        with memory_phase("backward", BACKWARD_HINT):
            backward(objective * world)
        passes.add(entropy, mask[part], stats)
    return trained


def _part_weight(loss: LossConfig, mask: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Each part's loss is a mean over its own tokens, rows with tokens (sequence means) or
    rows (Dr. GRPO's constant): this weight makes the sum over parts and ranks the
    update-wide mean, whichever rows share a part (data parallelism averages)."""
    if normalised_per_token(loss):
        return mask.sum() / totals[2]
    if loss.type == "dr_grpo":
        return mask.shape[0] / totals[0]
    return mask.any(dim=1).sum() / totals[1]


def mini_batch_rows(rows: int, num_generations: int, mini_batches: int) -> list[slice]:
    """Consecutive row ranges of whole prompt groups, one per optimizer step."""
    prompts = rows // num_generations
    if prompts % mini_batches:
        raise ValueError(f"batching.mini_batches = {mini_batches} must divide the {prompts} prompts of a step on each "
                         "rank (the data module's batch_size)")
    size = rows // mini_batches
    return [slice(start, start + size) for start in range(0, rows, size)]
