"""POST /invocations: the one route Amazon SageMaker sends every request to (as vLLM serves it).

The body says what it is: ``messages`` is a chat, ``prompt`` a completion, ``input`` an
embeddings request; each is then validated and answered exactly as its own route answers it.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedlm.server.errors import APIError
from pagedlm.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from pagedlm.server.serving_chat import create_chat_completion
from pagedlm.server.serving_common import get_state
from pagedlm.server.serving_completion import create_completion
from pagedlm.server.serving_embedding import create_embeddings

router = APIRouter()

#: the field that tells each kind of request apart, in the order they are tried
KINDS = (("messages", ChatCompletionRequest), ("prompt", CompletionRequest), ("input", EmbeddingRequest))


@router.post("/invocations")
async def invocations(request: Request) -> Any:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise APIError(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object: a chat (with messages), a completion (with prompt) or an "
                       "embeddings request (with input)")
    for field, model in KINDS:
        if field in body:
            req = _validated(model, body)
            if isinstance(req, ChatCompletionRequest):
                return await create_chat_completion(get_state(request), req, request)
            if isinstance(req, CompletionRequest):
                return await create_completion(get_state(request), req, request)
            return await create_embeddings(req, request)
    raise APIError("cannot tell what this request is: send messages (a chat), prompt (a completion) or input "
                   "(embeddings)", param="messages")


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # the same 400 a malformed body gets on the request's own route
        raise RequestValidationError(e.errors()) from None
