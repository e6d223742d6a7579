"""Completions in TRL's two formats, so reward functions written for TRL run unchanged.

A standard (string) prompt's completion is a plain string; a conversational prompt's (a
list of ``{"role", "content"}`` messages) is a list holding one assistant message.
"""

from collections.abc import Sequence


def format_completions(prompts: Sequence, texts: Sequence[str]) -> list:
    """The completions a reward function receives: per row, ``[{"role": "assistant",
    "content": text}]`` where that row's prompt is a list of messages, else ``text``."""
    if len(prompts) != len(texts):
        raise ValueError(f"format_completions: got {len(prompts)} prompts but {len(texts)} completion texts")
    return [
        [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
        for prompt, text in zip(prompts, texts)
    ]


def completion_text(completion) -> str:
    """The text of one completion in either format (a conversational one's last message),
    so that a reward function can accept both."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion:
        last = completion[-1]
        if isinstance(last, dict) and isinstance(last.get("content"), str):
            return last["content"]
    raise TypeError(
        f"a completion must be a str or a list of {{'role', 'content'}} messages, got {type(completion).__name__}"
    )
