"""Tool-call parsers for ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``).

A parser finds the tool calls a model writes in its own format, in a whole output and while it
streams (:meth:`ToolParser.feed`). Parsers register through ``pagedlm_register_tool_parsers``;
pagedlm-server registers hermes, qwen3, llama3_json and mistral (``parsers.py``).
"""

from __future__ import annotations

import json
from typing import Any

from pagedlm.server.tool_parsers.json_calls import CallEvent, JsonCallScanner


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text that may
    still become the tag, so a stream keeps it back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """Splits an output into content and tool calls.

    The base class reads calls written as JSON objects (``{"name": ..., args_key: {...}}``) between
    ``start_tag`` and ``end_tag`` (hermes' ``<tool_call>``), or after ``start_tag`` to the end with
    no ``end_tag`` (mistral's ``[TOOL_CALLS][...]``, ``call_depth=2`` for the array). Built as
    ``Cls(tokenizer)``, one per output (it keeps the stream's state).
    """

    start_tag: str = ""
    end_tag: str | None = None
    args_key = "arguments"
    call_depth = 1
    #: the tags are special tokens, which decoding must keep (``skip_special_tokens=False``)
    needs_special_tokens = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.scanner = JsonCallScanner(self.args_key, self.call_depth)
        self._pending = ""
        self._in_call = False

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[CallEvent]]:
        """(content, tool-call events) of the next piece of output; ``final`` flushes text held
        back because it might have become a tag."""
        buf = self._pending + text
        content: list[str] = []
        events: list[CallEvent] = []
        while buf:
            if not self._in_call:
                at = buf.find(self.start_tag)
                if at >= 0:
                    content.append(buf[:at])
                    buf, self._in_call = buf[at + len(self.start_tag):], True
                    continue
                keep = 0 if final else held_back(buf, self.start_tag)
                content.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            if self.end_tag is None:
                events.extend(self.scanner.feed(buf))
                buf = ""
                break
            at = buf.find(self.end_tag)
            if at >= 0:
                events.extend(self.scanner.feed(buf[:at]))
                buf, self._in_call = buf[at + len(self.end_tag):], False
                continue
            keep = 0 if final else held_back(buf, self.end_tag)
            events.extend(self.scanner.feed(buf[: len(buf) - keep]))
            buf = buf[len(buf) - keep:]
            break
        self._pending = buf
        out = "".join(content)
        if self.scanner.calls and not out.strip():
            out = ""  # the whitespace around and between tool calls is not content
        return out, events

    def extract(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON)]) of a whole output; when a call does not parse
        (e.g. cut by max_tokens) there are no tool calls and the whole output is content."""
        content, _ = self.feed(text, final=True)
        calls = []
        for call in self.scanner.calls:
            if call.name is None or not call.complete:
                return text, []
            try:
                json.loads(call.arguments)
            except ValueError:
                return text, []
            calls.append((call.name, call.arguments))
        if not calls:
            return text, []
        return content.strip() or None, calls


def get_tool_parser(name: str) -> type[ToolParser]:
    """The class registered as ``name``; ``ValueError`` listing the registered names otherwise."""
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    parsers = get_plugins().tool_parsers()
    if name not in parsers:
        raise ValueError(f"--tool-call-parser {name!r} is not registered; registered: {', '.join(sorted(parsers))}")
    return resolve_class_path(parsers[name])
