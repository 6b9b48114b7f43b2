"""The tool-call and reasoning parsers on their own: whole outputs, and streams cut anywhere
(every split of the text must give the same content, calls and reasoning)."""

from __future__ import annotations

import json

import pytest

from pagedlm.server.chat_choice import ChoiceMessage
from pagedlm.server.tool_parsers import get_tool_parser
from pagedlm.server.tools import ToolChoice

HERMES = ('I will call.<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"b", "n": [1, {"x": 2}]}}\n</tool_call>\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
CASES = {
    "hermes": (HERMES, "I will call.", [("f", {"s": 'a}"b', "n": [1, {"x": 2}]}), ("g", {})]),
    "qwen3": (HERMES, "I will call.", [("f", {"s": 'a}"b', "n": [1, {"x": 2}]}), ("g", {})]),
    "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "]"}}]', None,
                [("f", {"a": 1}), ("g", {"b": "]"})]),
    "llama3_json": ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
                    [("f", {"a": 1}), ("g", {})]),
}


class _Think:
    def get_vocab(self):
        return {"<think>": 1, "</think>": 2}


def _stream(message: ChoiceMessage, text: str, step: int) -> tuple[str, str, dict[int, list[str]]]:
    content, reasoning, calls = [], [], {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        delta = message.delta(piece, final=i == len(pieces) - 1)
        content.append(delta.get("content", ""))
        reasoning.append(delta.get("reasoning_content", ""))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["function"]["name"]
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return "".join(content), "".join(reasoning), calls


@pytest.mark.parametrize("name", list(CASES))
def test_tool_parsers_whole_and_streamed(name):
    text, content, calls = CASES[name]
    parser_cls = get_tool_parser(name)
    got_content, got_calls = parser_cls(None).extract(text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    for step in (1, 2, 5, len(text)):
        message = ChoiceMessage(ToolChoice("auto"), None, parser_cls(None))
        streamed_content, _, streamed = _stream(message, text, step)
        assert streamed_content.strip() == (content or "")
        assert [(n, json.loads(a)) for n, a in streamed.values()] == calls
        assert message.finish_reason("stop") == "tool_calls"


def test_an_unfinished_call_is_content():
    parser = get_tool_parser("hermes")(None)
    text = 'x<tool_call>{"name": "f", "arguments": {"a": '
    assert parser.extract(text) == (text, [])


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), [
    ("qwen3", "<think>let me see</think>The answer.", "let me see", "The answer."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut short", "cut short", None),
    ("deepseek_r1", "thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "still thinking", "still thinking", None),
])
def test_reasoning_parsers_whole_and_streamed(name, text, reasoning, content):
    from pagedlm.core.reasoning import get_reasoning_parser

    parser = get_reasoning_parser(name)(_Think())
    assert parser.split(text) == (reasoning, content)
    for step in (1, 3, len(text)):
        message = ChoiceMessage(ToolChoice("none"), parser)
        streamed_content, streamed_reasoning, _ = _stream(message, text, step)
        assert (streamed_reasoning or None, streamed_content or None) == (reasoning, content)
    assert parser.is_reasoning_end([5, 1, 7, 2, 9]) and not parser.is_reasoning_end([2, 1, 7])
    assert parser.reasoning_end_index([7, 2, 8]) == 1 and parser.reasoning_end_index([7]) is None


def test_a_tokenizer_without_think_tokens_is_refused():
    from pagedlm.core.reasoning import get_reasoning_parser

    class NoThink:
        def get_vocab(self):
            return {}

    with pytest.raises(ValueError, match=r"needs the tokens \['<think>', '</think>'\]"):
        get_reasoning_parser("qwen3")(NoThink())
    with pytest.raises(ValueError, match=r"reasoning_parser='nope' is not registered; registered: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
