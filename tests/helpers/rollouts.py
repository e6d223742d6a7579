"""Synthetic rollout batches of chosen prompt and completion lengths, for the micro-batching
tests (padded vs packed) on one rank and on two."""

from __future__ import annotations

import torch

from lightning_logra.rl.batch import MicroBatching, RolloutBatch
from lightning_logra.rl.config import LossConfig
from lightning_logra.rollout.base import pack_rollouts


def rollout_batch(prompt_lengths: list[int], completion_lengths: list[int], *, vocab: int = 64, seed: int = 0,
                  ended_with_eos: list[bool] | None = None, mask_truncated: bool = False) -> RolloutBatch:
    """Random tokens in ``Rollouts``' layout (prompts left-padded, completions right-padded),
    rollout log-probs near the trainer's, and one advantage per row."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(count: int) -> list[int]:
        return torch.randint(1, vocab, (count,), generator=generator).tolist()

    ended = ended_with_eos if ended_with_eos is not None else [True] * len(prompt_lengths)
    rollouts = pack_rollouts(
        [tokens(n) for n in prompt_lengths], [tokens(n) for n in completion_lengths],
        [(-1.0 - torch.rand(n, generator=generator)).tolist() for n in completion_lengths],
        [""] * len(prompt_lengths), ended, pad_token_id=0)
    mask = rollouts.completion_mask[:, 1:].bool()
    if mask_truncated:
        mask = mask & rollouts.ended_with_eos[:, None]
    advantages = torch.randn(len(prompt_lengths), generator=generator)
    return RolloutBatch(rollouts, mask, rollouts.rollout_logprobs[:, 1:], advantages)


def micro_batching(loss: LossConfig | None = None, *, size: int = 2, tokens: int | None = None,
                   tis: bool = True) -> MicroBatching:
    """Padded micro-batches of ``size`` rows, or packed ones of ``tokens`` real tokens."""
    return MicroBatching(loss=loss or LossConfig(), micro_batch_size=size, temperature=0.9, chunk_size=7,
                         max_completion_length=16, tis=tis, micro_batch_tokens=tokens)
