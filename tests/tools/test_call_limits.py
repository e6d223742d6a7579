"""The limits on what a model-written tool call may be: its size, its nesting and its
arguments' types. Every call past them becomes an ``Error:`` result; none raises."""

import json

import pytest

from lightning_logra.tools import ToolCall, ToolChat, ToolRunner, parse_tool_calls
from lightning_logra.tools.calls import MAX_CALL_CHARS, MAX_NESTING
from tests.helpers.models import byte_tokenizer
from tests.helpers.tools import exits, typed


def read_one(body: str) -> ToolCall:
    _, [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    return call


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def test_the_limits_are_16_kib_and_32_levels():
    assert (MAX_CALL_CHARS, MAX_NESTING) == (16_384, 32)


@pytest.mark.parametrize("body", [
    "[" * 1_000,  # json.loads raised RecursionError
    nested(1_000),
    '{"name": "add", "arguments": {"a": ' + nested(600) + "}}",  # parsed, then broke the chat template
    '{"name": "add", "arguments": "' + "[" * 1_000 + '"}',  # the arguments as a JSON string, read a second time
])
def test_a_call_nested_past_the_limit_is_an_error(body):
    assert f"nests deeper than {MAX_NESTING} levels" in read_one(body).error


def test_a_call_nested_to_the_limit_is_read_and_rendered(tmp_path):
    body = '{"name": "add", "arguments": {"a": ' + nested(MAX_NESTING - 2) + "}}"
    call = read_one(body)
    assert call.error is None and json.dumps(call.arguments["a"]) == nested(MAX_NESTING - 2)
    chat = ToolChat(byte_tokenizer(tmp_path))
    rendered = chat.render([{"role": "user", "content": "."},
                            {"role": "assistant", "content": "", "tool_calls": [call.as_message_call()]}],
                           [], add_generation_prompt=False)
    assert nested(MAX_NESTING - 2) in rendered.replace(" ", "")
    assert "nests deeper" in read_one(body.replace(nested(MAX_NESTING - 2), nested(MAX_NESTING - 1))).error


def test_brackets_inside_strings_do_not_count_as_nesting():
    call = read_one('{"name": "echo", "arguments": {"text": "' + "[{" * 500 + '\\"]"}}')
    assert call.error is None and call.arguments["text"] == "[{" * 500 + '"]'


def test_an_integer_too_long_to_read_is_an_error():
    call = read_one('{"name": "add", "arguments": {"a": ' + "7" * 4_301 + ', "b": 1}}')  # json.loads raised ValueError
    assert call.error.startswith("the tool call cannot be read: ") and "4300 digits" in call.error


def test_a_call_longer_than_the_limit_is_an_error():
    padding = MAX_CALL_CHARS - len('{"name": "echo", "arguments": {"text": ""}}')
    fits = '{"name": "echo", "arguments": {"text": "' + "x" * padding + '"}}'
    assert len(fits) == MAX_CALL_CHARS and read_one(fits).error is None
    error = read_one(fits.replace('"x', '"xx')).error
    assert error == f"the tool call has {MAX_CALL_CHARS + 1:,} characters, more than the {MAX_CALL_CHARS:,} a call may have"


@pytest.fixture
def runner():
    return ToolRunner(timeout_s=1.0, max_hung_calls=1)


GOOD = {"count": 3, "ratio": 0.5, "flag": True, "text": "hi", "numbers": [1, 2], "table": {"k": 1}, "pair": [1, "a"],
        "choice": "up"}


def test_arguments_of_the_hinted_types_reach_the_tool(runner):
    result = runner.call(ToolCall("typed", GOOD), {"typed": typed})
    assert (result.content, result.failed) == ("int float bool str list dict list str NoneType", False)
    result = runner.call(ToolCall("typed", {**GOOD, "ratio": 2, "maybe": None}), {"typed": typed})
    assert result.content.startswith("int int ")  # an integer is a JSON number


@pytest.mark.parametrize("change, problem", [
    ({"count": "9" * 200_000}, "argument 'count' must be an integer, not a string"),
    ({"count": True}, "argument 'count' must be an integer, not a boolean"),
    ({"count": 2.0}, "argument 'count' must be an integer, not a number"),
    ({"ratio": False}, "argument 'ratio' must be a number, not a boolean"),
    ({"flag": 1}, "argument 'flag' must be a boolean, not an integer"),
    ({"text": ["hi"]}, "argument 'text' must be a string, not an array"),
    ({"numbers": [1, "2"]}, "argument 'numbers[1]' must be an integer, not a string"),
    ({"numbers": {"0": 1}}, "argument 'numbers' must be an array, not an object"),
    ({"table": {"k": 1.5}}, "argument 'table['k']' must be an integer, not a number"),
    ({"pair": [1]}, "argument 'pair' must have 2 items, not 1"),
    ({"pair": [1, 2]}, "argument 'pair[1]' must be a string, not an integer"),
    ({"choice": "left"}, "argument 'choice' must be one of 'up', 'down', not 'left'"),
    ({"maybe": "none"}, "argument 'maybe' must be an integer or null, not a string"),
    ({"extra": 1}, "unknown argument 'extra' (the tool takes count, ratio, flag, text, numbers, table, pair, "
                   "choice, maybe)"),
])
def test_arguments_that_do_not_match_the_hints_are_errors_naming_the_argument(runner, change, problem):
    arguments = {**GOOD, **change}
    result = runner.call(ToolCall("typed", arguments), {"typed": typed})
    assert result.failed and result.content == f"Error: bad arguments for tool 'typed': {problem}"


def test_a_tool_that_exits_says_so(runner):
    result = runner.call(ToolCall("exits", {"code": 3}), {"exits": exits})
    assert result.failed and result.content == "Error: tool 'exits' raised SystemExit: 3"
