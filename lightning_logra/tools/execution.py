"""Running the model's tool calls: in this process (tools are the user's own code, as in
TRL), each in a daemon thread under a timeout, so that no tool stops a step.

A call that names no tool, passes arguments that do not match the tool's schema (an unknown
or missing name, a JSON type other than the type hint's: ``schema.argument_problem``; the
tool is then not called), raises (``SystemExit`` included), runs past ``timeout_s`` or
returns anything but a string (ints and floats are written with ``str``) fails: the model
receives ``Error: <why>`` as the result and the failure is counted. A thread that runs past
its timeout cannot be stopped; it is left running, and once more than ``max_hung_calls``
such threads are alive the run stops with an error naming the tool, rather than piling up
threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_logra.tools.calls import ToolCall
from lightning_logra.tools.schema import argument_problem, tool_schema


@dataclass(frozen=True)
class ToolResult:
    """What the model is told (``content``) for the call to ``name``; ``failed`` counts it in
    ``tools/failures``."""

    name: str
    content: str
    failed: bool

    def as_message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


class HungToolsError(RuntimeError):
    """Too many tool calls are still running past their timeout."""


class ToolRunner:
    """Calls tools under ``timeout_s`` seconds each, counting the threads left hanging."""

    def __init__(self, timeout_s: float, max_hung_calls: int) -> None:
        self.timeout_s = timeout_s
        self.max_hung_calls = max_hung_calls
        self._hung: list[threading.Thread] = []
        self._schemas: dict[Callable, dict] = {}

    def call(self, call: ToolCall, tools: dict[str, Callable]) -> ToolResult:
        """Run ``call`` with the tool of its name in ``tools``."""
        name = call.name or "unknown"
        if call.error is not None:
            return _failure(name, call.error)
        tool = tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(tools)) or "none"
            return _failure(name, f"there is no tool named {call.name!r} (tools: {available})")
        problem = argument_problem(self._parameters(tool), call.arguments)
        if problem is not None:
            return _failure(name, f"bad arguments for tool {call.name!r}: {problem}")
        value, error = self.run(f"tool {call.name!r}", tool, call.arguments)
        if error is not None:
            return _failure(name, error)
        if isinstance(value, str):
            return ToolResult(name, value, failed=False)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return ToolResult(name, str(value), failed=False)
        return _failure(name, f"tool {call.name!r} returned a {type(value).__name__}, not a string")

    def run(self, what: str, function: Callable, arguments: dict[str, Any]) -> tuple[Any, str | None]:
        """``function(**arguments)`` in a daemon thread: ``(value, None)``, or ``(None, why it
        failed)`` when it raised or timed out. ``what`` names it in errors."""
        self._hung = [thread for thread in self._hung if thread.is_alive()]
        outcome: list[tuple[Any, str | None]] = []

        def target() -> None:
            try:
                outcome.append((function(**arguments), None))
            except BaseException as error:  # the tool's own failure (sys.exit too), reported to the model
                outcome.append((None, f"{what} raised {type(error).__name__}: {error}"))

        thread = threading.Thread(target=target, name=what, daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if outcome:
            return outcome[0]
        self._hung.append(thread)
        if len(self._hung) > self.max_hung_calls:
            raise HungToolsError(
                f"{len(self._hung)} tool calls are still running past their {self.timeout_s:g} s timeout (the last: "
                f"{what}); threads cannot be stopped, so the run stops here: make the tool return (or raise) in time, "
                "or raise multi_turn.tool_timeout_s / multi_turn.max_hung_tool_calls")
        return None, f"{what} did not return within {self.timeout_s:g} s"

    def _parameters(self, tool: Callable) -> dict:
        """The tool's schema ``parameters``, built once per function (an environment's bound
        methods share their class's)."""
        function = getattr(tool, "__func__", tool)
        if function not in self._schemas:
            self._schemas[function] = tool_schema(tool)["function"]["parameters"]
        return self._schemas[function]


def _failure(name: str, why: str) -> ToolResult:
    return ToolResult(name, f"Error: {why}", failed=True)
