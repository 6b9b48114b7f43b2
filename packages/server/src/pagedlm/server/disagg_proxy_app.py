"""The app of ``pagedlm disagg-proxy`` (see :mod:`pagedlm.server.disagg_proxy`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

_FORWARDED_HEADERS = ("authorization", "content-type")


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    prefill = dict(body)
    prefill["max_tokens"] = 1
    if chat and "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("min_tokens", None)  # (the one token it makes is thrown away)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return prefill


def build_proxy_app(prefill_url: str, decode_url: str, *, timeout_s: float) -> Any:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    timeout = httpx.Timeout(timeout_s)
    state: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            state["client"] = client
            yield

    app = FastAPI(title="pagedlm disagg-proxy", lifespan=lifespan)

    def unreachable(which: str, url: str, e: Exception) -> JSONResponse:
        kind = "did not answer within the timeout" if isinstance(e, httpx.TimeoutException) else "is unreachable"
        message = f"the {which} instance at {url} {kind} ({type(e).__name__}: {e})"
        return JSONResponse({"error": {"message": message, "type": "BadGateway", "param": None, "code": 502}},
                            status_code=502)

    def passthrough(response: httpx.Response) -> Response:
        return Response(response.content, status_code=response.status_code,
                        media_type=response.headers.get("content-type"))

    async def handle(request: Request, path: str, chat: bool) -> Response:
        client = state["client"]
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse({"error": {"message": "the request body is not JSON", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "BadRequestError", "param": None, "code": 400}}, status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            prefilled = await client.post(prefill_url + path, json=_prefill_body(body, chat), headers=headers)
        except httpx.HTTPError as e:
            return unreachable("prefill", prefill_url, e)
        if prefilled.status_code != 200:
            return passthrough(prefilled)
        decode_body = dict(body)
        params = prefilled.json().get("kv_transfer_params")
        if params is not None:
            decode_body["kv_transfer_params"] = params
        if not body.get("stream"):
            try:
                decoded = await client.post(decode_url + path, json=decode_body, headers=headers)
            except httpx.HTTPError as e:
                return unreachable("decode", decode_url, e)
            return passthrough(decoded)
        try:
            upstream = await client.send(client.build_request("POST", decode_url + path, json=decode_body,
                                                              headers=headers), stream=True)
        except httpx.HTTPError as e:
            return unreachable("decode", decode_url, e)
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return passthrough(upstream)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the stream broke off: end it with an error event
                message = f"the decode instance at {decode_url} broke off the stream ({type(e).__name__}: {e})"
                yield f"data: {json.dumps({'error': {'message': message, 'code': 502}})}\n\n".encode()
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=200, media_type=upstream.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            return passthrough(await state["client"].get(decode_url + "/v1/models", headers=headers))
        except httpx.HTTPError as e:
            return unreachable("decode", decode_url, e)

    @app.get("/health")
    async def health() -> Response:
        for which, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                r = await state["client"].get(url + "/health")
            except httpx.HTTPError as e:
                return unreachable(which, url, e)
            if r.status_code != 200:
                return JSONResponse({"error": {"message": f"the {which} instance at {url} is not healthy "
                                                          f"(HTTP {r.status_code})", "code": 503}}, status_code=503)
        return Response(status_code=200)

    return app
