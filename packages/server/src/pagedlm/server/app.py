"""The FastAPI application: routes, API-key check, error handlers.

Routes (OpenAI's, then vLLM's):
  POST /v1/completions  POST /v1/chat/completions  GET /v1/models  GET /v1/models/{model}
  POST /v1/chat/completions/batch (vLLM's)
  POST /tokenize  POST /detokenize  GET /health  GET /version  GET /metrics
  POST /v1/embeddings, POST /pooling (pooling models; serving_embedding.py)
  POST /v1/responses (text; serving_responses.py)
  POST /sleep  POST /wake_up  GET /is_sleeping (with --enable-sleep-mode; serving_sleep.py)
  GET /load, GET /tokenizer_info (vLLM's; serving_info.py)
  POST /invocations (SageMaker's: a chat, completion or embeddings request; serving_invocations.py)
With an API key set, every /v1 route and /tokenize, /detokenize, /tokenizer_info, /metrics, /pooling,
/invocations and the sleep routes need ``Authorization: Bearer KEY``; /health, /version and /load stay open for
load balancers.
"""

from __future__ import annotations

import hmac
import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedlm.core import EngineDeadError
from pagedlm.server.errors import APIError, error_body, error_response, install_error_handlers
from pagedlm.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedlm.server.serving_chat import check_messages_length, create_chat_completion, render_chat
from pagedlm.server.serving_chat_batch import create_batch_chat_completion
from pagedlm.server.serving_common import ServerState, check_model, check_text_length, get_state, off_loop
from pagedlm.server.serving_completion import create_completion
from pagedlm.server.serving_info import LoadTrackingMiddleware
from pagedlm.server.serving_multimodal import multimodal_chat_tokens
from pagedlm.server.tools import check_tools

_PROTECTED_EXACT = ("/tokenize", "/detokenize", "/tokenizer_info", "/metrics", "/pooling", "/invocations", "/sleep",
                    "/wake_up", "/is_sleeping")
# Bodies above this are refused (a prompt this long cannot fit a context): at once when the
# Content-Length says so, else as soon as this many bytes have arrived.
MAX_BODY_BYTES = 64 * 2**20


def _version() -> str:
    try:
        return importlib.metadata.version("pagedlm-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _too_large() -> APIError:
    return APIError(f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes "
                    f"({MAX_BODY_BYTES // 2**20} MiB)", status=413)


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
        if error is None:
            body = await self._read_body(receive)
            if body is None:
                return  # the client went away while sending
            if len(body) > MAX_BODY_BYTES:
                error = _too_large()
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _read_body(receive: Receive) -> bytes | None:
        """The body, read up to one chunk past the limit however it is framed (Content-Length
        or chunked); None if the client disconnects first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BODY_BYTES or not message.get("more_body", False):
                return b"".join(chunks)

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _too_large()  # refused before a byte of it is read
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


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the client's own messages (the
    serving code watches them for a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagedlm OpenAI-compatible server", version=_version(),
                  description="OpenAI's completions, chat and models API served by the pagedlm engine.")
    app.state.server = state
    install_error_handlers(app)
    # NOTE: the last added runs first: a request the gate refuses is never counted as load
    app.add_middleware(LoadTrackingMiddleware, state=state)
    app.add_middleware(GateMiddleware, api_key=state.api_key)
    if state.lora is not None:
        state.lora.install_routes(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(get_state(request), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(get_state(request), body, request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(body: BatchChatCompletionRequest, request: Request) -> Any:
        return await create_batch_chat_completion(get_state(request), body, request)

    def model_card(s: ServerState, name: str) -> dict[str, Any]:
        engine = s.engine
        return {"id": name, "object": "model", "created": s.created, "owned_by": "pagedlm",
                "root": engine.model_config.model, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        s = get_state(request)
        cards = [model_card(s, name) for name in s.served_model_names]
        if s.lora is not None:
            cards += [{**card, "max_model_len": s.engine.max_model_len} for card in s.lora.cards(s.created)]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}")  # :path: a served name may hold slashes (org/name)
    async def retrieve_model(model: str, request: Request) -> Any:
        s = get_state(request)
        check_model(s, model)
        if s.lora_request(model) is not None:
            card = next(c for c in s.lora.cards(s.created) if c["id"] == model)
            return {**card, "max_model_len": s.engine.max_model_len}
        return model_card(s, model)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Any:
        s = get_state(request)
        check_model(s, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt (a string) or messages (a chat)", param="prompt")
        if body.messages is None and (body.tools is not None or body.chat_template_kwargs is not None):
            param = "tools" if body.tools is not None else "chat_template_kwargs"
            raise APIError(f"{param} applies to a chat (messages), not to a prompt", param=param)
        if body.messages is not None:
            gen_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
            check_messages_length(s, body.messages)
            if body.tools:
                check_tools(body.tools)
            tokens = None
            if not body.tools and not body.chat_template_kwargs:  # the image path renders neither
                tokens = await off_loop(multimodal_chat_tokens, s, body.messages, add_generation_prompt=gen_prompt,
                                        continue_final_message=bool(body.continue_final_message))
            if tokens is None:
                _, tokens = await off_loop(render_chat, s, body.messages, add_generation_prompt=gen_prompt,
                                           continue_final_message=bool(body.continue_final_message),
                                           add_special_tokens=bool(body.add_special_tokens), tools=body.tools,
                                           template_kwargs=body.chat_template_kwargs)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            check_text_length(s, len(body.prompt or ""), "prompt")
            try:
                tokens = await off_loop(s.engine.tokenize, body.prompt or "", add_special_tokens=add_special)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from None
        token_strs = None
        if body.return_token_strs:
            token_strs = await off_loop(s.engine.tokenizer.convert_ids_to_tokens, tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": s.engine.max_model_len,
                "token_strs": token_strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Any:
        s = get_state(request)
        check_model(s, body.model)
        # No sequence of this model is longer than its context; more would only cost decode time.
        if len(body.tokens) > s.engine.max_model_len:
            raise APIError(f"tokens has {len(body.tokens)} ids; at most max_model_len={s.engine.max_model_len} "
                           "are accepted", param="tokens")
        vocab = s.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens contains ids {bad[:5]} outside the vocabulary [0, {vocab})", param="tokens")
        tokenizer = s.engine.tokenizer
        if tokenizer is None:
            raise APIError("detokenize needs a tokenizer, and this server runs without one")
        return {"prompt": await off_loop(tokenizer.decode, body.tokens)}

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

    from pagedlm.server import serving_embedding, serving_info, serving_invocations, serving_responses, serving_sleep

    app.include_router(serving_info.router)
    app.include_router(serving_invocations.router)
    app.include_router(serving_embedding.router)
    app.include_router(serving_responses.router)
    app.include_router(serving_sleep.router)
    return app
