"""Scripted multi-turn generation for tool tests: a model whose ``generate`` writes given
texts (then EOS), one per call, recording the tokens each call was given, or an engine
without a model that does the same; tools and environments for the tests, well-behaved and
not."""

from __future__ import annotations

import sys
import threading
from typing import Literal

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from lightning_logra.rollout.base import Continuation


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


class ScriptedEngine:
    """A rollout engine without a model: its ``k``-th ``continue_tokens`` call writes
    ``turns[k]`` (one text for every row, or one per row), then EOS, each token at log-prob
    -1; ``inputs[k]`` holds the token lists that call was given. Fast enough for turns of
    thousands of tokens. Special tokens' text in a script is written as plain text, as a
    model that writes it would."""

    def __init__(self, tokenizer, turns: list[str | list[str]]) -> None:
        self.tokenizer, self.turns = tokenizer, turns
        self.inputs: list[list[list[int]]] = []

    def continue_tokens(self, token_ids: list[list[int]], max_new_tokens: list[int], *, temperature=None,
                        top_p=None) -> list[Continuation]:
        self.inputs.append([list(ids) for ids in token_ids])
        script = self.turns[len(self.inputs) - 1]
        texts = [script] * len(token_ids) if isinstance(script, str) else script
        continuations = []
        for text, limit in zip(texts, max_new_tokens, strict=True):
            # Text a model writes as ordinary pieces, even "<|im_end|>" (a special token it
            # sampled would be dropped when the turn is decoded).
            ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] \
                + [self.tokenizer.eos_token_id]
            kept = ids[:limit]
            continuations.append(Continuation(kept, [-1.0] * len(kept), ended_with_eos=len(ids) <= limit))
        return continuations


def typed(count: int, ratio: float, flag: bool, text: str, numbers: list[int], table: dict[str, int],
          pair: tuple[int, str], choice: Literal["up", "down"], maybe: int | None = None) -> str:
    """Takes one argument of each JSON type and reports the Python types it was given.

    Args:
        count: an integer
        ratio: a number
        flag: a boolean
        text: a string
        numbers: integers
        table: integers by name
        pair: an integer and a string
        choice: a direction
        maybe: an integer or null
    """
    return " ".join(type(value).__name__ for value in (count, ratio, flag, text, numbers, table, pair, choice, maybe))


def exits(code: int) -> str:
    """Calls sys.exit.

    Args:
        code: the exit status
    """
    sys.exit(code)


class TroubledEnvironment(GuessEnvironment):
    """``GuessEnvironment`` whose ``reset`` misbehaves on the row's ``trouble`` column, or
    else on the one it was made with: "raise" raises, "hang" waits until ``RELEASE`` (at most
    30 s), "exit" calls ``sys.exit(3)``, "number" returns an int, "long" returns
    ``LONG_OBSERVATION``; None resets as ``GuessEnvironment`` does."""

    def __init__(self, trouble: str | None = None) -> None:
        super().__init__()
        self.trouble = trouble

    def reset(self, answer, trouble=None, **row) -> str | int:
        trouble = trouble or self.trouble
        if trouble == "raise":
            raise ValueError(f"cannot set up {answer}")
        if trouble == "hang":
            RELEASE.wait(30)
        if trouble == "exit":
            sys.exit(3)
        if trouble == "number":
            return 7
        observation = super().reset(answer)
        return LONG_OBSERVATION if trouble == "long" else observation


LONG_OBSERVATION = " Guess my number." * 40
