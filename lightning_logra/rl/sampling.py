"""What one RL step trains on: scored rollouts, DAPO's dynamic sampling and overlong penalty.

Rows keep the group layout ``[p0 g0, p0 g1, ..., p1 g0, ...]`` of ``Rollouts`` throughout, so
group ``g`` is rows ``g * n .. (g + 1) * n - 1`` for ``n = num_generations``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_logra.rewards import RewardRunner, RewardScores, format_completions
from lightning_logra.rollout.base import Rollouts, select_rows


@dataclass
class ScoredRollouts:
    """Samples with their prompts' dataset columns (one entry per sample, ``prompts`` and
    ``answer`` included) and rewards: ``scores`` as the reward functions gave them,
    ``rewards`` the per-sample totals the advantages are computed from (overlong penalty in)."""

    rollouts: Rollouts
    columns: dict[str, list]
    scores: RewardScores
    rewards: torch.Tensor


def score_rollouts(runner: RewardRunner, rollouts: Rollouts, batch: dict[str, list], n: int) -> tuple[RewardScores, dict[str, list]]:
    """Call the reward functions the TRL way: completions (messages for conversational
    prompts), ``prompts``, ``completion_ids`` and every dataset column, one entry per sample.
    Returns the scores and the batch's columns repeated for each of the ``n`` samples.

    Multi-turn rollouts: ``completions`` are the final assistant turns (the answers),
    ``completion_ids`` the generated tokens of every turn, ``transcripts`` each whole
    conversation after the prompt (assistant and ``tool`` messages); an environment's
    ``get_reward()`` is one more source of weight 1, named after its class."""
    columns = {key: [value for value in values for _ in range(n)] for key, values in batch.items()}
    prompts = columns.get("prompt") or columns["prompt_text"]
    completion_ids = [row[mask.bool()].tolist() for row, mask in zip(rollouts.input_ids, rollouts.completion_mask)]
    extra = {key: values for key, values in columns.items() if key not in ("prompt", "prompt_text")}
    conversations = rollouts.conversations
    if conversations is not None:
        extra["transcripts"] = [conversation.messages for conversation in conversations]
    scores = runner(format_completions(prompts, rollouts.completion_text), prompts=prompts,
                    completion_ids=completion_ids, **extra)
    if conversations is not None and conversations[0].reward_source is not None:
        scores = scores.with_source(conversations[0].reward_source,
                                    [conversation.environment_reward for conversation in conversations],
                                    [conversation.environment_reward_failed for conversation in conversations])
    return scores, columns


def draw_prompts(loader, count: int, seed: int) -> dict[str, list]:
    """``count`` prompts of the train loader's dataset, by a permutation seeded with ``seed``,
    collated as the loader collates its batches."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__"):
        raise TypeError("rollout.dynamic_sampling draws further prompts from the train dataloader's dataset, "
                        f"which must be a map-style Dataset; got {type(dataset).__name__}")
    indices = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    return loader.collate_fn([dataset[index] for index in indices])


@dataclass
class SamplingStats:
    """How dynamic sampling filled one step's batch (this rank's)."""

    extra_rounds: int
    dropped_groups: int
    unfilled_groups: int


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A seed for one (step, rank): sampling never depends on what earlier steps consumed."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % 2**63


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_new_tokens - buffer`` completion tokens,
    then falling linearly to ``-penalty`` at ``max_new_tokens``, so the model learns to stop
    before the hard cut rather than being scored on an unfinished answer alone."""
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * excess / buffer


def informative_groups(rewards: torch.Tensor, group_size: int) -> list[bool]:
    """Per group: whether its rewards differ (a group of equal rewards has zero advantages)."""
    groups = rewards.view(-1, group_size)
    return (groups != groups[:, :1]).any(dim=1).tolist()


def fill_informative_groups(
    first: ScoredRollouts,
    more: Callable[[int], ScoredRollouts],
    *,
    group_size: int,
    max_rounds: int,
    pad_token_id: int,
    any_rank: Callable[[bool], bool],
) -> tuple[ScoredRollouts, SamplingStats]:
    """Keep the groups of ``first`` whose rewards differ and generate further rounds
    (``more(round)``, ``round = 1, 2, ...``) until as many groups as ``first`` had are kept,
    or ``max_rounds`` extra rounds are spent; then fill the rest with dropped groups, in the
    order they came (they train on nothing under group-relative advantages, but keep the
    batch shape). ``any_rank(need_more)`` makes every rank run the same number of rounds:
    generation under FSDP2 is a collective."""
    want = first.rewards.numel() // group_size
    parts = [first]
    kept: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []

    def sort_groups(index: int) -> None:
        for group, useful in enumerate(informative_groups(parts[index].rewards, group_size)):
            (kept if useful else dropped).append((index, group))

    sort_groups(0)
    rounds = 0
    while rounds < max_rounds and any_rank(len(kept) < want):
        rounds += 1
        parts.append(more(rounds))
        sort_groups(len(parts) - 1)
    chosen = kept[:want] + dropped[: max(0, want - len(kept))]
    stats = SamplingStats(extra_rounds=rounds, dropped_groups=len(dropped), unfilled_groups=max(0, want - len(kept)))
    if chosen == [(0, group) for group in range(want)]:
        return first, stats  # nothing replaced: the first round's batch as it is
    return take_groups(parts, chosen, group_size, pad_token_id), stats


def take_groups(parts: list[ScoredRollouts], chosen: list[tuple[int, int]], group_size: int, pad_token_id: int) -> ScoredRollouts:
    """The groups ``chosen`` (``(part, group)`` pairs) as one ``ScoredRollouts``. Failure and
    unscored counts are those of every part: that work was done, kept or not."""
    rows = [(part, [group * group_size + i for i in range(group_size)]) for part, group in chosen]
    rollouts = select_rows([(parts[part].rollouts, indices) for part, indices in rows], pad_token_id)
    names = list(parts[0].scores.per_function)
    scores = RewardScores(
        total=[parts[p].scores.total[i] for p, indices in rows for i in indices],
        per_function={name: [parts[p].scores.per_function[name][i] for p, indices in rows for i in indices] for name in names},
        failures=sum(part.scores.failures for part in parts),
        unscored=sum(part.scores.unscored for part in parts),
    )
    columns = {key: [parts[p].columns[key][i] for p, indices in rows for i in indices] for key in parts[0].columns}
    rewards = torch.cat([parts[p].rewards[indices] for p, indices in rows])
    return ScoredRollouts(rollouts, columns, scores, rewards)
