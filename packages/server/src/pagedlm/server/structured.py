"""Structured outputs of a request: ``response_format`` (chat), vLLM's ``structured_outputs`` field
and its older ``guided_*`` names, as one :class:`StructuredOutputsParams` (or None).

Every mistake is a 400 naming the field it is in: the parameters' own checks, then the engine's
grammar backend's (does the schema, regex or grammar compile).
"""

from __future__ import annotations

import re
from typing import Any

from pagedlm.core.sampling_params import StructuredOutputsParams
from pagedlm.server.errors import APIError
from pagedlm.server.protocol import SamplingFields
from pagedlm.server.serving_common import ServerState, off_loop

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
           "disable_additional_properties", "whitespace_pattern")


def _renamed(message: str, param: str) -> str:
    """An engine message about ``structured_outputs.<field>`` told about the request's ``param``."""
    return message if param == "structured_outputs" else re.sub(r"structured_outputs(\.\w+)?", param, message, count=1)


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise APIError(f"{param} has unknown fields {unknown}; known: {', '.join(_FIELDS)}", param=param)
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise APIError(_renamed(str(e), param), param=param) from None


def response_format_params(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` as params; None for ``{"type": "text"}`` or none."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object {\"name\", \"schema\", \"strict\"} "
                           "when type is \"json_schema\"", param="response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"response_format.json_schema.name={name!r} must be a non-empty string",
                           param="response_format.json_schema.name")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format.json_schema.schema")
        return _params({"json": schema}, "response_format.json_schema.schema")
    raise APIError(f"response_format.type={kind!r} is not supported: use \"text\", \"json_object\" or "
                   "\"json_schema\"", param="response_format.type")


def request_params(req: SamplingFields, response_format: dict[str, Any] | None = None
                   ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(params, the request field they came from) of a request's structured outputs; one source only."""
    sources: list[tuple[StructuredOutputsParams, str]] = []
    if req.structured_outputs is not None:
        sources.append((_params(dict(req.structured_outputs), "structured_outputs"), "structured_outputs"))
    guided = [name for name in _GUIDED if getattr(req, name) is not None]
    if guided:
        try:
            params = StructuredOutputsParams.from_guided(
                guided_json=req.guided_json, guided_regex=req.guided_regex, guided_choice=req.guided_choice,
                guided_grammar=req.guided_grammar, guided_whitespace_pattern=req.guided_whitespace_pattern)
        except ValueError as e:
            raise APIError(_renamed(str(e), guided[0]), param=guided[0]) from None
        assert params is not None
        sources.append((params, guided[0]))
    from_format = response_format_params(response_format)
    if from_format is not None:
        sources.append((from_format, "response_format" if from_format.json is None
                        else "response_format.json_schema.schema"))
    if len(sources) > 1:
        names = ", ".join(name for _, name in sources)
        raise APIError(f"give one structured-output constraint per request; got {names}", param=sources[1][1])
    return sources[0] if sources else (None, None)


async def check_compiles(state: ServerState, params: StructuredOutputsParams, param: str) -> None:
    """The grammar backend's check (off the event loop): a 400 naming ``param`` if it cannot compile."""
    from pagedlm.core.structured_output.manager import validate_structured_outputs

    try:
        await off_loop(validate_structured_outputs, state.engine.vllm_config, params)
    except ValueError as e:
        raise APIError(_renamed(str(e), param), param=param) from None
