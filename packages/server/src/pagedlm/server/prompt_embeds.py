"""``prompt_embeds`` on ``POST /v1/completions`` (vLLM's ``--enable-prompt-embeds``).

Each item is the base64 text of one tensor written by ``torch.save``: ``[num_tokens,
hidden_size]`` (or ``[1, num_tokens, hidden_size]``), float32, bfloat16 or float16, converted to
the model's dtype. A request may give ``prompt_embeds`` and ``prompt`` both; the embeddings'
prompts come first (choice indices too), as in vLLM.

NOTE: ``torch.load`` runs with ``weights_only=True`` (no pickled code) and only dense tensors
are accepted: a sparse tensor's indices are not bounds-checked on load.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from pagedlm.server.errors import APIError


def decode_prompt_embeds(data: Any, where: str) -> torch.Tensor:
    """The tensor in one ``prompt_embeds`` item; a 400 naming ``where`` when it is not one."""
    if not isinstance(data, str) or not data:
        raise APIError(f"{where} must be a non-empty base64 string of a tensor saved with torch.save", param=where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where} is not valid base64", param=where) from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable payload is the client's error
        raise APIError(f"{where} is not a tensor saved with torch.save ({type(e).__name__})", param=where) from None
    if not isinstance(tensor, torch.Tensor):
        raise APIError(f"{where} holds a {type(tensor).__name__}, not a tensor", param=where)
    if tensor.layout != torch.strided:
        raise APIError(f"{where} is a {tensor.layout} tensor: only dense tensors are accepted", param=where)
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise APIError(f"{where} has dtype {tensor.dtype}: float32, bfloat16 or float16 are accepted", param=where)
    return tensor


def prompt_embeds_items(value: Any) -> list[tuple[str, Any]]:
    """(parameter name, item) for each item of the request's ``prompt_embeds``."""
    if isinstance(value, list):
        if not value:
            raise APIError("prompt_embeds=[] is invalid: give at least one", param="prompt_embeds")
        return [(f"prompt_embeds[{i}]", item) for i, item in enumerate(value)]
    return [("prompt_embeds", value)]
