"""Tools as the chat template sees them: a callable's JSON schema, from its name, type hints
and Google-style docstring (``transformers.utils.get_json_schema``, what
``apply_chat_template(tools=...)`` uses)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
