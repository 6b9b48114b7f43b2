"""``{"prompt": str | "prompt_token_ids": [...], "multi_modal_data": {...}}`` -> token ids and items."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedlm.core.multimodal.inputs import MultiModalFeature
from pagedlm.core.multimodal.processing import BaseMultiModalProcessor
from pagedlm.core.text import utf8_problem

_FIELDS = {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}


def process_multimodal_prompt(processor: BaseMultiModalProcessor | None, model_config: Any, prompt: Mapping[str, Any],
                              *, add_special_tokens: bool = True) -> tuple[str | None, list[int],
                                                                             list[MultiModalFeature]]:
    """(prompt text or None, placeholder-expanded token ids, items); ``ValueError`` for bad input."""
    if processor is None:
        archs = ", ".join(model_config.architectures) or "this model"
        raise ValueError(f"multi_modal_data: {archs} is not a multimodal model (it takes text only)")
    extra = sorted(set(prompt) - _FIELDS)
    if extra:
        raise ValueError(f"a multimodal prompt takes {sorted(_FIELDS)}; got unknown fields {extra}")
    text = prompt.get("prompt")
    token_ids = prompt.get("prompt_token_ids")
    if text is None and token_ids is None:
        raise ValueError("a prompt with multi_modal_data needs 'prompt' (text) or 'prompt_token_ids'")
    # NOTE: with both, the ids are processed and the text is what outputs report (LLM.chat and
    # the server tokenize the template's text themselves, without the tokenizer's own specials).
    if token_ids is not None:
        if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        source: str | list[int] = list(token_ids)
    else:
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompt must be a non-empty string, got {text!r:.40}")
        if (problem := utf8_problem(text)) is not None:
            raise ValueError(f"prompt {problem}")
        source = text
    try:
        ids, features = processor.apply(source, prompt["multi_modal_data"], add_special_tokens=add_special_tokens)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"multi_modal_data could not be processed: {type(e).__name__}: {e}") from e
    return (text if isinstance(text, str) else None), ids, features
