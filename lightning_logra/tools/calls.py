"""Tool calls in a completion's text, in the Hermes / Qwen2.5 format every template this
package renders tools with asks for: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Only ``json.loads`` reads what the model wrote; a call that is not such an object is kept as
a malformed call, whose error becomes its result (the model sees what was wrong). So is a call
past the limits, checked before it is parsed: ``MAX_CALL_CHARS`` characters between the tags
and ``MAX_NESTING`` levels of ``[]``/``{}`` (the call object counts as one; JSON's own parser
recurses once a level, and rendering the call again in a chat template does too)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# A call whose closing tag never came (the turn ended inside it) is still a (malformed) call.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
MAX_CALL_CHARS = 16_384
MAX_NESTING = 32
# A JSON string (brackets inside it are text), and the brackets that nest.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


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
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, {}, f"the tool call has {len(body):,} characters, more than the {MAX_CALL_CHARS:,} a "
                                  "call may have")
    value, error = _load_json(body, "the tool call")
    if error is not None:
        return ToolCall(None, {}, error)
    if not isinstance(value, dict):
        return ToolCall(None, {}, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, 'the tool call has no "name" string')
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        arguments, error = _load_json(arguments, f'the "arguments" string of the call to {name!r}')
        if error is not None:
            return ToolCall(name, {}, error)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'the "arguments" of the call to {name!r} must be a JSON object')
    return ToolCall(name, arguments)


def _load_json(text: str, what: str) -> tuple[Any, str | None]:
    """``(value, None)``, or ``(None, why text cannot be read)``: nested past ``MAX_NESTING``,
    not JSON, or a number Python will not read (an integer of more than 4,300 digits).
    ``what`` names the text in the error."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_JSON_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        return None, f"{what} nests deeper than {MAX_NESTING} levels"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        return None, f"{what} is not valid JSON ({error.msg} at character {error.pos})"
    except ValueError as error:
        return None, f"{what} cannot be read: {error}"
