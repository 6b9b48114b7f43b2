"""An incremental scanner of tool calls written as JSON: ``{"name": ..., "<args_key>": {...}}``
objects, alone, one after another, or in an array, as the text streams in.

It reports each call's name as soon as that string is complete and its arguments as raw JSON
text fragments as they arrive, so a stream can send OpenAI's ``delta.tool_calls`` (a first
fragment with the id and the name, then argument fragments). Strings are tracked, so braces
inside them do not count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ScannedCall:
    name: str | None = None
    #: the arguments' raw JSON text so far
    arguments: str = ""
    #: whether the arguments' object has closed
    complete: bool = False
    #: how much of ``arguments`` has been reported (``feed``); -1: not even the name
    reported: int = -1


@dataclass
class CallEvent:
    """What is new of call ``index``: its name (first event of the call) and/or an argument fragment."""

    index: int
    name: str | None
    arguments: str


class JsonCallScanner:
    """``call_depth``: the nesting depth of a call's object (1: calls at the top level, one after
    another; 2: calls in an array)."""

    def __init__(self, args_key: str = "arguments", call_depth: int = 1) -> None:
        self.args_key = args_key
        self.call_depth = call_depth
        self.calls: list[ScannedCall] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string: list[str] = []
        self._expect_key = False
        self._key: str | None = None
        self._in_args = False

    def feed(self, text: str) -> list[CallEvent]:
        depth_of_call = self.call_depth
        for c in text:
            call = self.calls[-1] if self.calls else None
            if self._in_args and call is not None:
                call.arguments += c
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if not self._in_args and self._depth == depth_of_call and call is not None:
                        value = json.loads('"' + "".join(self._string) + '"')
                        if self._expect_key:
                            self._key, self._expect_key = value, False
                        elif self._key == "name" and call.name is None:
                            call.name = value
                    continue
                if not self._in_args:
                    self._string.append(c)
                continue
            if c == '"':
                self._in_string = True
                self._string = []
            elif c in "{[":
                if c == "{" and self._depth == depth_of_call - 1:
                    self.calls.append(ScannedCall())
                    self._expect_key, self._key = True, None
                elif self._depth == depth_of_call and self._key == self.args_key and not self._in_args \
                        and call is not None and not call.complete:
                    self._in_args = True
                    call.arguments = c
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._in_args and self._depth == depth_of_call and call is not None:
                    self._in_args = False
                    call.complete = True
            elif c == "," and self._depth == depth_of_call and not self._in_args:
                self._expect_key = True
        return self._events()

    def _events(self) -> list[CallEvent]:
        events = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue  # NOTE: arguments before the name wait for it: the first event names the call
            start = max(call.reported, 0)
            if call.reported < 0 or len(call.arguments) > start:
                events.append(CallEvent(index, call.name if call.reported < 0 else None, call.arguments[start:]))
                call.reported = len(call.arguments)
        return events
