"""Run user reward functions safely: a failing, hanging or malformed one never stops training.

A reward function has the signature ``fn(completions: list[str], answers: list[str]) ->
list[float]`` (like ``math_reward``). ``RewardRunner`` calls it one sample at a time in a
daemon worker thread, so that an exception, a timeout or a bad value costs only that
sample: it scores 0 and is counted as a failure. A thread cannot be killed; one that
hangs is abandoned (daemon threads never block interpreter exit) and a fresh worker takes
the remaining samples, so each hang costs at most ``timeout_s``.
"""

import importlib
import math
import queue
import threading
from collections.abc import Callable, Sequence

RewardFunction = Callable[[list[str], list[str]], list[float]]


def load_reward(spec: str) -> RewardFunction:
    """Import ``"package.module:function"``."""
    module_name, separator, attribute = spec.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"reward spec {spec!r}: cannot import module {module_name!r}: {error}") from error
    function = getattr(module, attribute, None)
    if function is None:
        raise AttributeError(f"reward spec {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise TypeError(f"reward spec {spec!r}: {attribute!r} is not callable")
    return function


class RewardRunner:
    """Weighted sum of reward functions: ``reward_i = sum_f weight_f * f(completion_i, answer_i)``.

    ``functions`` holds callables or ``"module:function"`` specs; ``weights`` defaults to 1
    each. Calling returns ``(rewards, failures)`` where ``failures`` counts (function,
    sample) evaluations that raised, exceeded ``timeout_s``, or did not return exactly one
    finite number.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunction | str],
        weights: Sequence[float] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if not functions:
            raise ValueError("RewardRunner needs at least one reward function")
        self.functions = [load_reward(f) if isinstance(f, str) else f for f in functions]
        self.weights = [1.0] * len(self.functions) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.functions):
            raise ValueError(f"got {len(self.weights)} weights for {len(self.functions)} reward functions")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s

    def __call__(self, completions: list[str], answers: list) -> tuple[list[float], int]:
        if len(completions) != len(answers):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers")
        answers = [str(a) for a in answers]
        rewards = [0.0] * len(completions)
        failures = 0
        for function, weight in zip(self.functions, self.weights):
            scores = self._score(function, completions, answers)
            for index, score in enumerate(scores):
                if score is None:
                    failures += 1
                else:
                    rewards[index] += weight * score
        return rewards, failures

    def _score(self, function: RewardFunction, completions: list[str], answers: list[str]) -> list[float | None]:
        """One score per sample, None where the evaluation failed."""
        scores: list[float | None] = []
        while len(scores) < len(completions):
            # A fresh worker (and queue, so a hung worker's late results are ignored)
            # takes the samples from the first unscored one on.
            results: queue.Queue = queue.Queue()
            start = len(scores)
            worker = threading.Thread(
                target=_evaluate_each, args=(function, completions[start:], answers[start:], results), daemon=True
            )
            worker.start()
            while len(scores) < len(completions):
                try:
                    scores.append(results.get(timeout=self.timeout_s))
                except queue.Empty:
                    scores.append(None)  # this sample hung: abandon the worker
                    break
        return scores


def _evaluate_each(function: RewardFunction, completions, answers, results: queue.Queue) -> None:
    for completion, answer in zip(completions, answers):
        try:
            output = function([completion], [answer])
            results.put(_single_finite_value(output))
        except Exception:  # any failure of user code scores 0 and is counted
            results.put(None)


def _single_finite_value(output) -> float | None:
    values = list(output)  # lists, tuples, arrays and tensors alike
    if len(values) != 1:
        return None
    value = float(values[0])
    return value if math.isfinite(value) else None
