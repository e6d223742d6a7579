"""TRL's ``environment_factory``: a callable returning an object whose public methods (other
than ``reset`` and ``get_reward``) are tools, one instance per rollout.

``reset(**row)`` receives the dataset row's columns before the rollout starts, under the
tool timeout; a string it returns is appended to the prompt's last user message. A reset that
raises, runs past the timeout or returns anything but a string or None fails that rollout
only. ``get_reward()``, when the class defines it, scores the finished rollout from the
environment's state: one more reward source (weight 1, logged as
``reward/<class name>/mean``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from lightning_logra.tools.execution import ToolRunner
from lightning_logra.tools.schema import tool_schema

RESERVED = ("reset", "get_reward")


def environment_tools(environment: object) -> dict[str, Callable]:
    """The environment's tools by name: its public methods other than ``reset``/``get_reward``."""
    return {name: getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")}


class Environments:
    """Instances of one environment class, made by ``factory`` and reused across batches
    (``instances(count)`` gives ``count`` of them, each reset per rollout)."""

    def __init__(self, factory: Callable[[], object]) -> None:
        self.factory = factory
        probe = factory()
        self.name = type(probe).__name__
        if not callable(getattr(probe, "reset", None)):
            raise TypeError(f"environment_factory: {self.name} has no reset(**row) method")
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.schemas = [tool_schema(tool) for tool in environment_tools(probe).values()]
        self._pool = [probe]

    def instances(self, count: int) -> list[object]:
        while len(self._pool) < count:
            self._pool.append(self.factory())
        return self._pool[:count]

    def reset(self, environment: object, row: dict, runner: ToolRunner) -> tuple[str | None, str | None]:
        """``environment.reset(**row)`` as ``runner`` runs tools: ``(observation, None)``, or
        ``(None, why it failed)``."""
        observation, error = runner.run(f"{self.name}.reset", environment.reset, row)
        if error is None and observation is not None and not isinstance(observation, str):
            error = (f"{self.name}.reset returned a value of type {type(observation).__name__}; it must return a "
                     "string (appended to the prompt) or None")
        return (None, error) if error is not None else (observation, None)
