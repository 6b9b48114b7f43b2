"""POST /v1/embeddings (OpenAI's) and POST /pooling (vLLM's) for pooling models.

One engine request per input (``{id}-{i}``), every input tokenized and validated before any is
queued. A server of a generative model answers both with a 400 naming the model (and a pooling
model's server refuses completions and chat the same way: ``check_generative``).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagedlm.core import EngineDeadError
from pagedlm.core.pooling_params import PoolingParams
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.server.errors import APIError, error_response
from pagedlm.server.protocol import EmbeddingRequest
from pagedlm.server.serving_common import (
    ServerState,
    bad_request,
    check_engine,
    check_model,
    check_sequences,
    check_text_length,
    engine_dead,
    get_state,
    merge,
    off_loop,
    random_id,
    until_disconnect,
)
from pagedlm.server.serving_common import request_priority as _priority

router = APIRouter()
#: what a pooling prompt is checked against: it must fit the context (the engine runs it as one token)
_PROMPT_ONLY = SamplingParams(max_tokens=1)


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    value = req.input
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError("input=[] is invalid: give at least one input", param="input")
    if isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


def _tokenize(state: ServerState, req: EmbeddingRequest, inputs: list[str | list[int]]) -> list[list[int]]:
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    engine = state.engine
    token_lists = []
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        try:
            if isinstance(item, str):
                ids = engine.tokenize(item, add_special_tokens=add_special)
            else:
                if not item:
                    raise ValueError(f"{where}=[] is invalid: a token-id input needs at least one token")
                ids = list(item)
            engine.validate_prompt(ids, _PROMPT_ONLY)
        except ValueError as e:
            raise bad_request(e, prompt_param=where) from None
        token_lists.append(ids)
    return token_lists


async def _pool(state: ServerState, req: EmbeddingRequest, raw: Request, api: str) -> tuple[list[Any], int] | Any:
    """(the outputs in input order, the number of prompt tokens), or a response to return."""
    check_model(state, req.model)
    check_engine(state)
    if state.engine.model_config.runner != "pooling":
        raise APIError(f"The model {state.model_name!r} is a generative model and does not support the {api}; "
                       "serve an embedding model with --runner pooling (or --task embed / --convert embed)")
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, task="embed")
    try:
        params.verify(state.engine.model_config)
    except ValueError as e:
        raise APIError(str(e), param="dimensions" if req.dimensions is not None else None) from None
    inputs = _inputs(req)
    check_sequences(state, len(inputs), 1)
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            check_text_length(state, len(item), "input" if len(inputs) == 1 else f"input[{i}]")
    token_lists = await off_loop(_tokenize, state, req, inputs)
    priority = _priority(state, req)  # type: ignore[arg-type]
    request_id = random_id("embd")
    gens = [state.engine.encode({"prompt_token_ids": ids}, params, f"{request_id}-{i}", priority=priority)
            for i, ids in enumerate(token_lists)]

    async def collect() -> list[Any]:
        finals: list[Any] = [None] * len(gens)
        async for i, out in merge(gens):
            finals[i] = out
        return finals

    try:
        outputs = await until_disconnect(raw, collect())
    except EngineDeadError as e:
        return error_response(engine_dead(e))
    if outputs is None:
        return JSONResponse({}, status_code=499)
    for out in outputs:
        if out is None or not hasattr(out.outputs, "data"):
            raise APIError(f"pooling failed: {getattr(out, 'error', None) or 'aborted'}", status=500)
    return outputs, sum(len(ids) for ids in token_lists)


def _encode(data: Any, encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        # float32 little-endian bytes, as OpenAI's API sends them (the openai client decodes them)
        return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Any:
    state = get_state(request)
    result = await _pool(state, body, request, "Embeddings API (/v1/embeddings)")
    if not isinstance(result, tuple):
        return result
    outputs, num_tokens = result
    data = [{"object": "embedding", "index": i, "embedding": _encode(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(outputs)]
    return JSONResponse({"id": random_id("embd"), "object": "list", "created": int(time.time()),
                         "model": state.model_name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


@router.post("/pooling")
async def create_pooling(body: EmbeddingRequest, request: Request) -> Any:
    state = get_state(request)
    result = await _pool(state, body, request, "pooling API (/pooling)")
    if not isinstance(result, tuple):
        return result
    outputs, num_tokens = result
    data = [{"object": "pooling", "index": i, "data": _encode(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(outputs)]
    return JSONResponse({"id": random_id("pool"), "object": "list", "created": int(time.time()),
                         "model": state.model_name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}})
