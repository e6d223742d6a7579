"""Run reward functions the way TRL calls them, so that a failing, hanging or malformed one
never stops training.

A reward function is ``fn(completions, **kwargs) -> list[float | None]``, called with
keyword arguments only (as TRL does, so its first parameter must be named
``completions``): ``completions`` (strings, or ``[{"role": "assistant", "content": ...}]``
lists for conversational prompts, see ``format_completions``) and the columns the caller
passes, typically ``prompts``, ``completion_ids``, ``answer`` and the dataset's other
columns, each a list aligned with ``completions``. None means "this function does not
score this sample" (e.g. a math reward on a row of another task): it adds nothing.

``RewardRunner`` calls each function once per batch and waits at most ``timeout_s`` for it.
A plain module-level function runs in a worker process of its own, killed on a timeout and
forked again for the next batch; a lambda, closure, callable object or function defined in
``__main__`` runs in a daemon thread, which a timeout abandons (see ``workers``). ``async
def`` functions run concurrently with each other on one event loop in one more worker
thread, started before the others so that it overlaps them, each under the same timeout.
After ``max_consecutive_timeouts`` timeouts in a row of one function the runner raises: each
one may have left a thread behind.

A function that raises, hangs or does not return a list of exactly one score per
completion (read where it ran, under its timeout) loses the whole batch: all its scores are
None and counted in ``failures``. A single score that is not a number finite in float32
(bools count as 0/1) or None loses only that sample's score, and so does a weighted total
that is not finite in float32. Each kind of failure is reported once, with a
``RewardWarning``; later ones are only counted.
"""

import asyncio
import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_logra.core.validation import MAX_TIMEOUT_S
from lightning_logra.imports import load_object
from lightning_logra.rewards.workers import (
    FLOAT32_MAX,
    Checked,
    ProcessWorker,
    call_in_thread,
    lost,
    read_output,
    runs_in_process,
    timed_out,
)

RewardFunction = Callable[..., Sequence[float | None]]


class RewardWarning(UserWarning):
    """A reward function failed on a batch; its lost scores count as 0. A category of its
    own so that a user can filter these warnings or turn them into errors."""


@dataclass
class RewardScores:
    """The scores of one batch.

    ``total``: per sample, the weighted sum of the functions' scores, None and failed ones
    skipped (0.0 where none is left). ``per_function``: each function's raw, unweighted
    scores by name, None where it did not apply or failed. ``failures``: (function, sample)
    scores lost to a failure. ``unscored``: samples that every function returned None for.
    """

    total: list[float]
    per_function: dict[str, list[float | None]]
    failures: int
    unscored: int
    failed_samples: frozenset[int] = frozenset()
    """The samples that lost at least one score to a failure."""

    def with_source(self, name: str, scores: list[float | None], failed: list[bool]) -> "RewardScores":
        """These scores and one more source's, of weight 1 (an environment's ``get_reward``):
        ``scores`` finite or None, ``failed`` where the source failed on a sample."""
        failed_samples = self.failed_samples | {index for index, lost in enumerate(failed) if lost}
        per_function = {**self.per_function, name: list(scores)}
        total = [t if score is None else t + score for t, score in zip(self.total, scores)]
        unscored = sum(1 for i in range(len(total))
                       if i not in failed_samples and all(values[i] is None for values in per_function.values()))
        return RewardScores(total, per_function, self.failures + sum(failed), unscored, frozenset(failed_samples))


def load_reward(spec: str, model_options: dict | None = None) -> RewardFunction:
    """Import ``"package.module:function"``, or load the learned reward model ``spec`` names
    with ``model_options`` (``SequenceClassifierReward``'s): a folder that exists, or a hub
    id ``org/name`` (no ``:`` either way)."""
    if ":" not in spec and (Path(spec).is_dir() or "/" in spec):
        from lightning_logra.rewards.models import SequenceClassifierReward

        return SequenceClassifierReward(spec, **(model_options or {}))
    if ":" not in spec:
        raise ValueError(f"reward spec {spec!r} must look like 'package.module:function', or name a reward model "
                         "folder that exists or a hub id 'org/name'")
    return load_object(spec, "reward")


