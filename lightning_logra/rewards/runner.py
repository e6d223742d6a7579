"""Run reward functions the way TRL calls them, so that a failing, hanging or malformed one
never stops training.

A reward function is ``fn(completions, **kwargs) -> list[float | None]``, called with
keyword arguments only (as TRL does, so its first parameter must be named
``completions``): ``completions`` (strings, or ``[{"role": "assistant", "content": ...}]``
lists for conversational prompts, see ``format_completions``) and the columns the caller
passes, typically ``prompts``, ``completion_ids``, ``answer`` and the dataset's other
columns, each a list aligned with ``completions``. None means "this function does not
score this sample" (e.g. a math reward on a row of another task): it adds nothing.

``RewardRunner`` calls each function once per batch in a daemon worker thread and waits at
most ``timeout_s``. A thread cannot be killed: one that hangs is abandoned (daemon threads
never block interpreter exit), and the next batch gets a fresh one. ``async def``
functions run concurrently with each other on one event loop in one more worker thread,
started before the sync functions so that it overlaps them, each under the same timeout.

A function that raises, hangs or does not return a list of exactly one score per
completion loses the whole batch: all its scores are None and counted in ``failures``. A
single score that is not a finite number (bools count as 0/1) or None loses only that
sample's score. Each kind of failure of a function is reported once, with a
``RewardWarning``; later ones are only counted.
"""

import asyncio
import importlib
import inspect
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass
class _Outcome:
    """What one function's call produced: its output, the exception it raised, or neither
    (it did not finish in time)."""

    output: object = None
    error: BaseException | None = None
    finished: bool = False


