"""POST /v1/chat/completions/batch: vLLM's batch of conversations in one request.

The body is a chat request whose ``messages`` is a list of conversations; each runs as its own
engine request with the same sampling parameters, and the response is one ``chat.completion``
whose choice ``i`` answers conversation ``i``, with the usage of all of them. As in vLLM, no
streaming, no ``n > 1`` and no tools.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedlm.core import EngineDeadError
from pagedlm.core.outputs import RequestOutput
from pagedlm.server.errors import APIError, error_response
from pagedlm.server.protocol import BatchChatCompletionRequest
from pagedlm.server.serving_chat import _ChatBuilder, chat_params, chat_prompt, echo_text
from pagedlm.server.serving_common import (
    ServerState,
    check_sequences,
    engine_dead,
    merge,
    random_id,
    request_priority,
    until_disconnect,
)
from pagedlm.server.serving_multimodal import multimodal_chat_prompt
from pagedlm.server.structured import check_compiles


async def create_batch_chat_completion(state: ServerState, req: BatchChatCompletionRequest, raw: Request) -> Any:
    if req.stream:
        raise APIError("stream=true is not supported by /v1/chat/completions/batch: send one request per "
                       "conversation to /v1/chat/completions to stream", param="stream")
    if (req.n or 1) != 1:
        raise APIError(f"n={req.n} is not supported by /v1/chat/completions/batch: it must be 1", param="n")
    if req.tools:
        raise APIError("tools are not supported by /v1/chat/completions/batch: send one request per conversation "
                       "to /v1/chat/completions", param="tools")
    params, num_logprobs, _, structured_param = chat_params(state, req)
    if params.structured_outputs is not None:
        await check_compiles(state, params.structured_outputs, structured_param or "structured_outputs")
    check_sequences(state, len(req.messages), 1)
    prompts: list[tuple[dict[str, Any], list[int]]] = []
    for i, conversation in enumerate(req.messages):
        multimodal = await multimodal_chat_prompt(state, req, conversation, params, param=f"messages[{i}]")
        if multimodal is None:
            text, ids = await chat_prompt(state, req, conversation, params, param=f"messages[{i}]")
            prompts.append(({"prompt": text, "prompt_token_ids": ids}, ids))
        else:
            prompts.append((multimodal[0], multimodal[2]))
    priority = request_priority(state, req)
    request_id = random_id("chatcmpl")
    gens = [state.engine.generate(prompt, params, f"{request_id}_{i}", lora_request=state.lora_request(req.model),
                                  priority=priority)
            for i, (prompt, _) in enumerate(prompts)]

    async def collect() -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, out in merge(gens):
            finals[i] = out
        return finals

    try:
        finals = await until_disconnect(raw, collect())
    except EngineDeadError as e:
        return error_response(engine_dead(e))
    if finals is None:  # the client went away
        return JSONResponse({}, status_code=499)
    created = int(time.time())
    choices: list[dict[str, Any]] = []
    totals = [0, 0, 0]  # prompt, completion, cached tokens
    for i, (out, (_, ids)) in enumerate(zip(finals, prompts)):
        if out is None:
            raise APIError(f"no output came back for conversation {i}", status=500)
        builder = _ChatBuilder(state, request_id, created, num_logprobs, ids, return_ids=bool(req.return_token_ids),
                               prompt_logprobs=req.prompt_logprobs is not None, echo=echo_text(req, req.messages[i]),
                               as_ids=state.tokens_as_ids(req),
                               explicit_logprobs=bool(req.logprob_token_ids))
        one = builder.response(out)
        for choice in one["choices"]:
            choices.append({**choice, "index": i})
        totals[0] += one["usage"]["prompt_tokens"]
        totals[1] += one["usage"]["completion_tokens"]
        totals[2] += out.num_cached_tokens
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                         "model": state.response_model(req.model),
                         "choices": choices, "usage": state.usage(*totals), "prompt_logprobs": None,
                         "prompt_token_ids": None})
