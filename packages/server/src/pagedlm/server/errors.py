"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

``APIError`` is raised by the serving code; the handlers installed by ``install_error_handlers``
turn it, FastAPI's validation errors, unknown routes and unexpected exceptions into that shape,
so a client never sees an HTML page, a bare string or a traceback.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedlm.core.logger import init_logger
from pagedlm.server.protocol import FIELD_NAMES, TEXT_NOT_UTF8, UNION_FIELDS

logger = init_logger(__name__)

# OpenAI's error "type" per status (what its API and the openai client's exception classes use).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    # A message may quote the client's text; one that is not valid Unicode must not make the
    # error itself unencodable (a 500), so such characters are written as escapes.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.message, status=err.status, param=err.param, code=err.code, type=err.type),
                        status_code=err.status, headers=headers)


def short_repr(value: Any, limit: int = 80) -> str:
    """A JSON-ish rendering of a bad value for a message, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PARAM_PREFIX = re.compile(r"^([a-z_]+)(?:=| \(| contains| must| is| of)")


def param_of_message(message: str, known: set[str] | frozenset[str] = FIELD_NAMES) -> str | None:
    """The request parameter an engine ValueError is about (its messages start with the name)."""
    m = _PARAM_PREFIX.match(message)
    if m is None:
        return None
    name = {"prompt_token_ids": "prompt"}.get(m.group(1), m.group(1))
    return name if name in known else None


def _path(loc: list[Any]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``; pydantic's union tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELD_NAMES:
            out += f".{part}" if out else part
    return out


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> APIError:
    """One clear 400 from pydantic's error list: the parameter, the bad value and what is allowed."""
    first = errors[0]
    if isinstance(first.get("input"), (bytes, bytearray)):
        # FastAPI parses JSON only when the request says it is JSON.
        return APIError(f"the request body must be JSON sent with 'Content-Type: application/json' "
                        f"(this request has Content-Type: {content_type or 'none'})")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        where = f" at position {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return APIError(f"the request body is not valid JSON: {detail}{where}")
    # Text that is not valid Unicode also fails every other member of a union field (prompt,
    # stop, content): its own error says what is wrong and where.
    unencodable = next((e for e in errors if e.get("type") == TEXT_NOT_UTF8), None)
    if unencodable is not None:
        path = _path([p for p in unencodable["loc"] if p != "body"])
        return APIError(f"{path} {unencodable['msg']}", param=path)
    if not loc:
        if kind == "missing":
            return APIError("the request body is empty: send a JSON object")
        return APIError(f"the request body must be a JSON object, got {short_repr(first.get('input'))}")
    field = loc[0] if isinstance(loc[0], str) else None
    path = _path(loc) or str(field)
    if kind == "missing":
        return APIError(f"{path} is required", param=path)
    # A union-typed field yields one error per member type; name what the field accepts instead.
    tagged = any(isinstance(p, str) and p not in FIELD_NAMES for p in loc)
    leaf = next((p for p in reversed(loc) if isinstance(p, str) and p in FIELD_NAMES), None)
    if tagged and leaf in UNION_FIELDS:
        leaf_path = _path(loc[: loc.index(leaf) + 1])
        value = _value_at(errors, leaf)
        return APIError(f"{leaf_path}={short_repr(value)} is invalid: must be {UNION_FIELDS[leaf]}",
                        param=leaf_path)
    msg = first.get("msg", "invalid value")
    return APIError(f"{path}={short_repr(first.get('input'))} is invalid: {msg[0].lower() + msg[1:]}", param=path)


def _value_at(errors: list[dict[str, Any]], leaf: str) -> Any:
    # The union member that failed at the field itself (not inside a list) carries its input.
    for err in errors:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        if loc and loc[-1] not in FIELD_NAMES and not isinstance(loc[-1], int) and leaf in loc:
            return err.get("input")
    return errors[0].get("input")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors()), request.headers.get("content-type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(status).phrase
        return JSONResponse(error_body(message, status=status), status_code=status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: log the traceback here, tell the client only that it happened.
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error ({type(exc).__name__}); see the server log",
                                       status=500), status_code=500)
