"""What a rollout engine returns, and the interface every engine implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from lightning_logra.core.lowrank import LowRankUpdate


@dataclass
class Rollouts:
    """A batch of sampled completions, ``B = len(prompts) * num_generations`` rows in group
    layout ``[p0 g0, p0 g1, ..., p1 g0, ...]``; ``T = prompt_length + longest completion``.

    - ``input_ids``: prompt left-padded to ``prompt_length``, then the completion right-padded.
    - ``attention_mask``: 1 on real prompt tokens and generated tokens, 0 on padding.
    - ``completion_mask``: 1 on generated tokens (including a final EOS), 0 elsewhere.
    - ``rollout_logprobs``: float32; ``[:, t]`` is log p(``input_ids[:, t]`` | the tokens before)
      under the distribution the token was sampled from (temperature, and top-p where used);
      0 off the completion. Trainer log-probs from ``sequence_logprobs`` (``B x (T-1)``,
      predicting token ``t+1``) line up with ``rollout_logprobs[:, 1:]`` and ``completion_mask[:, 1:]``.
    - ``completion_text``: decoded completions without special tokens (with tools: the last
      assistant turn's text, the answer).
    - ``ended_with_eos``: whether each completion stopped on EOS (else it hit the length limit).

    Multi-turn rollouts (tools) fill two more fields. The completion region, everything
    after the prompt, then holds the assistant turns' generated tokens and, between them, the
    tokens of the tool results and the next assistant header, as the engine was given them:
    ``environment_mask`` is 1 on those (0 elsewhere), which are context, never trained:
    ``completion_mask`` and ``rollout_logprobs`` are 0 there. ``conversations`` has each
    row's transcript and counts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    completion_text: list[str]
    ended_with_eos: torch.Tensor
    prompt_length: int
    environment_mask: torch.Tensor | None = None
    conversations: list[Conversation] | None = None

    @property
    def completion_region(self) -> torch.Tensor:
        """1 on every token after the prompt: generated, and tool results where there are any."""
        if self.environment_mask is None:
            return self.completion_mask
        return self.completion_mask | self.environment_mask


@dataclass
class Conversation:
    """One multi-turn rollout: ``messages`` (the completion as chat messages: assistant turns,
    with their ``tool_calls``, and ``tool`` results), ``turns`` (assistant turns generated),
    ``tool_calls`` and ``tool_failures`` (calls whose result was an error), and, with an
    environment that defines ``get_reward``, its class name (``reward_source``) and score
    (None where it gave none, or failed: ``environment_reward_failed``). ``failure`` says why
    the rollout never started (its environment's ``reset`` failed, or the prompt left no
    room): nothing was generated, and None where it ran."""

    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    reward_source: str | None = None
    environment_reward: float | None = None
    environment_reward_failed: bool = False
    failure: str | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What ``GRPOModule`` asks of an engine: samples, and weights brought up to date."""

    last_sync_bytes: int | None
    """Bytes the last ``sync_weights`` took from the trainer; None for an engine that
    generates with the training model itself (nothing to send)."""

    def generate(
        self, prompts: list[str], *, num_generations: int, temperature: float | None = None, top_p: float | None = None
    ) -> Rollouts:
        """``num_generations`` samples of each prompt in group layout; ``temperature`` and
        ``top_p`` override the engine's own for this call (validation)."""
        ...

    def sync_weights(self, model: nn.Module, low_rank_updates: list[LowRankUpdate] | None = None) -> None:
        """Make the engine sample from ``model``'s current weights; an engine that takes
        ``low_rank_updates`` (the LoGRA updates since the last sync) may apply those instead."""
        ...

    def continue_tokens(self, token_ids: list[list[int]], max_new_tokens: list[int], *, temperature: float | None = None,
                        top_p: float | None = None) -> list[Continuation]:
        """One sample continuing each token list exactly as given (nothing re-tokenised), of
        at most ``max_new_tokens[i]`` tokens: a turn of a multi-turn rollout."""
        ...


@dataclass
class Continuation:
    """Tokens sampled after a given token list, their log-probs (as ``Rollouts``' are), and
    whether sampling stopped on EOS (the EOS is the last token) rather than the token limit."""

    token_ids: list[int]
    logprobs: list[float]
    ended_with_eos: bool


def check_request(prompts: list[str], num_generations: int) -> None:
    if not prompts or num_generations < 1:
        raise ValueError(f"need prompts and num_generations >= 1, got {len(prompts)} prompts, {num_generations}")


def pack_rollouts(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    completion_logprobs: list[list[float]],
    completion_text: list[str],
    ended_with_eos: list[bool],
    pad_token_id: int,
    device: torch.device | str = "cpu",
    environment_masks: list[list[int]] | None = None,
    conversations: list[Conversation] | None = None,
) -> Rollouts:
    """Lay out per-row token lists (prompts unpadded, completions up to and including any
    EOS) as padded ``Rollouts`` tensors. Multi-turn rows: ``environment_masks`` marks, per
    completion token, those a tool or environment gave (1), and their log-probs are 0."""
    rows = len(prompt_ids)
    if not rows or any(len(x) != rows for x in (completion_ids, completion_logprobs, completion_text, ended_with_eos)):
        raise ValueError("pack_rollouts needs the same non-zero number of prompts, completions, log-probs and texts")
    for row, (ids, logprobs) in enumerate(zip(completion_ids, completion_logprobs)):
        if len(ids) != len(logprobs):
            raise ValueError(f"row {row}: {len(ids)} completion tokens but {len(logprobs)} log-probs")
        if environment_masks is not None and len(environment_masks[row]) != len(ids):
            raise ValueError(f"row {row}: {len(ids)} completion tokens but {len(environment_masks[row])} "
                             "environment-mask entries")
    prompt_length = max(len(ids) for ids in prompt_ids)
    width = prompt_length + max(len(ids) for ids in completion_ids)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    completion_mask = torch.zeros(rows, width, dtype=torch.long)
    rollout_logprobs = torch.zeros(rows, width, dtype=torch.float32)
    for row, (prompt, completion, logprobs) in enumerate(zip(prompt_ids, completion_ids, completion_logprobs)):
        end = prompt_length + len(completion)
        input_ids[row, prompt_length - len(prompt) : prompt_length] = torch.tensor(prompt, dtype=torch.long)
        input_ids[row, prompt_length:end] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, prompt_length - len(prompt) : end] = 1
        completion_mask[row, prompt_length:end] = 1
        rollout_logprobs[row, prompt_length:end] = torch.tensor(logprobs, dtype=torch.float32)
    environment_mask = None
    if environment_masks is not None:
        environment_mask = torch.zeros(rows, width, dtype=torch.long)
        for row, marks in enumerate(environment_masks):
            environment_mask[row, prompt_length : prompt_length + len(marks)] = torch.tensor(marks, dtype=torch.long)
        completion_mask -= environment_mask
        rollout_logprobs.masked_fill_(environment_mask.bool(), 0.0)
    return Rollouts(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        completion_mask=completion_mask.to(device),
        rollout_logprobs=rollout_logprobs.to(device),
        completion_text=list(completion_text),
        ended_with_eos=torch.tensor(ended_with_eos, dtype=torch.bool, device=device),
        prompt_length=prompt_length,
        environment_mask=None if environment_mask is None else environment_mask.to(device),
        conversations=None if conversations is None else list(conversations),
    )


