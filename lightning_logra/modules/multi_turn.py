"""``GRPOModule``'s tools and environments: the multi-turn rollouts they make, and the
prompts those start from (the data module's chat messages, rendered anew with the tools)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_logra.imports import load_object
from lightning_logra.rl.config import MultiTurnConfig
from lightning_logra.rollout.multiturn import MultiTurnRollouts
from lightning_logra.tools.environments import Environments
from lightning_logra.tools.execution import ToolRunner
from lightning_logra.tools.schema import load_tools
from lightning_logra.tools.template import ToolChat


def build_multi_turn(tools: Sequence[Callable | str] | None, environment_factory: Callable | str | None,
                     config: MultiTurnConfig, max_tokens: int, tokenizer,
                     max_positions: int | None = None) -> MultiTurnRollouts | None:
    """Multi-turn rollouts when there are ``tools`` or an ``environment_factory`` (callables
    or import paths), else None. ``max_positions``: the model's, which a prompt with its
    environment's observation must leave ``max_tokens`` of."""
    if not tools and environment_factory is None:
        return None
    if isinstance(environment_factory, str):
        environment_factory = load_object(environment_factory, "environment_factory")
    return MultiTurnRollouts(
        ToolChat(tokenizer, config.chat_template), ToolRunner(config.tool_timeout_s, config.max_hung_tool_calls),
        tools=load_tools(tools or []),
        environments=None if environment_factory is None else Environments(environment_factory),
        max_turns=config.max_turns, max_tokens=max_tokens, max_positions=max_positions,
    )


def prompt_conversations(batch: dict[str, list], datamodule) -> tuple[list[list[dict]], list[dict]]:
    """Each prompt of ``batch`` as chat messages (a ``PromptDataModule``'s, with its
    instruction and system prompt; else the ``prompt`` column as is) and its dataset row
    (every column but the rendered ``prompt_text``), which ``reset(**row)`` receives."""
    prompts = batch["prompt"]
    rows = [{key: values[index] for key, values in batch.items() if key != "prompt_text"} for index in range(len(prompts))]
    render = getattr(datamodule, "prompt_messages", None)
    if render is not None:
        return [render(row) for row in rows], rows
    return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts], rows