class RewardRunner:
    """Weighted sum of reward functions: ``total_i = sum_f weight_f * f(...)[i]`` over the
    functions that scored sample ``i`` (see the module docstring for the calling convention
    and failure isolation).

    ``functions`` holds callables, ``"module:function"`` specs or reward model folders / hub
    ids (loaded with ``model_options``, see ``load_reward``); ``weights`` defaults to 1
    each. Functions are named by their ``__name__`` (``math_reward``, then ``math_reward_2``
    for a second one of that name), the keys of ``RewardScores.per_function``. After
    ``max_consecutive_timeouts`` batches in a row on which one function timed out, the call
    raises ``RuntimeError`` naming it.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunction | str],
        weights: Sequence[float] | None = None,
        timeout_s: float = 10.0,
        max_consecutive_timeouts: int = 3,
        model_options: dict | None = None,
    ) -> None:
        if not functions:
            raise ValueError("RewardRunner needs at least one reward function")
        self.functions = [load_reward(f, model_options) if isinstance(f, str) else f for f in functions]
        self.names = _unique_names(self.functions)
        self.weights = _checked_weights(weights, len(self.functions))
        if not 0 < timeout_s <= MAX_TIMEOUT_S:  # past it threading's waits raise OverflowError
            raise ValueError(f"timeout_s must be > 0 and <= {MAX_TIMEOUT_S:g} (24 h), got {timeout_s}")
        if isinstance(max_consecutive_timeouts, bool) or not isinstance(max_consecutive_timeouts, int) \
                or max_consecutive_timeouts < 1:
            raise ValueError(f"max_consecutive_timeouts must be an integer >= 1, got {max_consecutive_timeouts!r}")
        self.timeout_s = timeout_s
        self.max_consecutive_timeouts = max_consecutive_timeouts
        self._workers = {name: ProcessWorker(name, f) for name, f in zip(self.names, self.functions)
                         if runs_in_process(f)}
        self._timeouts_in_a_row = dict.fromkeys(self.names, 0)
        self._reported: set[tuple[str, str]] = set()

    def __call__(self, completions: list, **columns: list) -> RewardScores:
        """Score a batch: ``columns`` (``prompts``, ``completion_ids``, ``answer``, ...) are
        passed to every function as keyword arguments, each a list of ``len(completions)``."""
        _check_columns(columns, len(completions))
        results = self._run(completions, columns)
        checked = {name: results[name] for name in self.names}
        for name, result in checked.items():
            if result.failed:
                self._report((name, result.kind), f"reward function {name!r} {result.problem}", len(result.failed),
                             len(completions))
        self._count_timeouts(checked)
        scores, overflowed = _combine(checked, self.weights, len(completions))
        if overflowed:
            index, total = overflowed[0]
            problem = (f"the weighted sum of the reward functions gave sample {index} the total {total!r}, "
                       f"not finite in float32 (|x| <= {FLOAT32_MAX:.4g})")
            self._report(("", "total"), problem, len(overflowed), len(completions))
        return scores

    def start(self) -> None:
        """Start the worker processes now (the first call does otherwise): the first start in
        a process also starts the server they fork from, which imports this package."""
        for worker in self._workers.values():
            worker.start()

    def close(self) -> None:
        """Stop the worker processes (a later call starts them again)."""
        for worker in self._workers.values():
            worker.stop()

    def _run(self, completions: list, columns: dict) -> dict[str, Checked]:
        """Every function's scores: the worker processes get the batch first, then the async
        functions' loop thread starts, then the thread functions run one after another, each
        in its own thread; each worker process's deadline is timeout_s after its batch was sent."""
        size = len(completions)
        results: dict[str, Checked] = {}
        deadlines: dict[str, float] = {}
        for name, worker in self._workers.items():
            refused = worker.submit(completions, columns)
            if refused is None:
                deadlines[name] = time.monotonic() + self.timeout_s
            else:
                results[name] = refused
        jobs = [(name, f) for name, f in zip(self.names, self.functions) if name not in self._workers]
        coroutines = [(name, f) for name, f in jobs if _is_async(f)]
        loop = _AsyncBatch(coroutines, completions, columns, self.timeout_s) if coroutines else None
        for name, function in jobs:
            if not _is_async(function):
                results[name] = call_in_thread(name, function, completions, columns, self.timeout_s)
        for name, deadline in deadlines.items():
            results[name] = self._workers[name].collect(size, deadline, self.timeout_s)
        if loop is not None:
            results.update(loop.collect(size))
        return results

    def _count_timeouts(self, checked: dict[str, Checked]) -> None:
        for name, result in checked.items():
            self._timeouts_in_a_row[name] = self._timeouts_in_a_row[name] + 1 if result.kind == "timeout" else 0
            if self._timeouts_in_a_row[name] >= self.max_consecutive_timeouts:
                raise RuntimeError(
                    f"reward function {name!r} did not return within timeout_s={self.timeout_s} s on "
                    f"{self._timeouts_in_a_row[name]} batches in a row (max_consecutive_timeouts="
                    f"{self.max_consecutive_timeouts}); run in a thread or an event loop, a hung function is "
                    "left behind each time: fix or speed up the function, or raise the timeout")

    def _report(self, key: tuple[str, str], problem: str, failed: int, size: int) -> None:
        """Warn about the first failure of each (function, kind) key; later ones are only counted."""
        if key in self._reported:
            return
        self._reported.add(key)
        share = "its" if failed == size else f"{failed} of its"
        warnings.warn(f"{problem}; {share} {size} scores count as 0", RewardWarning, stacklevel=3)


