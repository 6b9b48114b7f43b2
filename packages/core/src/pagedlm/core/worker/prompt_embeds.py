"""Prompt embeddings (``LLM(enable_prompt_embeds=True)``, ``{"prompt_embeds": tensor}``) in the
base model runner's forward pass.

A prompt given as embeddings reaches the runner with placeholder token ids (zeros) and its
``[T, hidden]`` tensor. For each step, :func:`gather_step_prompt_embeds` collects the rows of the
prompt positions the step computes (chunk by chunk, from any prefix-cache hit on), and
:func:`input_embeddings_override` makes the model's embedding lookup return them at those flat
token positions: the model body's ``get_input_embeddings(input_ids)`` (which every decoder body
calls first in its forward) is wrapped for that one forward pass. Generated tokens are ordinary
ids. The embeddings replace the output of ``get_input_embeddings`` as a whole, scaling included
(Gemma), as in vLLM: embeddings taken from the model's own input embeddings reproduce its ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def embedding_body(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose ``get_input_embeddings`` the model's forward calls, or None."""
    body = getattr(model, "model", None)
    if isinstance(body, torch.nn.Module) and callable(getattr(body, "get_input_embeddings", None)):
        return body
    return None


def gather_step_prompt_embeds(step: Any, requests: Mapping[str, Any], device: torch.device,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat token indices ``[N]``, embeddings ``[N, hidden]``) of the step's prompt-embedding
    positions, on ``device``; None when the step has none."""
    indices: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for b, req_id in enumerate(step.req_ids):
        embeds = requests[req_id].prompt_embeds
        if embeds is None:
            continue
        start = int(step.num_computed[b])
        end = min(start + int(step.num_scheduled[b]), embeds.shape[0])
        if end <= start:
            continue  # decoding: generated tokens are ids
        first = int(step.query_start_loc[b])
        indices.append(torch.arange(first, first + end - start, dtype=torch.int64))
        rows.append(embeds[start:end])
    if not indices:
        return None
    return (torch.cat(indices).to(device, non_blocking=True),
            torch.cat(rows).to(device=device, dtype=dtype, non_blocking=True))


@contextlib.contextmanager
def input_embeddings_override(body: torch.nn.Module, indices: torch.Tensor, embeds: torch.Tensor) -> Iterator[None]:
    """For the forward passes inside: ``body.get_input_embeddings(ids)`` with rows ``indices``
    replaced by ``embeds``."""
    original: Any = body.get_input_embeddings  # the bound method of the class

    def get_input_embeddings(input_ids: torch.Tensor) -> torch.Tensor:
        out = original(input_ids)
        return out.index_copy(0, indices, embeds.to(out.dtype))

    # NOTE: an instance attribute shadows the method for calls through ``self`` in forward.
    object.__setattr__(body, "get_input_embeddings", get_input_embeddings)
    try:
        yield
    finally:
        object.__delattr__(body, "get_input_embeddings")


def forward_with_embeddings(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                            embeds: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    """``model(input_ids, positions)``, with the rows ``embeds = (indices, rows)`` of its
    embedding lookup replaced (None: as it is)."""
    if embeds is None:
        return model(input_ids, positions)
    body = embedding_body(model)
    assert body is not None
    with input_embeddings_override(body, *embeds):
        return model(input_ids, positions)
