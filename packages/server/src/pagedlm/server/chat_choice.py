"""One chat choice's message: its text split into reasoning, content and tool calls.

The same object serves a stream (``delta``: what each new piece of text adds, as OpenAI's
``delta`` fields) and a whole response (``message``). Reasoning (``--reasoning-parser``) is split
off first; tool calls are read from the content: by the tool parser (``tool_choice="auto"``), as
the JSON array of a ``"required"`` choice, or as the arguments of a named choice.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagedlm.server.tool_parsers import ToolParser
from pagedlm.server.tool_parsers.json_calls import CallEvent, JsonCallScanner
from pagedlm.server.tools import ToolChoice


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ChoiceMessage:
    def __init__(self, tool_choice: ToolChoice, reasoner: Any = None, tool_parser: ToolParser | None = None) -> None:
        self.mode = tool_choice.mode
        self.tool_name = tool_choice.name
        self.reasoner = reasoner
        self.tool_parser = tool_parser if self.mode == "auto" else None
        self._scanner = JsonCallScanner("parameters", call_depth=2) if self.mode == "required" else None
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._ids: list[str] = []
        self._named_started = False

    @property
    def tools_called(self) -> bool:
        return bool(self._ids)

    # -- streams ---------------------------------------------------------------------------
    def delta(self, text: str, *, final: bool) -> dict[str, Any]:
        """The ``delta`` fields of a new piece of text (possibly none); ``final`` on the last one."""
        reasoning, content = self._split(text, final)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        events: list[CallEvent] = []
        if self.mode == "named":
            if not self._named_started and (content or final):
                self._named_started = True
                events.append(CallEvent(0, self.tool_name, ""))
            if content:
                events.append(CallEvent(0, None, content))
            content = ""
        elif self._scanner is not None:
            events = self._scanner.feed(content)
            content = ""
        elif self.tool_parser is not None:
            content, events = self.tool_parser.feed(content, final=final)
        if content:
            delta["content"] = content
        if events:
            delta["tool_calls"] = self._call_deltas(events)
        return delta

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) of the output once ``text`` is added."""
        if self.reasoner is None:
            return "", text
        self._text += text
        reasoning, content = self.reasoner.split(self._text, final=final)
        reasoning, content = reasoning or "", content or ""
        new = reasoning[self._reasoning_sent:], content[self._content_sent:]
        self._reasoning_sent, self._content_sent = len(reasoning), len(content)
        return new

    def _call_deltas(self, events: list[CallEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if event.name is not None:  # a call's first fragment: its id, type and name
                while len(self._ids) <= event.index:
                    self._ids.append(tool_call_id())
                out.append({"index": event.index, "id": self._ids[event.index], "type": "function",
                            "function": {"name": event.name, "arguments": event.arguments}})
            elif out and out[-1]["index"] == event.index:
                out[-1]["function"]["arguments"] += event.arguments
            else:
                out.append({"index": event.index, "function": {"arguments": event.arguments}})
        return out

    # -- whole responses ---------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        """The message fields of a whole output: content, reasoning (both names) and tool_calls."""
        reasoning, content = (self.reasoner.split(text) if self.reasoner is not None else (None, text))
        calls: list[tuple[str, str]] = []
        if content is not None:
            if self.mode == "named":
                calls, content = [(self.tool_name or "", content)], None
            elif self.mode == "required":
                calls = _required_calls(content)
                if calls:
                    content = None
            elif self.tool_parser is not None:
                content, calls = self.tool_parser.extract(content)
        self._ids = [tool_call_id() for _ in calls]
        body: dict[str, Any] = {"content": content, "reasoning": reasoning, "reasoning_content": reasoning}
        if calls:
            body["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
                                  for call_id, (name, args) in zip(self._ids, calls)]
        return body

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for an output that ended by calling tools (auto and required;
        a named choice reports ``stop``, as OpenAI's)."""
        if reason == "stop" and self.tools_called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a ``"required"`` output (a JSON array); none when it does not parse (cut by
    max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
            if isinstance(item, dict) and "name" in item and "parameters" in item]
