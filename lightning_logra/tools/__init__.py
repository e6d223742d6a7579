"""Tools for multi-turn rollouts, in TRL's conventions: schemas from plain callables, tool
calls parsed from completions, executed under a timeout, and a safe calculator."""

from lightning_logra.tools.calculator import calculator
from lightning_logra.tools.calls import ToolCall, parse_tool_calls
from lightning_logra.tools.environments import Environments, environment_tools
from lightning_logra.tools.execution import HungToolsError, ToolResult, ToolRunner
from lightning_logra.tools.schema import load_tools, tool_schema
from lightning_logra.tools.template import TOOL_CHATML_TEMPLATE, ToolChat, renders_tools

__all__ = [
    "TOOL_CHATML_TEMPLATE",
    "Environments",
    "HungToolsError",
    "ToolCall",
    "ToolChat",
    "ToolResult",
    "ToolRunner",
    "calculator",
    "environment_tools",
    "load_tools",
    "parse_tool_calls",
    "renders_tools",
    "tool_schema",
]
