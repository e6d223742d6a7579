"""Tables of what the policy wrote: a few samples of a step with their rewards, for the loggers."""

from __future__ import annotations

import json
from typing import Any

from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger

from lightning_logra.rl.sampling import ScoredRollouts


def completion_table(scored: ScoredRollouts, step: int, count: int) -> dict[str, list]:
    """The first ``count`` samples as columns ``step, prompt, completion, answer, reward``,
    one column per reward function (its raw score, None where it did not apply), ``length``
    (generated tokens) and ``truncated`` (hit the token limit); with tools, ``completion``
    is the whole transcript (every turn and tool result) and ``turns``, ``tool_calls`` and
    ``tool_failures`` follow."""
    rollouts, rows = scored.rollouts, range(min(count, scored.rewards.numel()))
    lengths = rollouts.completion_mask.sum(dim=1).tolist()
    answers = scored.columns.get("answer") or [None] * scored.rewards.numel()
    conversations = rollouts.conversations
    completions = rollouts.completion_text if conversations is None else [transcript_text(c.messages)
                                                                          for c in conversations]
    table: dict[str, list] = {
        "step": [step for _ in rows],
        "prompt": [scored.columns["prompt_text"][row] for row in rows],
        "completion": [completions[row] for row in rows],
        "answer": [answers[row] for row in rows],
        "reward": [float(scored.rewards[row]) for row in rows],
    }
    for name, scores in scored.scores.per_function.items():
        table[f"reward/{name}"] = [scores[row] for row in rows]
    table["length"] = [int(lengths[row]) for row in rows]
    table["truncated"] = [not bool(rollouts.ended_with_eos[row]) for row in rows]
    if conversations is not None:
        table["turns"] = [conversations[row].turns for row in rows]
        table["tool_calls"] = [conversations[row].tool_calls for row in rows]
        table["tool_failures"] = [conversations[row].tool_failures for row in rows]
    return table


def transcript_text(messages: list[dict]) -> str:
    """A multi-turn completion as text: each message after a ``[role]`` line, tool calls as
    the JSON the model wrote, tool results with the tool's name."""
    parts = []
    for message in messages:
        role = f"tool {message['name']}" if message["role"] == "tool" else message["role"]
        calls = [json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                 for call in message.get("tool_calls", [])]
        parts.append("\n".join([f"[{role}]", *([message["content"]] if message["content"] else []), *calls]))
    return "\n".join(parts)


def log_completion_table(loggers: list[Logger], table: dict[str, list], step: int, name: str = "completions") -> None:
    """To MLflow as a table artifact (``<name>/step_<step>.json``, shown in its UI's
    evaluation view), to loggers with a ``log_table`` or ``log_text`` method (Weights &
    Biases), and to TensorBoard as a Markdown text; other loggers have no place for it."""
    columns = list(table)
    rows = [list(row) for row in zip(*table.values())]
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_table(logger.run_id, data=table, artifact_file=f"{name}/step_{step:06d}.json")
        elif hasattr(logger, "log_table"):
            logger.log_table(key=name, columns=columns, data=rows, step=step)
        elif hasattr(logger, "log_text"):
            logger.log_text(key=name, columns=columns, data=[[str(v) for v in row] for row in rows], step=step)
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(name, _markdown(columns, rows), global_step=step)


def _markdown(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)
