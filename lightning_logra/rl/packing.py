"""Micro-batches by tokens: rollout rows grouped so that each micro-batch holds at most a
budget of real tokens, to run as one packed row (``packed_sequence_logprobs``).

Under FSDP2 every rank must run as many forwards (and backwards) as every other, since each
gathers weights collectively; ranks that pack into fewer micro-batches run the difference
as micro-batches that change nothing (``collectives.max_over_ranks`` agrees the count).
"""

from __future__ import annotations

import warnings

import torch


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups whose lengths sum to at most ``budget``: longest
    first, each into the first group with room. A length over the budget gets a group of
    its own (one warning names the budget)."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    groups: list[list[int]] = []
    room: list[int] = []
    oversized = 0
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > budget:
            oversized += 1
            groups.append([index])
            room.append(0)
            continue
        target = next((g for g, free in enumerate(room) if free >= length), None)
        if target is None:
            groups.append([])
            room.append(budget)
            target = len(groups) - 1
        groups[target].append(index)
        room[target] -= length
    if oversized:
        # One message per budget: Python's warning filter shows it once per process.
        warnings.warn(f"micro_batch_tokens = {budget} is less than the real tokens of some sequences: each of them "
                      "runs as a micro-batch of its own (raise micro_batch_tokens to bound every micro-batch)",
                      stacklevel=2)
    return [sorted(group) for group in groups]


def token_micro_batches(attention_mask: torch.Tensor, rows: slice, budget: int) -> list[torch.Tensor]:
    """The rows ``rows`` of a padded batch as micro-batches of at most ``budget`` real
    tokens each: index tensors into the batch, ascending within each micro-batch."""
    lengths = attention_mask[rows].sum(dim=1).tolist()
    return [torch.tensor(group, device=attention_mask.device) + rows.start
            for group in first_fit_decreasing(lengths, budget)]


def row_micro_batches(rows: slice, size: int, device: torch.device) -> list[torch.Tensor]:
    """The rows ``rows`` in consecutive micro-batches of ``size`` rows, as index tensors."""
    return [torch.arange(start, min(start + size, rows.stop), device=device) for start in range(rows.start, rows.stop, size)]

