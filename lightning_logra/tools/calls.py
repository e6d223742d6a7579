"""Tool calls in a completion's text, in the Hermes / Qwen2.5 format every template this
package renders tools with asks for: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Only ``json.loads`` reads what the model wrote; a call that is not such an object is kept as
a malformed call, whose error becomes its result (the model sees what was wrong)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# A call whose closing tag never came (the turn ended inside it) is still a (malformed) call.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: ``name`` and ``arguments`` as the model wrote them, or ``error`` saying why
    they could not be read (``name`` is then whatever could be read, else None)."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None

    def as_message_call(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments}}


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``text`` without its tool-call blocks (stripped), and the calls in order."""
    calls = [_read_call(match.group(1)) for match in TOOL_CALL.finditer(text)]
    return TOOL_CALL.sub("", text).strip(), calls


def _read_call(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict):
        return ToolCall(None, {}, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, 'the tool call has no "name" string')
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'the "arguments" of the call to {name!r} must be a JSON object')
    return ToolCall(name, arguments)