class _AsyncBatch:
    """The async functions of one call, run concurrently (``asyncio.gather``) on one event
    loop in a daemon thread, each output read there. ``collect`` waits until ``timeout_s``
    after the start at most: a coroutine that blocks its loop (e.g. calls ``time.sleep``)
    cannot be cancelled, so whichever has not finished by then counts as hung."""

    def __init__(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        self.names = [name for name, _ in jobs]
        self.results: dict[str, Checked] = {}
        self.done = threading.Event()
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        thread = threading.Thread(
            target=self._run, args=(jobs, completions, columns, timeout_s), name="reward:async", daemon=True
        )
        thread.start()

    def collect(self, size: int) -> dict[str, Checked]:
        self.done.wait(max(0.0, self.deadline - time.monotonic()))
        finished = dict(self.results)  # a copy: abandoned coroutines may still write
        return {name: finished.get(name) or timed_out(size, self.timeout_s) for name in self.names}

    def _run(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        try:
            asyncio.run(self._gather(jobs, completions, columns, timeout_s))
        finally:
            self.done.set()

    async def _gather(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        await asyncio.gather(*(self._await(name, f, completions, columns, timeout_s) for name, f in jobs))

    async def _await(self, name: str, function, completions: list, columns: dict, timeout_s: float) -> None:
        """Record the function's scores, unless it hangs: then it is cancelled, unrecorded.
        (``asyncio.wait`` rather than ``wait_for``, so that a TimeoutError the function
        raises itself is reported as raised, not as a hang.)"""
        size = len(completions)
        try:
            task = asyncio.ensure_future(function(completions=completions, **columns))
        except Exception as error:  # e.g. a TypeError from its signature
            self.results[name] = lost(size, f"raised {type(error).__name__}", f"raised {type(error).__name__}: {error}")
            return
        finished, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not finished:
            task.cancel()
            return
        error = task.exception()
        if error is not None:
            self.results[name] = lost(size, f"raised {type(error).__name__}", f"raised {type(error).__name__}: {error}")
        else:
            self.results[name] = read_output(task.result(), size)


def _combine(checked: dict[str, Checked], weights: list[float], size: int) -> tuple[RewardScores, list]:
    """The scores, and the ``(sample, total)`` pairs whose weighted total is not finite in
    float32: those totals become 0 and count as failures."""
    per_function = {name: result.scores for name, result in checked.items()}
    total = [
        sum(weight * scores[i] for weight, scores in zip(weights, per_function.values()) if scores[i] is not None)
        for i in range(size)
    ]
    overflowed = [(i, t) for i, t in enumerate(total) if not (math.isfinite(t) and abs(t) <= FLOAT32_MAX)]
    for index, _ in overflowed:
        total[index] = 0.0
    failed = {index for result in checked.values() for index in result.failed} | {i for i, _ in overflowed}
    unscored = sum(
        1 for i in range(size) if i not in failed and all(scores[i] is None for scores in per_function.values())
    )
    failures = sum(len(result.failed) for result in checked.values()) + len(overflowed)
    return RewardScores([float(t) for t in total], per_function, failures, unscored, frozenset(failed)), overflowed


def _check_columns(columns: dict, size: int) -> None:
    for key, values in columns.items():
        if not isinstance(values, (list, tuple)):
            kind = type(values).__name__
            raise TypeError(f"reward column {key!r} must be a list aligned with completions, got {kind}")
        if len(values) != size:
            raise ValueError(f"reward column {key!r} has {len(values)} values for {size} completions")


def _checked_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    if weights is None:
        return [1.0] * count
    weights = [float(w) for w in weights]
    if len(weights) != count:
        raise ValueError(f"got {len(weights)} weights for {count} reward functions")
    for index, weight in enumerate(weights):
        if not math.isfinite(weight):
            raise ValueError(f"reward_weights[{index}] must be finite, got {weight}")
    return weights


def _unique_names(functions: list) -> list[str]:
    names: list[str] = []
    for function in functions:
        base = _function_name(function)
        name, copy = base, 1
        while name in names:
            copy += 1
            name = f"{base}_{copy}"
        names.append(name)
    return names


def _function_name(function) -> str:
    """``__name__``, else that of a ``functools.partial``'s function, else the class name."""
    name = getattr(function, "__name__", None) or getattr(getattr(function, "func", None), "__name__", None)
    return name or type(function).__name__


def _is_async(function) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))