@dataclass
class _Checked:
    """One function's scores after validation; ``failed`` lists the samples lost to a failure."""

    scores: list[float | None]
    failed: list[int]
    kind: str = ""
    problem: str = ""


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
    """Weighted sum of reward functions: ``total_i = sum_f weight_f * f(...)[i]`` over the
    functions that scored sample ``i`` (see the module docstring for the calling convention
    and failure isolation).

    ``functions`` holds callables or ``"module:function"`` specs; ``weights`` defaults to 1
    each. Functions are named by their ``__name__`` (``math_reward``, then ``math_reward_2``
    for a second one of that name), the keys of ``RewardScores.per_function``.
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
        self.names = _unique_names(self.functions)
        self.weights = _checked_weights(weights, len(self.functions))
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._reported: set[tuple[str, str]] = set()

    def __call__(self, completions: list, **columns: list) -> RewardScores:
        """Score a batch: ``columns`` (``prompts``, ``completion_ids``, ``answer``, ...) are
        passed to every function as keyword arguments, each a list of ``len(completions)``."""
        _check_columns(columns, len(completions))
        outcomes = self._run(completions, columns)
        checked = {name: _checked(outcomes[name], len(completions), self.timeout_s) for name in self.names}
        for name, result in checked.items():
            if result.failed:
                self._report(name, result, len(completions))
        return _combine(checked, self.weights, len(completions))

    def _run(self, completions: list, columns: dict) -> dict[str, _Outcome]:
        """Every function's outcome: the async ones' loop thread starts first, then the sync
        functions run one after another, each in its own thread."""
        jobs = list(zip(self.names, self.functions))
        coroutines = [(name, f) for name, f in jobs if _is_async(f)]
        loop = _AsyncBatch(coroutines, completions, columns, self.timeout_s) if coroutines else None
        outcomes = {
            name: _call_in_thread(name, lambda f=f: f(completions=completions, **columns), self.timeout_s)
            for name, f in jobs
            if not _is_async(f)
        }
        if loop is not None:
            outcomes.update(loop.collect())
        return outcomes

    def _report(self, name: str, result: _Checked, size: int) -> None:
        if (name, result.kind) in self._reported:
            return
        self._reported.add((name, result.kind))
        lost = "its" if len(result.failed) == size else f"{len(result.failed)} of its"
        message = f"reward function {name!r} {result.problem}; {lost} {size} scores count as 0"
        warnings.warn(message, RewardWarning, stacklevel=3)


class _AsyncBatch:
    """The async functions of one call, run concurrently (``asyncio.gather``) on one event
    loop in a daemon thread. ``collect`` waits until ``timeout_s`` after the start at most:
    a coroutine that blocks its loop (e.g. calls ``time.sleep``) cannot be cancelled, so
    whichever has not finished by then counts as hung."""

    def __init__(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        self.names = [name for name, _ in jobs]
        self.outcomes: dict[str, _Outcome] = {}
        self.done = threading.Event()
        self.deadline = time.monotonic() + timeout_s
        thread = threading.Thread(
            target=self._run, args=(jobs, completions, columns, timeout_s), name="reward:async", daemon=True
        )
        thread.start()

    def collect(self) -> dict[str, _Outcome]:
        self.done.wait(max(0.0, self.deadline - time.monotonic()))
        finished = dict(self.outcomes)  # a copy: abandoned coroutines may still write
        return {name: finished.get(name, _Outcome()) for name in self.names}

    def _run(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        try:
            asyncio.run(self._gather(jobs, completions, columns, timeout_s))
        finally:
            self.done.set()

    async def _gather(self, jobs: list, completions: list, columns: dict, timeout_s: float) -> None:
        await asyncio.gather(*(self._await(name, f, completions, columns, timeout_s) for name, f in jobs))

    async def _await(self, name: str, function, completions: list, columns: dict, timeout_s: float) -> None:
        """Record the function's outcome, unless it hangs: then it is cancelled, unrecorded.
        (``asyncio.wait`` rather than ``wait_for``, so that a TimeoutError the function
        raises itself is reported as raised, not as a hang.)"""
        try:
            task = asyncio.ensure_future(function(completions=completions, **columns))
        except Exception as error:  # e.g. a TypeError from its signature
            self.outcomes[name] = _Outcome(error=error, finished=True)
            return
        finished, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not finished:
            task.cancel()
            return
        error = task.exception()
        self.outcomes[name] = _Outcome(output=None if error else task.result(), error=error, finished=True)


def _call_in_thread(name: str, call: Callable[[], object], timeout_s: float) -> _Outcome:
    """Run ``call`` in a daemon thread; an unfinished outcome if it takes over ``timeout_s``."""
    outcome = _Outcome()
    done = threading.Event()

    def target() -> None:
        try:
            outcome.output = call()
        except BaseException as error:  # noqa: BLE001 - user code: even SystemExit is isolated
            outcome.error = error
        finally:
            done.set()

    threading.Thread(target=target, name=f"reward:{name}", daemon=True).start()
    if not done.wait(timeout_s):
        return _Outcome()  # a fresh one: the abandoned thread may still fill the other
    outcome.finished = True
    return outcome


_BAD = object()  # marks a score that is neither a finite number nor None


def _checked(outcome: _Outcome, size: int, timeout_s: float) -> _Checked:
    """Validate an outcome: a whole batch is lost to an error, a hang or a wrong-shaped
    output; a single score to a value that is neither a finite number nor None."""
    lost = [None] * size, list(range(size))
    if not outcome.finished:
        return _Checked(*lost, "timeout", f"did not return within timeout_s={timeout_s} s")
    if outcome.error is not None:
        kind = f"raised {type(outcome.error).__name__}"
        return _Checked(*lost, kind, f"{kind}: {outcome.error}")
    values = _as_list(outcome.output)
    if values is None:
        return _Checked(*lost, "type", f"returned {type(outcome.output).__name__}, expected a list of {size} scores")
    if len(values) != size:
        return _Checked(*lost, "length", f"returned {len(values)} scores for {size} completions")
    scores = [_as_score(value) for value in values]
    failed = [index for index, score in enumerate(scores) if score is _BAD]
    if not failed:
        return _Checked(scores, [])
    first = values[failed[0]]
    problem = f"returned {first!r} for sample {failed[0]} (a score must be a finite number or None)"
    return _Checked([None if s is _BAD else s for s in scores], failed, "value", problem)


def _as_list(output) -> list | None:
    """The output's elements (a list, tuple, array or tensor), or None if it is not a sequence."""
    if isinstance(output, (str, bytes, dict)):
        return None
    try:
        return list(output)
    except TypeError:
        return None


def _as_score(value):
    if value is None:
        return None
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a NumPy or torch scalar
    if not isinstance(value, numbers.Real):
        return _BAD
    value = float(value)
    return value if math.isfinite(value) else _BAD


def _combine(checked: dict[str, _Checked], weights: list[float], size: int) -> RewardScores:
    per_function = {name: result.scores for name, result in checked.items()}
    total = [
        sum(weight * scores[i] for weight, scores in zip(weights, per_function.values()) if scores[i] is not None)
        for i in range(size)
    ]
    failed = {index for result in checked.values() for index in result.failed}
    unscored = sum(
        1 for i in range(size) if i not in failed and all(scores[i] is None for scores in per_function.values())
    )
    failures = sum(len(result.failed) for result in checked.values())
    return RewardScores([float(t) for t in total], per_function, failures, unscored)


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
