"""Where a reward function runs for ``RewardRunner``, and how its output is read there.

A plain module-level function (``def``, found again by importing its module, as every
``"module:function"`` spec is) runs in a worker process of its own, forked from a
``forkserver`` (the trainer process holds torch threads, which ``fork`` would copy
half-locked). The worker lives from the first batch on; when the function does not answer
within the timeout the worker is killed (even one C-level operation that holds the GIL, such
as ``10**10**10``, ends there) and the next batch forks a fresh one. Anything else (a lambda,
a closure, a function defined in ``__main__`` or a notebook, a callable object with state,
a ``functools.partial``) runs in a daemon thread, which a timeout abandons but cannot stop.

The output is materialised and converted to floats where the function ran, under the same
timeout: a generator that raises or never ends (read up to one score too many), an int too
large for a float or a score outside float32's range is the function's failure, never the
caller's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import math
import multiprocessing
import numbers
import reprlib
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

# The largest float32: a score or total past it would become inf in the float32 rewards tensor.
FLOAT32_MAX = 3.4028234663852886e38
# Seconds a worker process may take to start (fork, import the function's module) before
# the batch counts as failed; not part of timeout_s, which times the call itself.
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Checked:
    """One function's scores on one batch; ``failed`` lists the samples lost to a failure of
    ``kind`` (one warning per kind), described by ``problem``."""

    scores: list[float | None]
    failed: list[int]
    kind: str = ""
    problem: str = ""


def lost(size: int, kind: str, problem: str) -> Checked:
    """A whole batch lost to one failure."""
    return Checked([None] * size, list(range(size)), kind, problem)


def timed_out(size: int, timeout_s: float) -> Checked:
    return lost(size, "timeout", f"did not return within timeout_s={timeout_s} s")


def score_batch(function: Callable, completions: list, columns: dict) -> Checked:
    """Call ``function`` and read its output, in the worker that runs it."""
    size = len(completions)
    try:
        output = function(completions=completions, **columns)
    except BaseException as error:  # noqa: BLE001 - user code: even SystemExit is isolated
        return lost(size, f"raised {type(error).__name__}", f"raised {type(error).__name__}: {error}")
    return read_output(output, size)


def read_output(output: object, size: int) -> Checked:
    """Validate an output: a whole batch is lost to a wrong-shaped output or to an error while
    reading it; a single score to a value that is neither a number finite in float32 nor None."""
    try:
        values = _as_list(output, size)
        if values is None:
            return lost(size, "type", f"returned {type(output).__name__}, expected a list of {size} scores")
        if len(values) != size:
            count = len(values) if hasattr(output, "__len__") else f"more than {size}"
            return lost(size, "length", f"returned {count} scores for {size} completions")
        scores = [_as_score(value) for value in values]
    except BaseException as error:  # noqa: BLE001 - a generator's or a number's own code
        kind = f"raised {type(error).__name__} while its output was read"
        return lost(size, kind, f"{kind}: {error}")
    failed = [index for index, score in enumerate(scores) if score is _BAD]
    if not failed:
        return Checked(scores, [])
    problem = (f"returned {reprlib.repr(values[failed[0]])} for sample {failed[0]} "
               f"(a score must be None or a number finite in float32, |x| <= {FLOAT32_MAX:.4g})")
    return Checked([None if s is _BAD else s for s in scores], failed, "value", problem)


_BAD = object()  # marks a score that is neither a number finite in float32 nor None


def _as_list(output, size: int) -> list | None:
    """The output's elements (a list, tuple, generator, array or tensor), or None if it is
    not iterable. Of an iterator without a length, ``size + 1`` at most: enough to tell that
    it is too long, and an endless generator ends there."""
    if isinstance(output, (str, bytes, dict)):
        return None
    try:
        iterator = iter(output)
    except TypeError:
        return None
    return list(iterator) if hasattr(output, "__len__") else list(itertools.islice(iterator, size + 1))


def _as_score(value):
    if value is None:
        return None
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a NumPy or torch scalar
    if not isinstance(value, numbers.Real):
        return _BAD
    value = float(value)  # an int past float's range raises OverflowError: the batch fails
    return value if math.isfinite(value) and abs(value) <= FLOAT32_MAX else _BAD


def runs_in_process(function: Callable) -> bool:
    """Whether ``function`` is a plain function that a worker process finds again by
    importing its module (so it can be killed on a timeout), rather than a thread's job."""
    if not inspect.isfunction(function) or inspect.iscoroutinefunction(function):
        return False
    module_name, qualname = function.__module__, function.__qualname__
    if not module_name or module_name == "__main__" or "<" in qualname:
        return False
    try:
        found = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError):
        return False
    return found is function


