"""vLLM's introspection routes: GET /load (requests in flight, with --enable-server-load-tracking)
and GET /tokenizer_info (the tokenizer's configuration, with --enable-tokenizer-info-endpoint).

A load balancer reads /load to send work where the fewest generation requests are running; a
client that tokenizes by itself reads /tokenizer_info to match the server's tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedlm.server.errors import APIError
from pagedlm.server.serving_common import ServerState, get_state

router = APIRouter()

#: the routes that run the model, which /load counts (as vLLM's load-aware routes)
LOAD_TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                                "/v1/embeddings", "/pooling", "/v1/responses", "/invocations"})


class LoadTrackingMiddleware:
    """Counts the requests in flight on ``LOAD_TRACKED_PATHS`` in ``state.server_load``.

    NOTE: the inner app returns only once the response is sent, a stream's last chunk included
    (or the client has gone), so a streamed request counts for as long as it streams.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self.state.enable_server_load_tracking
                or scope["path"] not in LOAD_TRACKED_PATHS):
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


@router.get("/load")
async def server_load(request: Request) -> Any:
    """``{"server_load": N}``: generation requests in flight (always 0 without the flag, as vLLM's)."""
    return {"server_load": get_state(request).server_load}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Any:
    s = get_state(request)
    if not s.enable_tokenizer_info_endpoint:
        raise APIError("GET /tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint "
                       "(it publishes the tokenizer's configuration and chat template)", status=404)
    tokenizer = s.engine.tokenizer
    if tokenizer is None:
        raise APIError("tokenizer_info needs a tokenizer, and this server runs without one (skip_tokenizer_init)")
    return describe_tokenizer(tokenizer, s.chat_template)


def describe_tokenizer(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer's configuration (its ``init_kwargs``, as tokenizer_config.json has it) as
    JSON, with ``tokenizer_class`` and the chat template the server applies. Local file paths
    (``*_file``) are left out: they name the server's disk, not the tokenizer."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    info = {key: _jsonable(value) for key, value in kwargs.items() if not key.endswith("_file")}
    decoder = kwargs.get("added_tokens_decoder")
    if isinstance(decoder, dict):  # the one place the file keeps whole token objects
        info["added_tokens_decoder"] = {str(i): _added_token(token) for i, token in decoder.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "content"):  # a special token (bos_token, ...): its text, as tokenizer_config.json writes it
        return str(value.content)
    return str(value)


def _added_token(token: Any) -> Any:
    if not hasattr(token, "content"):
        return _jsonable(token)
    return {name: _jsonable(getattr(token, name)) for name in
            ("content", "single_word", "lstrip", "rstrip", "normalized", "special") if hasattr(token, name)}
