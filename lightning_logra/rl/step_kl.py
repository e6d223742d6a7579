"""``policy/step_kl``: how far one optimizer step moved the policy on its own batch.

The quantity is the one LoGRA's KL budget bounds: the mean, over every trained position of
the update's rows, of KL(before || after) between the position's next-token distributions.
Before the step, ``draw_before_step`` picks rows stratified by advantage (the stratified
probe's rule, ``stratified_rows``: a step's KL sits mostly in a few rows of rare outcomes)
and draws ``SAMPLES`` tokens at each of their trained positions from the pre-step policy;
after it, ``step_kl_sums`` scores those tokens again. k3 of their log-prob ratio is
unbiased for each position's KL because the tokens are fresh: k3 at the tokens the update
was trained on, which it raised or lowered on purpose, over-stated the KL 1.5-5x on the
quickstart (``benchmarks/results/step_kl_rows.md``). Two no-grad forwards over the drawn
rows; with ``count=0`` every row is drawn (each stands for itself) and the estimate's only
noise is the token draws'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_logra.core.probe_batch import stratified_rows
from lightning_logra.core.reliability import memory_phase
from lightning_logra.rl.batch import BACKWARD_HINT, MicroBatching, RolloutBatch
from lightning_logra.rl.collectives import max_over_ranks
from lightning_logra.rl.logprobs import logprobs_of, sampled_token_logprobs
from lightning_logra.rl.losses import k3

SAMPLES = 4  # fresh tokens per position: the token draws' share of the error (see the metrics guide)


@dataclass(frozen=True)
class StepKLDraw:
    """The rows (indices into the batch), their weights (positions each trained position
    stands for), and per trained position ``SAMPLES`` tokens drawn before the step with
    their log-probs then (``len(rows) x (T-1) x SAMPLES``)."""

    rows: torch.Tensor
    weights: torch.Tensor
    tokens: torch.Tensor
    before: torch.Tensor


def draw_before_step(policy: nn.Module, batch: RolloutBatch, rows: slice, settings: MicroBatching, *,
                     count: int, generator: torch.Generator) -> StepKLDraw:
    """At the pre-step weights: ``count`` rows of ``rows`` stratified by advantage (every
    row when 0) and fresh tokens at their trained positions. Every rank must call it."""
    mask = batch.mask[rows]
    positions = mask.sum(dim=1)
    if count == 0:
        chosen = [row for row in range(mask.shape[0]) if positions[row] > 0]
        weights = [1.0] * len(chosen)
    else:
        chosen, weights = stratified_rows(positions, positions.tolist(), batch.advantages[rows], count, generator)
    device = mask.device
    picked = torch.tensor(chosen, dtype=torch.long, device=device) + rows.start
    tokens = torch.zeros(len(chosen), mask.shape[1], SAMPLES, dtype=torch.long, device=device)
    before = torch.zeros(tokens.shape, device=device)
    draw = StepKLDraw(picked, torch.tensor(weights, dtype=torch.float64, device=device), tokens, before)
    for part, (input_ids, attention_mask, _) in _forwards(batch, draw, settings.micro_batch_size):
        with memory_phase("backward", BACKWARD_HINT):
            drawn, logprobs = sampled_token_logprobs(policy, input_ids, attention_mask, samples=SAMPLES,
                                                     generator=generator, temperature=settings.temperature,
                                                     chunk_size=settings.chunk_size)
        if part is not None:
            tokens[part], before[part] = drawn, logprobs
    return draw


def step_kl_sums(policy: nn.Module, batch: RolloutBatch, draw: StepKLDraw,
                 settings: MicroBatching) -> tuple[torch.Tensor, torch.Tensor]:
    """At the post-step weights: this rank's weighted sum over the drawn rows' trained
    positions of the mean k3 of the fresh tokens, and the positions they stand for (the
    update's trained positions on this rank, exactly, when rows were drawn stratified).
    Every rank must call it."""
    mask = batch.mask[draw.rows]
    after = torch.zeros_like(draw.before)
    for part, (input_ids, attention_mask, tokens) in _forwards(batch, draw, settings.micro_batch_size):
        with memory_phase("backward", BACKWARD_HINT):
            logprobs = logprobs_of(policy, input_ids, attention_mask, tokens, temperature=settings.temperature,
                                   chunk_size=settings.chunk_size)
        if part is not None:
            after[part] = logprobs
    per_position = k3((after - draw.before).double()).mean(dim=-1)
    weights = draw.weights[:, None]
    return (per_position * mask * weights).sum(), (mask * weights).sum()


def _forwards(batch: RolloutBatch, draw: StepKLDraw, size: int):
    """(slice of the drawn rows, their (input_ids, attention_mask, tokens)), ``size`` rows at a
    time; every rank runs as many forwards as the rank with the most (FSDP2): one with fewer
    runs the batch's first row, slice None (its result is dropped)."""
    rows, device = len(draw.rows), draw.tokens.device
    parts: list[slice | None] = [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
    parts += [None] * (max_over_ranks(len(parts), device) - len(parts))
    for part in parts:
        index = draw.rows[part] if part is not None else torch.zeros(1, dtype=torch.long, device=device)
        tokens = draw.tokens[part] if part is not None else draw.tokens.new_zeros(1, *draw.tokens.shape[1:])
        yield part, (batch.rollouts.input_ids[index], batch.rollouts.attention_mask[index], tokens)
