"""Scripted multi-turn generation for tool tests: a model whose ``generate`` writes given
texts (then EOS), one per call, recording the tokens each call was given; tools and an
environment for the tests."""

from __future__ import annotations

import threading

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class _ForceTokens(LogitsProcessor):
    """Row ``i`` emits ``tokens[i][step]`` (its last one after the end): every other logit -inf."""

    def __init__(self, tokens: list[list[int]], start: int) -> None:
        self.tokens, self.start = tokens, start

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        for row, tokens in enumerate(self.tokens):
            forced[row, tokens[min(step, len(tokens) - 1)]] = 0.0
        return forced


class ScriptedGeneration:
    """Makes ``model.generate`` write ``turns[k]`` in its ``k``-th call (a string for every
    row, or one per row), each followed by EOS; ``inputs[k]`` holds the unpadded token lists
    that call was given. Log-probs stay the model's own (``output_logits`` are raw)."""

    def __init__(self, model, tokenizer, turns: list[str | list[str]]) -> None:
        self.inputs: list[list[list[int]]] = []
        original = model.generate

        def generate(*args, **kwargs):
            input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
            self.inputs.append([ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)])
            script = turns[len(self.inputs) - 1]
            texts = [script] * input_ids.shape[0] if isinstance(script, str) else script
            tokens = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
            kwargs["logits_processor"] = LogitsProcessorList([_ForceTokens(tokens, input_ids.shape[1])])
            return original(*args, **kwargs)

        model.generate = generate


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"broken on {x}")


def count_words(text: str) -> int:
    """Count the words of a text (returns an int: written as a string for the model).

    Args:
        text: the text
    """
    return len(text.split())


def listing(text: str) -> list:
    """Returns a list, which is not a valid tool result.

    Args:
        text: the text
    """
    return text.split()


RELEASE = threading.Event()


def hang(seconds: float) -> str:
    """Waits until released (or ``seconds``).

    Args:
        seconds: the longest wait
    """
    RELEASE.wait(seconds)
    return "done"


class GuessEnvironment:
    """A game: guess the row's ``answer``; ``guess`` is its tool, ``get_reward`` scores
    whether the last guess was right."""

    def __init__(self) -> None:
        self.target = None
        self.last_guess = None

    def reset(self, answer, **row) -> str:
        self.target, self.last_guess = int(answer), None
        return " Guess my number."

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: your guess
        """
        self.last_guess = number
        return "right" if number == self.target else ("higher" if number < self.target else "lower")

    def get_reward(self) -> float:
        return 1.0 if self.last_guess == self.target else 0.0