def select_rows(parts: list[tuple[Rollouts, list[int]]], pad_token_id: int) -> Rollouts:
    """The chosen rows of several ``Rollouts`` (e.g. generation rounds of different prompts,
    padded to different widths), in the order given, laid out anew as one ``Rollouts``."""
    prompt_ids, completion_ids, logprobs, texts, ended = [], [], [], [], []
    environment_masks, conversations = [], []
    multi_turn = parts[0][0].conversations is not None
    for rollouts, rows in parts:
        completion_part = rollouts.completion_region.bool()
        prompt_part = rollouts.attention_mask.bool() & ~completion_part
        for row in rows:
            prompt_ids.append(rollouts.input_ids[row][prompt_part[row]].tolist())
            completion_ids.append(rollouts.input_ids[row][completion_part[row]].tolist())
            logprobs.append(rollouts.rollout_logprobs[row][completion_part[row]].tolist())
            texts.append(rollouts.completion_text[row])
            ended.append(bool(rollouts.ended_with_eos[row]))
            if multi_turn:
                environment_masks.append(rollouts.environment_mask[row][completion_part[row]].tolist())
                conversations.append(rollouts.conversations[row])
    device = parts[0][0].input_ids.device
    return pack_rollouts(prompt_ids, completion_ids, logprobs, texts, ended, pad_token_id, device=device,
                         environment_masks=environment_masks if multi_turn else None,
                         conversations=conversations if multi_turn else None)
