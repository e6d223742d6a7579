"""Reward for reasoning-gym tasks: each row scored by its own task's ``score_answer``.

Rows from a ``reasoning_gym:<task>`` source carry the ``task`` column and the entry's
``metadata`` (as JSON), which some tasks' scorers read. The answer a scorer sees is the
completion's last ``<answer>...</answer>`` (reasoning-gym's own convention) when it has one,
else its first non-empty line without surrounding whitespace and a final period: the
prompts of our configs ask for the answer alone. A row of another source (no ``task``) is
left unscored (None), as ``math_reward`` leaves rows without an answer.
"""

import functools
import json

from lightning_logra.rewards.completions import completion_text


def reasoning_gym_reward(completions: list, task: list | None = None, answer: list | None = None,
                         metadata: list | None = None, **kwargs) -> list:
    """reasoning-gym's score (0 to 1, as its task defines it) of each completion; TRL's
    reward convention, reading the ``task``, ``answer`` and ``metadata`` columns."""
    if task is None or answer is None:
        raise TypeError("reasoning_gym_reward needs the 'task' and 'answer' columns of a reasoning_gym:<task> source")
    if not len(completions) == len(task) == len(answer):
        raise ValueError(f"got {len(completions)} completions, {len(task)} tasks and {len(answer)} answers")
    metadata = metadata or [None] * len(completions)
    return [
        None if name is None else float(_scorer(name)(final_answer(completion_text(completion)),
                                                      {"answer": reference, "metadata": json.loads(meta or "{}")}))
        for completion, name, reference, meta in zip(completions, task, answer, metadata)
    ]


def final_answer(text: str) -> str:
    """The answer a reasoning-gym scorer is given (see the module docstring)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    if tagged is not None:
        return tagged
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0].removesuffix(".").strip() if lines else ""


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("reasoning_gym_reward needs `pip install reasoning-gym`") from error
    return reasoning_gym.get_score_answer_fn(task)
