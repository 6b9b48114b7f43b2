"""The built-in tool-call parsers (registered by pagedlm-server's plugin)."""

from __future__ import annotations

from pagedlm.server.tool_parsers import ToolParser
from pagedlm.server.tool_parsers.json_calls import CallEvent


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes 2
    Pro, Qwen 2.5 and Qwen3 write this)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    needs_special_tokens = True


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``: one array after the tag."""

    start_tag = "[TOOL_CALLS]"
    call_depth = 2
    needs_special_tokens = True


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+: the output is ``{"name": ..., "parameters": {...}}`` (calls separated by ``;``),
    optionally after ``<|python_tag|>``; an output that starts otherwise is content."""

    start_tag = "<|python_tag|>"
    args_key = "parameters"
    needs_special_tokens = True

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        #: None until the output's first characters say whether it is calls or content
        self._calls: bool | None = None

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[CallEvent]]:
        if self._calls is None:
            self._pending += text
            head = self._pending.lstrip()
            if not final and (not head or self.start_tag.startswith(head)):
                return "", []  # nothing but whitespace yet, or what may become the tag
            self._calls = head.startswith((self.start_tag, "{"))
            text = head[len(self.start_tag):] if head.startswith(self.start_tag) else self._pending
            self._pending = ""
        if self._calls:
            return "", self.scanner.feed(text)
        return text, []
