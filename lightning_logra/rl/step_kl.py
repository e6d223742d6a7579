"""``policy/step_kl``: how far one optimizer step moved the policy on its own batch (and
``val/kl_from_init``: how far training has moved it from the initial weights).

The quantity is the one LoGRA's KL budget bounds: the mean, over every trained position of
the update's rows, of KL(before || after) between the position's next-token distributions.
Before the step, ``plan_draw`` picks rows in strata of equal expected KL by advantage (the
weighted probe's rule, ``share_weighted_rows``: a step's KL sits mostly in a few rows of
rare outcomes, which it draws for certain), and the training forward itself draws
``SAMPLES`` tokens at each of their trained positions from the pre-step policy
(``TokenDraw.in_micro_batch``); after the step, ``k3_sums`` scores those tokens again.
k3 of their log-prob ratio is unbiased for each position's KL because the tokens are
fresh: k3 at the tokens the update was trained on, which it raised or lowered on purpose,
over-stated the KL 1.5-5x on the quickstart (``benchmarks/results/step_kl_rows.md``).
One no-grad forward over the drawn rows, after the step (drawing in the training forward
saves the second, about half the measurement's cost); with ``count=0`` every row is drawn
(each stands for itself) and the estimate's only noise is the token draws'. The same
functions measure KL(policy || initial policy) on validation samples: tokens drawn from the
policy in a forward of their own (``draw_tokens``), scored by the frozen initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_logra.core.probe_batch import share_weighted_rows
from lightning_logra.core.reliability import memory_phase
from lightning_logra.core.reshard import reshard
from lightning_logra.rl.batch import BACKWARD_HINT, MicroBatching, RolloutBatch
from lightning_logra.rl.collectives import max_over_ranks
from lightning_logra.rl.logprobs import ForwardDraw, logprobs_of, sampled_token_logprobs
from lightning_logra.rl.kl_estimators import k3
from lightning_logra.rollout.base import Rollouts

SAMPLES = 4  # fresh tokens per position: the token draws' share of the error (see the metrics guide)


@dataclass
class TokenDraw:
    """The rows (indices into the batch), their weights (positions each trained position
    stands for), and per trained position ``SAMPLES`` tokens drawn from the model that drew
    them with their log-probs under it (``len(rows) x (T-1) x SAMPLES``), drawn by
    ``generator``. ``forward_draws``: the training forwards' parts of the drawing."""

    rows: torch.Tensor
    weights: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    generator: torch.Generator
    forward_draws: list[ForwardDraw] = field(default_factory=list)

    def in_micro_batch(self, part: torch.Tensor) -> ForwardDraw | None:
        """What the forward of the micro-batch of batch rows ``part`` draws: tokens at the
        drawn rows among them (``backward_micro_batches``' ``draw_at``); None if there are none."""
        local, slots = (part[:, None] == self.rows[None, :]).nonzero(as_tuple=True)
        if len(local) == 0:
            return None
        draw = ForwardDraw(local, slots, self.tokens, self.logprobs, self.generator)
        self.forward_draws.append(draw)
        return draw

    @property
    def forward_seconds(self) -> float:
        """Wall clock the training forwards spent drawing (``policy/step_kl``'s, not training's)."""
        return sum(draw.seconds for draw in self.forward_draws)


def plan_draw(batch: RolloutBatch, rows: slice, *, count: int, generator: torch.Generator) -> TokenDraw:
    """``count`` rows of ``rows`` in strata of equal expected KL by advantage (every row with
    a trained position when 0), with room for their tokens; ``generator`` (on the batch's device) will draw the
    tokens, and its seed draws the rows here, on the CPU."""
    mask = batch.mask[rows]
    positions = mask.sum(dim=1)
    if count == 0:
        chosen = [row for row in range(mask.shape[0]) if positions[row] > 0]
        weights = [1.0] * len(chosen)
    else:
        rows_generator = torch.Generator().manual_seed(generator.initial_seed())
        chosen, weights = share_weighted_rows(positions, positions.tolist(), batch.advantages[rows], count,
                                              rows_generator)
    device = mask.device
    picked = torch.tensor(chosen, dtype=torch.long, device=device) + rows.start
    tokens = torch.zeros(len(chosen), mask.shape[1], SAMPLES, dtype=torch.long, device=device)
    return TokenDraw(picked, torch.tensor(weights, dtype=torch.float64, device=device), tokens,
                     torch.zeros(tokens.shape, device=device), generator)


def draw_tokens(policy: nn.Module, batch: RolloutBatch, rows: slice, settings: MicroBatching, *,
                count: int, generator: torch.Generator) -> TokenDraw:
    """``plan_draw``'s rows, and their tokens drawn from ``policy`` in no-grad forwards of
    their own (where no training forward runs, e.g. on validation samples). Every rank must
    call it."""
    draw = plan_draw(batch, rows, count=count, generator=generator)
    for part, (input_ids, attention_mask, _) in _forwards(batch, draw, settings.micro_batch_size):
        with memory_phase("backward", BACKWARD_HINT):
            drawn, drawn_logprobs = sampled_token_logprobs(policy, input_ids, attention_mask, samples=SAMPLES,
                                                           generator=generator, temperature=settings.temperature,
                                                           chunk_size=settings.chunk_size)
        if part is not None:
            draw.tokens[part], draw.logprobs[part] = drawn, drawn_logprobs
    return draw


def k3_sums(model: nn.Module, batch: RolloutBatch, draw: TokenDraw,
            settings: MicroBatching) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(the drawing model || ``model``), as this rank's sum over the drawn rows' trained
    positions, each weighted by its row's weight, of the mean k3 of the drawn tokens'
    log-probs under ``model`` over the drawing model's; and the positions they stand for
    (the rows' trained positions on this rank, exactly). Every rank must call it."""
    mask = batch.mask[draw.rows]
    scored = torch.zeros_like(draw.logprobs)
    for part, (input_ids, attention_mask, tokens) in _forwards(batch, draw, settings.micro_batch_size):
        with memory_phase("backward", BACKWARD_HINT):
            logprobs = logprobs_of(model, input_ids, attention_mask, tokens, temperature=settings.temperature,
                                   chunk_size=settings.chunk_size)
        if part is not None:
            scored[part] = logprobs
    per_position = k3((scored - draw.logprobs).double()).mean(dim=-1)
    weights = draw.weights[:, None]
    return (per_position * mask * weights).sum(), (mask * weights).sum()


def completion_kl(policy: nn.Module, reference: nn.Module, rollouts: Rollouts, settings: MicroBatching,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(policy || reference) over every completion position of ``rollouts``, as this rank's
    sum and positions (``k3_sums``; e.g. ``val/kl_from_init``). No gradient; each model is
    resharded after (FSDP2: no backward follows). Every rank must call it."""
    mask = rollouts.completion_mask[:, 1:].bool()
    samples = RolloutBatch(rollouts, mask, rollouts.rollout_logprobs[:, 1:],
                           torch.zeros(mask.shape[0], device=mask.device))
    with torch.no_grad():
        draw = draw_tokens(policy, samples, slice(0, mask.shape[0]), settings, count=0, generator=generator)
        sums = k3_sums(reference, samples, draw, settings)
    for model in (policy, reference):
        reshard(model)
    return sums


def _forwards(batch: RolloutBatch, draw: TokenDraw, size: int):
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
