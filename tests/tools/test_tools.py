"""Tools: schemas from callables, tool calls parsed from text, execution that turns every
failure into an error message for the model, the calculator, environments."""

import logging
import time

import pytest

from lightning_logra.tools import (
    TOOL_CHATML_TEMPLATE,
    Environments,
    HungToolsError,
    ToolCall,
    ToolChat,
    ToolRunner,
    calculator,
    environment_tools,
    load_tools,
    parse_tool_calls,
    renders_tools,
    tool_schema,
)
from tests.helpers import tools as helpers
from tests.helpers.models import byte_tokenizer
from tests.helpers.tools import GuessEnvironment, add, broken, count_words, hang, listing


def test_schema_comes_from_name_type_hints_and_docstring():
    assert tool_schema(add)["function"] == {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "integer", "description": "the second number"}}},
        "return": {"type": "string"},
    }


def test_a_tool_without_type_hints_or_docstring_is_named_in_the_error():
    def no_hints(x):
        """Does things.

        Args:
            x: a thing
        """

    def no_docstring(x: int) -> str:
        return ""

    with pytest.raises(ValueError, match="tool '.*no_hints' cannot be described to the model: .*type hint"):
        tool_schema(no_hints)
    with pytest.raises(ValueError, match="tool '.*no_docstring' cannot be described"):
        load_tools([no_docstring])


def test_tools_load_from_import_paths_with_distinct_names():
    assert load_tools(["tests.helpers.tools:add", calculator]) == [add, calculator]
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        load_tools([add, "tests.helpers.tools:add"])
    with pytest.raises(AttributeError, match="tool spec 'tests.helpers.tools:missing'"):
        load_tools(["tests.helpers.tools:missing"])


def test_tool_calls_are_parsed_from_text():
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert parse_tool_calls("The answer is 3.") == ("The answer is 3.", [])


@pytest.mark.parametrize("body, error", [
    ("{'name': 'add'}", "not valid JSON"),
    ('["add"]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name" string'),
    ('{"name": "add", "arguments": [1, 2]}', "\"arguments\" of the call to 'add' must be a JSON object"),
    ('{"name": "add", "arguments": {"a": 1', "not valid JSON"),  # the turn ended inside the call
])
def test_malformed_tool_calls_are_kept_with_their_error(body, error):
    closing = "" if body.endswith("1") else "</tool_call>"
    _, [call] = parse_tool_calls(f"<tool_call>{body}{closing}")
    assert error in call.error


@pytest.fixture
def runner():
    return ToolRunner(timeout_s=0.5, max_hung_calls=1)


TOOLS = {tool.__name__: tool for tool in (add, broken, count_words, listing, hang)}


def test_a_tool_call_returns_the_tools_string(runner):
    result = runner.call(ToolCall("add", {"a": 2, "b": 3}), TOOLS)
    assert (result.content, result.failed) == ("5", False)
    assert result.as_message() == {"role": "tool", "name": "add", "content": "5"}


def test_numbers_are_written_as_strings(runner):
    result = runner.call(ToolCall("count_words", {"text": "one two three"}), TOOLS)
    assert (result.content, result.failed) == ("3", False)


@pytest.mark.parametrize("call, message", [
    (ToolCall("nope", {}), "Error: there is no tool named 'nope' (tools: add, broken, count_words, hang, listing)"),
    (ToolCall("add", {"a": 1}), "Error: bad arguments for tool 'add': missing required argument 'b'"),
    (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "Error: bad arguments for tool 'add': unknown argument 'c' (the tool "
                                                "takes a, b)"),
    (ToolCall("broken", {"x": 4}), "Error: tool 'broken' raised RuntimeError: broken on 4"),
    (ToolCall("listing", {"text": "a b"}), "Error: tool 'listing' returned a list, not a string"),
    (ToolCall(None, {}, "the tool call is not valid JSON"), "Error: the tool call is not valid JSON"),
])
def test_failed_calls_tell_the_model_why(runner, call, message):
    result = runner.call(call, TOOLS)
    assert result.failed and result.content.startswith(message)


def test_a_hanging_tool_times_out_and_too_many_hung_calls_stop_the_run(runner):
    helpers.RELEASE.clear()
    try:
        started = time.perf_counter()
        result = runner.call(ToolCall("hang", {"seconds": 30}), TOOLS)
        assert result.failed and result.content == "Error: tool 'hang' did not return within 0.5 s"
        assert time.perf_counter() - started < 10  # generous: a loaded machine
        with pytest.raises(HungToolsError, match=r"2 tool calls are still running past their 0.5 s timeout "
                                                 r"\(the last: tool 'hang'\)"):
            runner.call(ToolCall("hang", {"seconds": 30}), TOOLS)
    finally:
        helpers.RELEASE.set()


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", "14"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("-2 ** 3", "-8"),
    ("17 // 5", "3"), ("17 % 5", "2"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os')", "only numbers"), ("x + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("2 ** 1000", "exponents are limited"), ("99999999 ** 60", "more than 256 bits"), ("1 +", "not an arithmetic"),
    ("1" * 300, "longer than 200"), ("'a' * 3", "only numbers"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(ValueError, match=error):
        calculator(expression)


def test_environment_methods_are_its_tools():
    environments = Environments(GuessEnvironment)
    assert environments.name == "GuessEnvironment" and environments.has_reward
    assert [schema["function"]["name"] for schema in environments.schemas] == ["guess"]
    first, second = environments.instances(2)
    assert first is not second and environments.instances(1) == [first]
    assert list(environment_tools(first)) == ["guess"]
    runner = ToolRunner(timeout_s=5.0, max_hung_calls=1)
    assert environments.reset(first, {"answer": "4", "prompt": "x"}, runner) == (" Guess my number.", None)
    assert first.guess(4) == "right" and first.get_reward() == 1.0


def test_an_environment_without_reset_is_refused():
    class NoReset:
        pass

    with pytest.raises(TypeError, match="environment_factory: NoReset has no reset"):
        Environments(NoReset)


def test_a_template_that_ignores_tools_falls_back_to_the_chatml_tool_template(tmp_path, caplog):
    tokenizer = byte_tokenizer(tmp_path)  # its ChatML template ignores tools=
    assert not renders_tools(tokenizer)
    with caplog.at_level(logging.INFO):
        chat = ToolChat(tokenizer)
    assert chat.chat_template == TOOL_CHATML_TEMPLATE
    assert "chat template ignores tools: using the built-in ChatML tool template" in caplog.text
    assert ToolChat(tokenizer, chat_template="{{ messages }}").chat_template == "{{ messages }}"
    tokenizer.chat_template = TOOL_CHATML_TEMPLATE  # a template that renders tools is used as it is
    assert renders_tools(tokenizer) and ToolChat(tokenizer).chat_template is None
    tokenizer.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"  # not ChatML-aware
    assert not renders_tools(tokenizer)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    with pytest.raises(ValueError, match="does not render tools and is not ChatML.*multi_turn.chat_template"):
        ToolChat(tokenizer)
