"""Tools as the chat template sees them: a callable's JSON schema, from its name, type hints
and Google-style docstring (``transformers.utils.get_json_schema``, what
``apply_chat_template(tools=...)`` uses), and the check of a call's arguments against it.

The check covers what ``get_json_schema`` writes: ``type`` (one or a list), ``nullable``,
``enum``, ``items`` (``list[T]``), ``prefixItems`` (``tuple[...]``, of exactly that length) and
``additionalProperties`` (``dict[str, T]``). JSON's types are Python's as ``json.loads`` makes
them: an integer is also a number, a boolean is neither."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import get_json_schema

from lightning_logra.imports import load_object


def load_tools(tools: Sequence[Callable | str]) -> list[Callable]:
    """Callables, or import paths ``"module:function"`` of them, checked for schemas and
    distinct names."""
    loaded = [load_object(tool, "tool") if isinstance(tool, str) else tool for tool in tools]
    named: dict[str, Callable] = {}
    for tool in loaded:
        name = tool_schema(tool)["function"]["name"]
        if name in named:
            raise ValueError(f"two tools are named {name!r}: tool names must be distinct")
        named[name] = tool
    return loaded


def tool_schema(tool: Callable) -> dict:
    """``{"type": "function", "function": {"name", "description", "parameters"}}``; an error
    names the tool whose type hints or docstring cannot describe it."""
    name = getattr(tool, "__qualname__", None) or getattr(tool, "__name__", None) or repr(tool)
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers raises its own parsing exceptions, and TypeError/ValueError
        raise ValueError(
            f"tool {name!r} cannot be described to the model: {error}. A tool needs a type hint on every argument "
            "and a Google-style docstring with a description and an 'Args:' section naming each argument"
        ) from error


# The Python types json.loads makes for each JSON type, and the type's name in errors.
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}
_ARTICLES = {"integer": "an", "array": "an", "object": "an"}


def argument_problem(parameters: dict, arguments: dict) -> str | None:
    """What is wrong with ``arguments`` for a tool whose schema's ``parameters`` are these,
    naming the argument (an unknown one, a missing one, or one of the wrong type); None when
    nothing is."""
    properties = parameters.get("properties", {})
    for name in arguments:
        if name not in properties:
            return f"unknown argument {name!r} (the tool takes {', '.join(properties) or 'none'})"
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"missing required argument {name!r}"
    for name, value in arguments.items():
        problem = _value_problem(properties[name], value, name)
        if problem is not None:
            return problem
    return None


def _value_problem(schema: dict, value: Any, path: str) -> str | None:
    """What is wrong with ``value`` for ``schema``; ``path`` names it (``numbers[1]``)."""
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    if schema.get("nullable"):
        types.append("null")
    if types and not any(_is_json_type(value, kind) for kind in types):
        wanted = " or ".join(f"{_ARTICLES.get(kind, 'a')} {kind}" if kind != "null" else kind for kind in types)
        return f"argument '{path}' must be {wanted}, not {_json_type_name(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"argument '{path}' must be one of {', '.join(map(repr, schema['enum']))}, not {value!r}"
    if isinstance(value, list):
        if "prefixItems" in schema:
            if len(value) != len(schema["prefixItems"]):
                return f"argument '{path}' must have {len(schema['prefixItems'])} items, not {len(value)}"
            items = zip(schema["prefixItems"], value)
        else:
            items = ((schema.get("items", {}), item) for item in value)
        for index, (item_schema, item) in enumerate(items):
            if (problem := _value_problem(item_schema, item, f"{path}[{index}]")) is not None:
                return problem
    if isinstance(value, dict) and "additionalProperties" in schema:
        for key, item in value.items():
            if (problem := _value_problem(schema["additionalProperties"], item, f"{path}[{key!r}]")) is not None:
                return problem
    return None


def _is_json_type(value: Any, kind: str) -> bool:
    return isinstance(value, _JSON_TYPES.get(kind, object)) and (kind == "boolean" or not isinstance(value, bool))


def _json_type_name(value: Any) -> str:
    """``value``'s JSON type with its article (a float is "a number", None "null")."""
    for kind in ("boolean", "integer", "number", "string", "array", "object"):
        if _is_json_type(value, kind):
            return f"{_ARTICLES.get(kind, 'a')} {kind}"
    return "null"
