"""Tools on chat completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

- ``"none"``: the tools go to the chat template; the output is plain content.
- ``"auto"`` (the default with tools): needs ``--enable-auto-tool-choice --tool-call-parser NAME``;
  the parser finds the calls the model chose to write, in its own format.
- ``"required"``: the output is constrained by a JSON-Schema grammar to an array of
  ``{"name": <a tool>, "parameters": <that tool's parameters>}`` (one item unless
  ``parallel_tool_calls``), so every call parses and its arguments validate.
- named (``{"type": "function", "function": {"name": ...}}``): the output is constrained to that
  tool's parameters schema: it is the call's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedlm.core.sampling_params import StructuredOutputsParams
from pagedlm.server.errors import APIError
from pagedlm.server.protocol import ChatCompletionRequest

#: a tool's parameters when it declares none: an object of anything
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolChoice:
    """What a request's tools ask of its output."""

    #: "none", "auto", "required" or "named"
    mode: str
    #: the request's tools as given (for the chat template); None without tools
    tools: list[dict[str, Any]] | None = None
    #: the named tool (mode "named")
    name: str | None = None
    #: the grammar of "required" and named choices
    structured_outputs: StructuredOutputsParams | None = None


def _function(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                       "\"parameters\"}}}", param=f"tools[{i}]")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"tools[{i}].function.name={name!r} must be a non-empty string",
                       param=f"tools[{i}].function.name")
    parameters = function.get("parameters", _ANY_OBJECT)
    if not isinstance(parameters, dict):
        raise APIError(f"tools[{i}].function.parameters must be a JSON Schema object",
                       param=f"tools[{i}].function.parameters")
    return function


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The ``function`` object of each tool, checked (400s naming ``tools[i]...``); duplicate names
    are refused too."""
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise APIError(f"tools have duplicate names: {sorted({n for n in names if names.count(n) > 1})}",
                       param="tools")
    return functions


def resolve_tool_choice(req: ChatCompletionRequest, *, auto_tool_parser: str | None) -> ToolChoice:
    """The request's tool choice, checked (400s naming the field); ``auto_tool_parser`` is the
    server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        return ToolChoice("none")
    functions = check_tools(req.tools)
    names = [f["name"] for f in functions]
    tools = list(req.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolChoice("none", tools)
    if choice == "auto":
        if auto_tool_parser is None:
            raise APIError('tool_choice="auto" needs the server to run with --enable-auto-tool-choice and '
                           '--tool-call-parser NAME; or use tool_choice="required", a named tool or "none"',
                           param="tool_choice")
        return ToolChoice("auto", tools)
    if choice == "required":
        return ToolChoice("required", tools, structured_outputs=StructuredOutputsParams(
            json=_required_schema(functions, parallel=req.parallel_tool_calls is not False)))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(f"tool_choice names the function {name!r}, which is not in tools (tools: "
                           f"{', '.join(names)})", param="tool_choice.function.name")
        function = functions[names.index(name)]
        return ToolChoice("named", tools, name=name, structured_outputs=StructuredOutputsParams(
            json=function.get("parameters", _ANY_OBJECT)))
    raise APIError(f"tool_choice={choice!r} is invalid: must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def _required_schema(functions: list[dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """An array of calls, each ``{"name": <const>, "parameters": <its schema>}``."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters", _ANY_OBJECT)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_messages_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them: arguments as objects (the
    API sends them as JSON strings; templates write them with ``tojson``)."""
    out = []
    for call in tool_calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
        call["function"] = function
        out.append(call)
    return out
