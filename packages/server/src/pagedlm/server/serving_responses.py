"""POST /v1/responses: OpenAI's Responses API for text in and text out, over the chat path.

``input`` (a string, or a list of messages whose content is a string or ``input_text`` /
``output_text`` parts) and ``instructions`` (a system message put first) are templated like a chat
request; the reply is one ``message`` output item holding one ``output_text`` part. Streaming sends
the Responses events: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
(one per new piece of text), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (whose response says ``"incomplete"``
when ``max_output_tokens`` cut the reply).

Responses are not kept: ``store=true`` (and so ``previous_response_id``) is refused by name; a
request that leaves ``store`` out is answered as with ``store=false``. Tools, non-text formats and
reasoning options are refused by name.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagedlm.core import EngineDeadError
from pagedlm.core.outputs import RequestOutput
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.server.errors import APIError, error_response
from pagedlm.server.protocol import ChatContentPart, ChatMessage, ResponsesRequest
from pagedlm.server.serving_chat import check_messages_length, render_chat
from pagedlm.server.serving_common import (
    ServerState,
    SSEResponse,
    bad_request,
    check_engine,
    check_generative,
    check_model,
    engine_dead,
    get_state,
    off_loop,
    random_id,
    request_priority,
    until_disconnect,
)

router = APIRouter()


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    messages = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
        return messages
    if not req.input:
        raise APIError("input=[] is invalid: give a string or at least one message", param="input")
    for i, item in enumerate(req.input):
        content = item.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                    raise APIError(f"input[{i}].content[{j}] of type {part.get('type')!r} is not supported: this "
                                   "server takes text only (input_text / output_text parts)",
                                   param=f"input[{i}].content[{j}].type")
                texts.append(part["text"])
            content = [ChatContentPart(type="text", text=t) for t in texts]
        messages.append(ChatMessage(role=item.role, content=content))
    return messages


def _check(req: ResponsesRequest) -> None:
    if req.store:
        raise APIError("store=true is not supported by this server: responses are not kept; send store=false",
                       param="store")
    if req.previous_response_id is not None:
        raise APIError("previous_response_id is not supported: this server keeps no responses (store=false); send "
                       "the whole conversation as input", param="previous_response_id")
    if req.tools:
        raise APIError("tools are not supported by this server", param="tools")
    fmt = (req.text or {}).get("format")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise APIError(f"text.format type {fmt.get('type')!r} is not supported: only \"text\"", param="text.format")
    if req.reasoning is not None:
        raise APIError("reasoning options are not supported by this server", param="reasoning")


def _sampling_params(req: ResponsesRequest, stream: bool) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k if req.top_k not in (None, 0) else -1,
            seed=req.seed, max_tokens=req.max_output_tokens,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        raise bad_request(e) from None


class _ResponseBuilder:
    def __init__(self, state: ServerState, req: ResponsesRequest, num_prompt_tokens: int) -> None:
        self.state = state
        self.req = req
        self.id = random_id("resp")
        self.item_id = random_id("msg")
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.sequence_number = 0

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != \
            "in_progress" else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self, status: str, text: str | None = None, num_output_tokens: int = 0,
                 finish_reason: str | None = None, num_cached: int = 0) -> dict[str, Any]:
        req = self.req
        if status != "in_progress" and finish_reason == "length":
            status = "incomplete"
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "model": self.state.model_name,
            "output": [] if text is None else [self.message(text, "incomplete" if status == "incomplete"
                                                              else "completed")],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
            "metadata": req.metadata or {}, "store": False, "text": {"format": {"type": "text"}},
            "truncation": "disabled", "reasoning": None,
        }
        if req.user is not None:
            body["user"] = req.user
        if status != "in_progress":
            body["usage"] = {"input_tokens": self.num_prompt_tokens,
                             "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
                             "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": self.num_prompt_tokens + num_output_tokens}
        return body

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def stream(self, gen: AsyncGenerator[RequestOutput, None]):
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        try:
            yield self.event("response.created", response=self.response("in_progress"))
            yield self.event("response.in_progress", response=self.response("in_progress"))
            yield self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
            yield self.event("response.content_part.added", part=empty_part, **where)
            text, num_tokens, reason, num_cached = "", 0, None, 0
            async for out in gen:
                if out.error:
                    raise APIError(f"generation failed: {out.error}", status=500)
                c = out.outputs[0]
                num_tokens += len(c.token_ids)
                num_cached = out.num_cached_tokens
                reason = c.finish_reason or reason
                if c.text:
                    text += c.text
                    yield self.event("response.output_text.delta", delta=c.text, logprobs=[], **where)
            final = self.response("completed", text, num_tokens, reason, num_cached)
            part = final["output"][0]["content"][0]
            yield self.event("response.output_text.done", text=text, logprobs=[], **where)
            yield self.event("response.content_part.done", part=part, **where)
            yield self.event("response.output_item.done", output_index=0, item=final["output"][0])
            # NOTE: response.completed also ends a reply cut by max_output_tokens (its status says
            # "incomplete"), as vLLM sends it: the openai client's stream helper waits for it
            yield self.event("response.completed", response=final)
        except (APIError, EngineDeadError) as e:
            message = e.message if isinstance(e, APIError) else f"the engine is not available: {e}"
            failed = self.response("in_progress")
            failed["status"] = "failed"
            failed["error"] = {"code": "server_error", "message": message}
            yield self.event("response.failed", response=failed)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state = get_state(request)
    check_model(state, body.model)
    check_engine(state)
    check_generative(state, "Responses API (/v1/responses)")
    _check(body)
    stream = bool(body.stream)
    params = _sampling_params(body, stream)
    messages = _messages(body)
    check_messages_length(state, messages, "input")
    text, token_ids = await off_loop(render_chat, state, messages, param="input")
    try:
        state.engine.validate_prompt(token_ids, params)
    except ValueError as e:
        error = bad_request(e, prompt_param="input")
        if "max_tokens" in error.message:
            error.param = "max_output_tokens"
        raise error from None
    priority = request_priority(state, body)  # type: ignore[arg-type]
    builder = _ResponseBuilder(state, body, len(token_ids))
    gen = state.engine.generate({"prompt": text, "prompt_token_ids": token_ids}, params, builder.id,
                                priority=priority)
    if stream:
        return SSEResponse(builder.stream(gen))

    async def collect() -> RequestOutput | None:
        final = None
        async for out in gen:
            final = out
        return final

    try:
        final = await until_disconnect(request, collect())
    except EngineDeadError as e:
        return error_response(engine_dead(e))
    if final is None:
        return JSONResponse({}, status_code=499)
    if final.error:
        raise APIError(f"generation failed: {final.error}", status=500)
    c = final.outputs[0]
    return JSONResponse(builder.response("completed", c.text, len(c.token_ids), c.finish_reason,
                                         final.num_cached_tokens))
