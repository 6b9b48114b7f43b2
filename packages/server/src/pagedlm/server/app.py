"""The FastAPI application: routes, API-key check, error handlers.

Routes (OpenAI's, then vLLM's):
  POST /v1/completions  POST /v1/chat/completions  GET /v1/models
  POST /tokenize  POST /detokenize  GET /health  GET /version  GET /metrics
With an API key set, every /v1 route and /tokenize, /detokenize and /metrics need
``Authorization: Bearer KEY``; /health and /version stay open for load balancers.
"""

from __future__ import annotations

import hmac
import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedlm.core import EngineDeadError
from pagedlm.server.errors import APIError, error_body, error_response, install_error_handlers
from pagedlm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedlm.server.serving_chat import create_chat_completion, render_chat
from pagedlm.server.serving_common import ServerState, check_model, get_state
from pagedlm.server.serving_completion import create_completion

_PROTECTED_EXACT = ("/tokenize", "/detokenize", "/metrics")
# Bodies above this are refused before they are read (a prompt this long cannot fit a context).
MAX_BODY_BYTES = 64 * 2**20


def _version() -> str:
    try:
        return importlib.metadata.version("pagedlm-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class GateMiddleware:
    """API-key check and body-size limit, as plain ASGI (it must not buffer streamed responses)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        error = self._check(scope["path"], headers)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return APIError(f"the request body is {int(length)} bytes; at most {MAX_BODY_BYTES} are accepted",
                            status=413)
        if self.api_key is None or not (path == "/v1" or path.startswith("/v1/") or path in _PROTECTED_EXACT):
            return None
        auth = headers.get(b"authorization")
        if not auth:
            return APIError("missing API key: send the header 'Authorization: Bearer <key>'", status=401,
                            code="invalid_api_key")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            return APIError("incorrect API key provided", status=401, code="invalid_api_key")
        return None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagedlm OpenAI-compatible server", version=_version(),
                  description="OpenAI's completions, chat and models API served by the pagedlm engine.")
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(GateMiddleware, api_key=state.api_key)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(get_state(request), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(get_state(request), body, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        s = get_state(request)
        engine = s.engine
        data = [{"id": name, "object": "model", "created": s.created, "owned_by": "pagedlm",
                 "root": engine.model_config.model, "parent": None,
                 "max_model_len": engine.max_model_len} for name in s.served_model_names]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Any:
        s = get_state(request)
        check_model(s, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt (a string) or messages (a chat)", param="prompt")
        if body.messages is not None:
            gen_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
            _, tokens = render_chat(s, body.messages, add_generation_prompt=gen_prompt)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            try:
                tokens = s.engine.tokenize(body.prompt or "", add_special_tokens=add_special)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": s.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
        s = get_state(request)
        check_model(s, body.model)
        vocab = s.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens contains ids {bad[:5]} outside the vocabulary [0, {vocab})", param="tokens")
        tokenizer = s.engine.tokenizer
        if tokenizer is None:
            raise APIError("detokenize needs a tokenizer, and this server runs without one")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health(request: Request) -> Any:
        try:
            await get_state(request).engine.check_health()
        except EngineDeadError as dead:
            return JSONResponse(error_body(f"the engine is not available: {dead}", status=503), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> Any:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        collector = get_state(request).metrics
        payload = generate_latest(collector.registry) if collector is not None else b""
        return Response(payload, media_type=CONTENT_TYPE_LATEST)

    return app