def call_in_thread(name: str, function: Callable, completions: list, columns: dict, timeout_s: float) -> Checked:
    """Run and read ``function`` in a daemon thread; a timeout if it takes over ``timeout_s``
    (the thread is abandoned: it cannot be stopped)."""
    result: list[Checked] = []
    thread = threading.Thread(target=lambda: result.append(score_batch(function, completions, columns)),
                              name=f"reward:{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else timed_out(len(completions), timeout_s)


class ProcessWorker:
    """A worker process for one plain function: ``submit`` sends a batch, ``collect`` waits
    for its scores until a deadline and kills the worker past it (the next ``submit`` starts
    a fresh one). Pickles without its process, which the copy starts when first used."""

    _preload_set = False

    def __init__(self, name: str, function: Callable) -> None:
        self.name = name
        self.reference = (function.__module__, function.__qualname__)
        self._process = None
        self._connection = None

    def __getstate__(self) -> dict:
        return {"name": self.name, "reference": self.reference, "_process": None, "_connection": None}

    def start(self) -> str | None:
        """Start the worker unless it runs; returns why it could not start, or None."""
        if self._process is not None and self._process.is_alive():
            return None
        self.stop()
        context = _forkserver(self.reference[0])
        receiver, sender = context.Pipe(duplex=True)
        process = context.Process(target=_serve, args=(sender, *self.reference), name=f"reward:{self.name}", daemon=True)
        process.start()
        sender.close()
        self._process, self._connection = process, receiver
        weakref.finalize(self, _kill, process)
        try:
            ready = receiver.poll(STARTUP_TIMEOUT_S) and receiver.recv()
        except (EOFError, OSError):
            process.join(timeout=1)
            ready = f"its worker process exited with code {process.exitcode} while starting"
        if ready != "ready":
            self.stop()
            return ready or f"its worker process did not start within {STARTUP_TIMEOUT_S:.0f} s"
        return None

    def submit(self, completions: list, columns: dict) -> Checked | None:
        """Send a batch; a failure if the worker cannot take it, else None (collect the scores)."""
        problem = self.start()
        if problem is None:
            try:
                self._connection.send((completions, columns))
                return None
            except (OSError, ValueError) as error:  # the worker died, or the batch does not pickle
                problem = f"could not be sent the batch: {type(error).__name__}: {error}"
                self.stop()
        return lost(len(completions), "worker", problem)

    def collect(self, size: int, deadline: float, timeout_s: float) -> Checked:
        try:
            if self._connection.poll(max(0.0, deadline - time.monotonic())):
                return self._connection.recv()
        except (EOFError, OSError):
            code = self._process.exitcode if self._process is not None else None
            self.stop()
            return lost(size, "worker", f"lost its worker process (exit code {code})")
        self.stop()  # past the deadline: whatever it computes, it computes no more
        return timed_out(size, timeout_s)

    def stop(self) -> None:
        if self._process is not None:
            _kill(self._process)
            self._connection.close()
        self._process = self._connection = None


def _kill(process) -> None:
    if process.is_alive():
        process.kill()
        process.join(timeout=5)


def _forkserver(module_name: str):
    """The forkserver context; the server, started once per process, preloads the main
    script (multiprocessing's default: a worker would import it again otherwise, so it needs
    the ``if __name__ == "__main__":`` guard), this module and that of the first function,
    so that forking a worker costs milliseconds."""
    context = multiprocessing.get_context("forkserver")
    if not ProcessWorker._preload_set:
        context.set_forkserver_preload(["__main__", __name__, module_name])
        ProcessWorker._preload_set = True
    return context


def _serve(connection, module_name: str, qualname: str) -> None:
    """A worker process: score the batches it is sent until the trainer closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends this worker
    try:
        function = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    except BaseException as error:  # noqa: BLE001 - reported to the trainer as the start's failure
        connection.send(f"its worker process could not import it: {type(error).__name__}: {error}")
        return
    connection.send("ready")
    while True:
        try:
            completions, columns = connection.recv()
        except EOFError:
            return
        connection.send(score_batch(function, completions, columns))
