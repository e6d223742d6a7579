"""Multi-turn rollouts with tools, for every engine: generate a turn, run the tool calls it
ends with, append their results, generate the next turn, until an answer, ``max_turns`` or
the token budget.

Token in, token out: a row is its prompt's tokens, then each turn's generated tokens as the
engine returned them (up to and including the end-of-turn token), then the tool turn's tokens
(``ToolChat.tool_turn_ids``), and so on; each turn is generated from exactly that token
list (``RolloutEngine.continue_tokens``). Nothing is re-tokenised from text, so the tokens the
trainer scores are the tokens that were sampled, turn by turn.

Budget: ``max_tokens`` (``rollout.max_new_tokens``) bounds the whole completion region,
generated and tool tokens together, so that every consumer of that length (prompt-length
checks, the loss's normaliser, the overlong penalty) holds. A turn may use what is left; a
row whose tool results would leave no room for another generated token ends there, as one
that hit the limit (``ended_with_eos`` False).

A rollout that cannot start fails alone: its environment's ``reset`` failed (raised, ran
past the tool timeout, returned a non-string), or its prompt, with the tools and the
environment's observation, leaves fewer than ``max_tokens`` of ``max_positions``. It keeps
its prompt without the observation and an empty completion (``ended_with_eos`` False), its
``Conversation.failure`` says why, and an environment's ``get_reward`` is not asked (the
instance holds another rollout's state): that score counts as failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_logra.rollout.base import Continuation, Conversation, RolloutEngine, Rollouts, pack_rollouts
from lightning_logra.tools.calls import parse_tool_calls
from lightning_logra.tools.environments import Environments, environment_tools
from lightning_logra.tools.execution import ToolRunner
from lightning_logra.tools.schema import tool_schema
from lightning_logra.tools.template import ToolChat


class _Row:
    """One rollout while it is generated: its tokens so far and what they are."""

    def __init__(self, prompt_ids: list[int], tools: dict[str, Callable], environment: object | None) -> None:
        self.prompt_ids = prompt_ids
        self.completion_ids: list[int] = []
        self.logprobs: list[float] = []
        self.environment_marks: list[int] = []
        self.tools = tools
        self.environment = environment
        self.conversation = Conversation()
        self.answer = ""
        self.ended_with_eos = False

    def add(self, ids: list[int], logprobs: list[float], environment: bool) -> None:
        self.completion_ids += ids
        self.logprobs += logprobs
        self.environment_marks += [int(environment)] * len(ids)


class MultiTurnRollouts:
    """Samples conversations in which the model may call ``tools`` (callables) and, with
    ``environments``, the tool methods of one environment instance per rollout."""

    def __init__(self, chat: ToolChat, runner: ToolRunner, *, tools: Sequence[Callable] = (),
                 environments: Environments | None = None, max_turns: int, max_tokens: int,
                 max_positions: int | None = None) -> None:
        if not tools and environments is None:
            raise ValueError("multi-turn rollouts need tools or an environment_factory")
        self.chat = chat
        self.runner = runner
        self.tools = {tool_schema(tool)["function"]["name"]: tool for tool in tools}
        self.environments = environments
        self.schemas = [tool_schema(tool) for tool in tools] + (environments.schemas if environments else [])
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.max_positions = max_positions  # the model's; None: not checked
        self._warned: set[str] = set()

    def tool_prompt_tokens(self) -> int:
        """Tokens a prompt gains when rendered with the tools (at least 0), beside the plain
        rendering by the tokenizer's template that data modules write."""
        messages = [{"role": "user", "content": "."}]
        with_tools = self.chat.prompt_ids(messages, self.schemas)
        tokenizer = self.chat.tokenizer
        plain = self.chat.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)) \
            if getattr(tokenizer, "chat_template", None) else []
        return max(0, len(with_tools) - len(plain))

    def generate(
        self,
        engine: RolloutEngine,
        prompts: list[list[dict]],
        rows: list[dict],
        *,
        num_generations: int,
        temperature: float | None = None,
        top_p: float | None = None,
        device: torch.device | str = "cpu",
        any_rank: Callable[[bool], bool] = bool,
    ) -> Rollouts:
        """``num_generations`` conversations per prompt (``prompts``: message lists; ``rows``:
        their dataset rows, for ``reset``) in group layout. ``any_rank(flag)``: whether any
        data-parallel rank has rows left to generate (HF generation under FSDP2 is a
        collective: every rank runs as many turns)."""
        started = self._start(prompts, rows, num_generations)
        active = [row for row in started if row.conversation.failure is None]
        for turn in range(self.max_turns):
            if not any_rank(bool(active)):
                break
            if not active:  # the other ranks still generate: one token, thrown away
                engine.continue_tokens([started[0].prompt_ids], [1], temperature=temperature, top_p=top_p)
                continue
            continuations = engine.continue_tokens(
                [row.prompt_ids + row.completion_ids for row in active],
                [self.max_tokens - len(row.completion_ids) for row in active], temperature=temperature, top_p=top_p)
            active = [row for row, sampled in zip(active, continuations)
                      if self._take_turn(row, sampled, last=turn == self.max_turns - 1)]
        for row in started:
            self._score(row)
        return pack_rollouts(
            prompt_ids=[row.prompt_ids for row in started],
            completion_ids=[row.completion_ids for row in started],
            completion_logprobs=[row.logprobs for row in started],
            completion_text=[row.answer for row in started],
            ended_with_eos=[row.ended_with_eos for row in started],
            pad_token_id=self.chat.tokenizer.pad_token_id,
            device=device,
            environment_masks=[row.environment_marks for row in started],
            conversations=[row.conversation for row in started],
        )

    def _start(self, prompts: list[list[dict]], rows: list[dict], num_generations: int) -> list[_Row]:
        count = len(prompts) * num_generations
        instances = self.environments.instances(count) if self.environments else [None] * count
        started = []
        for index, environment in enumerate(instances):
            messages, tools = prompts[index // num_generations], dict(self.tools)
            observation = failure = None
            if environment is not None:
                observation, failure = self.environments.reset(environment, rows[index // num_generations], self.runner)
                self._warn_once("reset", failure)
                tools.update(environment_tools(environment))
            prompt_ids = self.chat.prompt_ids(_with_observation(messages, observation) if observation else messages,
                                              self.schemas)
            if failure is None:
                failure = self._no_room(prompt_ids, observed=bool(observation))
                self._warn_once("positions", failure)
                if failure is not None and observation:  # the row keeps the prompt its data gave
                    prompt_ids = self.chat.prompt_ids(messages, self.schemas)
            row = _Row(prompt_ids, tools, environment)
            row.conversation.failure = failure
            started.append(row)
        return started

    def _warn_once(self, kind: str, failure: str | None) -> None:
        """The first failure of each ``kind`` is a warning: a failed reset or an observation
        too long is the environment's to fix, not the model's."""
        if failure is not None and kind not in self._warned:
            self._warned.add(kind)
            rank_zero_warn(f"A rollout could not start: {failure}. Nothing is generated for it, its environment's "
                           "score counts as failed and it counts in tools/failed_rollouts; later failures of this kind "
                           "are only counted")

    def _no_room(self, prompt_ids: list[int], *, observed: bool) -> str | None:
        """Why a prompt of ``prompt_ids`` leaves no room for a completion in the model's
        positions; None when it does (or they are not known)."""
        if self.max_positions is None or len(prompt_ids) + self.max_tokens <= self.max_positions:
            return None
        observation = " with the environment's observation" if observed else ""
        return (f"the prompt{observation} has {len(prompt_ids)} tokens: with the {self.max_tokens} the completion may "
                f"have, it passes the model's {self.max_positions} positions")

    def _take_turn(self, row: _Row, sampled: Continuation, *, last: bool) -> bool:
        """Add a generated turn and, when it calls tools (and may continue), their results;
        whether the row goes on to another turn."""
        row.add(sampled.token_ids, sampled.logprobs, environment=False)
        conversation = row.conversation
        conversation.turns += 1
        text = self.chat.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text)
        row.answer = text
        message = {"role": "assistant", "content": content if calls else text}
        if calls:
            message["tool_calls"] = [call.as_message_call() for call in calls]
        conversation.messages.append(message)
        row.ended_with_eos = sampled.ended_with_eos
        if not calls or not sampled.ended_with_eos or last:
            return False
        results = [self.runner.call(call, row.tools) for call in calls]
        conversation.tool_calls += len(results)
        conversation.tool_failures += sum(result.failed for result in results)
        conversation.messages += [result.as_message() for result in results]
        tool_turn = self.chat.tool_turn_ids(calls, [result.as_message() for result in results], self.schemas)
        if len(row.completion_ids) + len(tool_turn) >= self.max_tokens:
            row.ended_with_eos = False  # no room left to answer: the row hit the budget
            return False
        row.add(tool_turn, [0.0] * len(tool_turn), environment=True)
        return True

    def _score(self, row: _Row) -> None:
        """The environment's ``get_reward()`` of a finished row, under the tool timeout."""
        environments, conversation = self.environments, row.conversation
        if environments is None or not environments.has_reward:
            return
        conversation.reward_source = environments.name
        if conversation.failure is not None:
            conversation.environment_reward_failed = True
            return
        value, error = self.runner.run(f"{environments.name}.get_reward", row.environment.get_reward, {})
        finite = error is None and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value)
        conversation.environment_reward = float(value) if finite else None
        # None: the environment does not score this rollout (as a reward function's None).
        conversation.environment_reward_failed = not finite and not (error is None and value is None)


def _with_observation(messages: list[dict], observation: str) -> list[dict]:
    """A copy of ``messages`` with ``observation`` appended to the last message (TRL's way)."""
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + observation}]
