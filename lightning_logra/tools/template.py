"""Rendering conversations with tools, and the tokens a tool turn adds.

The tokenizer's own chat template is used when it renders the tools it is given (detected by
rendering a message with and without one). Otherwise, for a ChatML tokenizer (``<|im_start|>``
/ ``<|im_end|>``, e.g. SmolLM2, whose template ignores ``tools=``), ``TOOL_CHATML_TEMPLATE``:
the tools' JSON schemas in the system message inside ``<tools></tools>``, calls written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and results returned in a user
turn of ``<tool_response>...</tool_response>`` blocks, the layout of Qwen2.5's template.
A template passed as ``chat_template`` overrides both.

Token in, token out: a tool turn's tokens are those of the rendered tool messages plus the
next assistant header, cut from a rendering of a short conversation (so that nothing the
model generated is ever re-tokenised) and appended to the generated tokens as they are.

Plain text: a tool message's ``content`` and ``name`` (text that a model can steer: a tool
echoes its arguments, an error names the tool the model asked for) are tokenised with special
tokens split, so that ``<|im_end|><|im_start|>system`` in a result stays text and cannot open a
turn; only the template's own text is read with its special tokens.
"""

from __future__ import annotations

import re

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_logra.tools.calls import ToolCall

TOOL_CHATML_TEMPLATE = (
    "{% set body = messages[1:] if messages and messages[0].role == 'system' else messages %}"
    "{% set system = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "You have these tools, described by JSON schemas:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To use a tool, write <tool_call>{\"name\": \"<tool name>\", \"arguments\": {<arguments as JSON>}}</tool_call> "
    "and end your turn: the result comes back inside <tool_response></tool_response>. "
    "When you know the answer, give it without a tool call.<|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in body %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or body[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or body[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% else %}{{ '\\n' }}{% endif %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "Probe.",
                                                 "parameters": {"type": "object", "properties": {}}}}


class ToolChat:
    """Renders prompts with tool schemas and tool turns as tokens for ``tokenizer``.

    ``chat_template``: a Jinja chat template to use instead of the tokenizer's (it must render
    ``tools``, assistant ``tool_calls`` and ``tool`` messages)."""

    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        if chat_template is None and not renders_tools(tokenizer):
            if not _is_chatml(tokenizer):
                raise ValueError(
                    "the tokenizer's chat template does not render tools and is not ChatML, the one format with a "
                    "built-in tool template: set multi_turn.chat_template to a template that renders `tools`, "
                    "assistant `tool_calls` and `tool` messages")
            rank_zero_info("The tokenizer's chat template ignores tools: using the built-in ChatML tool template "
                           "(Qwen2.5's <tool_call> layout; multi_turn.chat_template sets another)")
            chat_template = TOOL_CHATML_TEMPLATE
        self.chat_template = chat_template
        self.end_of_turn_id = tokenizer.eos_token_id

    def render(self, messages: list[dict], tools: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=self.chat_template,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, text: str, *, plain: bool = False) -> list[int]:
        """The rendered text's tokens (the template writes any special tokens itself); with
        ``plain``, special tokens' text is split into ordinary tokens."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"]

    def prompt_ids(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def tool_turn_ids(self, calls: list[ToolCall], results: list[dict], tools: list[dict]) -> list[int]:
        """The tokens that follow an assistant turn that ended with ``calls`` (on its
        end-of-turn token): the ``results`` messages as the template renders them, then the
        next assistant header. Cut from a short conversation rendered with and without them."""
        before = [{"role": "user", "content": "."},
                  {"role": "assistant", "content": "", "tool_calls": [call.as_message_call() for call in calls]}]
        prefix = self.encode(self.render(before, tools, add_generation_prompt=False))
        full = [token for piece, plain in self._pieces_with_plain_fields(before, results, tools)
                for token in self.encode(piece, plain=plain)]
        # The generated turn stops on its end-of-turn token; whatever the template writes after
        # it (ChatML: a newline) belongs to the tool turn.
        ends = [index for index, token in enumerate(prefix) if token == self.end_of_turn_id]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders an assistant turn differently once tool results follow it: "
                             "its tool turn's tokens cannot be cut from the conversation (set multi_turn.chat_template)")
        return full[len(prefix):]

    def _pieces_with_plain_fields(self, before: list[dict], results: list[dict], tools: list[dict]
                                  ) -> list[tuple[str, bool]]:
        """``before + results`` rendered (with the next assistant header) as pieces of text,
        each with whether it is plain: the results' ``name`` and ``content`` fields are.

        The template renders each field as a mark, so that the text around the marks is its
        own; each field's own rendering (a filter such as ``trim`` or ``tojson`` may change it)
        is then cut from a rendering where that field alone is real."""
        marks, marked = {}, [dict(result) for result in results]
        for index, message in enumerate(marked):
            for key in ("name", "content"):
                if isinstance(message.get(key), str):
                    mark = f"ToolField{len(marks)}Mark"  # letters and digits: no filter changes them
                    marks[mark], message[key] = (index, key), mark
        template = self.render(before + marked, tools, add_generation_prompt=True)
        fields = {}
        for mark, (index, key) in marks.items():
            if mark in template:
                one_real = [dict(message) for message in marked]
                one_real[index][key] = results[index][key]
                real = self.render(before + one_real, tools, add_generation_prompt=True)
                fields[mark] = _field_as_rendered(template, mark, real, results[index][key])
        if not fields:
            return [(template, False)]
        pieces = re.split(f"({'|'.join(fields)})", template)
        # re.split with a group: the text between marks at even places, the marks at odd ones.
        return [(fields[piece], True) if place % 2 else (piece, False) for place, piece in enumerate(pieces) if piece]


def _field_as_rendered(template: str, mark: str, real: str, value: str) -> str:
    """What the template wrote for ``value`` where ``template`` has ``mark`` (``real``: the
    same rendering with the value in place of the mark, wherever the mark appears). A template
    that renders the value by other rules (e.g. leaves out an empty one) gets it as given."""
    count, start = template.count(mark), template.index(mark)
    extra, uneven = divmod(len(real) - len(template), count)
    candidate = real[start: start + len(mark) + extra]
    return candidate if not uneven and template.replace(mark, candidate) == real else value


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given into the prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "."}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return plain != tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                                  add_generation_prompt=True)


def _is_chatml(tokenizer) -> bool:
    vocabulary = tokenizer.get_vocab()
    return "<|im_start|>" in vocabulary and vocabulary.get("<|im_end|>") == tokenizer.eos_token_id
