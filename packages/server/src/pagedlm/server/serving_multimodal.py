"""Chat messages with image parts on /v1/chat/completions and /tokenize (multimodal models).

The conversation is templated and its images loaded (data URLs; files and http(s) only where the
engine's ``--allowed-local-media-path`` / ``--allowed-media-domains`` allow) by core's chat
handling, then processed once here for the expanded prompt ids the request is validated and
billed by; any bad part or image is a 400 naming it (``pagedlm.core.multimodal``).
"""

from __future__ import annotations

from typing import Any

from pagedlm.core.multimodal.chat import has_image_parts, render_multimodal_chat
from pagedlm.core.multimodal.prompt import process_multimodal_prompt
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.server.errors import APIError
from pagedlm.server.protocol import ChatCompletionRequest, ChatMessage
from pagedlm.server.serving_common import ServerState, bad_request, off_loop


def _render(state: ServerState, conversation: list[dict[str, Any]], *, add_generation_prompt: bool,
            continue_final_message: bool, param: str) -> tuple[dict[str, Any], list[int]]:
    engine = state.engine
    mm_processor = engine.mm_processor
    model_config = engine.vllm_config.model_config
    prompt = render_multimodal_chat(engine.tokenizer, mm_processor, model_config, conversation,
                                    chat_template=state.chat_template, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, param=param)
    _, token_ids, _ = process_multimodal_prompt(mm_processor, model_config, prompt, add_special_tokens=False)
    # the expanded ids (one placeholder token per image position) go to the engine as they are
    return {**prompt, "prompt_token_ids": token_ids}, token_ids


def _image_conversation(state: ServerState, messages: list[ChatMessage]) -> list[dict[str, Any]] | None:
    """The messages as dicts when they have image parts and the model takes images, else None."""
    if state.engine.mm_processor is None:
        return None  # a text model: the text path refuses image parts, naming them
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    return conversation if has_image_parts(conversation) else None


def multimodal_chat_tokens(state: ServerState, messages: list[ChatMessage], *, add_generation_prompt: bool,
                           continue_final_message: bool, param: str = "messages") -> list[int] | None:
    """/tokenize of a conversation with image parts: the prompt ids the engine would run, each
    image's placeholder expanded; None when it has none."""
    conversation = _image_conversation(state, messages)
    if conversation is None:
        return None
    try:
        return _render(state, conversation, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, param=param)[1]
    except ValueError as e:
        raise bad_request(e, prompt_param=param) from None


async def multimodal_chat_prompt(state: ServerState, req: ChatCompletionRequest, messages: list[ChatMessage],
                                 params: SamplingParams, param: str = "messages"
                                 ) -> tuple[dict[str, Any], str, list[int]] | None:
    """(engine prompt, prompt text, prompt token ids) of a conversation with image parts; None
    when it has none (the text-only path handles it)."""
    conversation = _image_conversation(state, messages)
    if conversation is None:
        return None
    if req.truncate_prompt_tokens is not None:
        raise APIError("truncate_prompt_tokens is not supported with image content parts",
                       param="truncate_prompt_tokens")
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        prompt, token_ids = await off_loop(_render, state, conversation, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=bool(req.continue_final_message), param=param)
        state.engine.validate_prompt(token_ids, params, has_mm_data=True)
    except ValueError as e:
        raise bad_request(e, prompt_param=param) from None
    return prompt, prompt["prompt"], token_ids
