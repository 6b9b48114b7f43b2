"""POST /v1/chat/completions: messages -> chat template -> one engine request with n choices."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedlm.core import EngineDeadError
from pagedlm.core.outputs import RequestOutput, SampleLogprobs
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.text import utf8_problem
from pagedlm.server.chat_choice import ChoiceMessage
from pagedlm.server.errors import APIError, error_response, logger
from pagedlm.server.protocol import ChatCompletionRequest, ChatMessage
from pagedlm.server.serving_common import (
    SSE_DONE,
    ServerState,
    SSEResponse,
    bad_request,
    check_engine,
    check_generative,
    check_model,
    check_sequences,
    check_text_length,
    engine_dead,
    finish_reason,
    finite,
    make_sampling_params,
    off_loop,
    prompt_logprobs_body,
    random_id,
    request_priority,
    sse,
    sse_error,
    token_text,
    top_entries,
    until_disconnect,
    usage,
)
from pagedlm.server.serving_multimodal import multimodal_chat_prompt
from pagedlm.server.structured import check_compiles, request_params
from pagedlm.server.tools import ToolChoice, resolve_tool_choice, template_messages_tool_calls


def check_messages_length(state: ServerState, messages: list[ChatMessage], param: str = "messages") -> None:
    """The character cap of one prompt, applied to the messages' text before templating."""
    num_chars = 0
    for message in messages:
        if isinstance(message.content, str):
            num_chars += len(message.content)
        elif message.content is not None:
            num_chars += sum(len(part.text or "") for part in message.content)
    check_text_length(state, num_chars, param)


def render_chat(state: ServerState, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                param: str = "messages", continue_final_message: bool = False,
                add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Apply the chat template (``--chat-template`` or the tokenizer's); returns (text, token ids).

    ``continue_final_message`` leaves the last message open (vLLM's and transformers' option);
    ``add_special_tokens`` adds the tokenizer's own specials (BOS) to what the template wrote."""
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true: the first continues "
                       "the last message, the second starts a new one", param="continue_final_message")
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError("chat needs a tokenizer, and this server runs without one (skip_tokenizer_init)")
    template = state.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template: start the server with --chat-template FILE "
                       "(LLM.chat takes chat_template=...), or use /v1/completions", param=param)
    conversation = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    hint = ("image_url parts are taken by /v1/chat/completions only"
                            if state.engine.mm_processor is not None
                            else "image_url parts need a multimodal model")
                    raise APIError(f"{param}[{i}].content[{j}].type={part.type!r} is not supported here: text parts "
                                   f"only ({{\"type\": \"text\", \"text\": ...}}); {hint}",
                                   param=f"{param}[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = template_messages_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        conversation.append(entry)
    try:
        extra: dict[str, Any] = dict(template_kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if tools:
            extra["tools"] = tools
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # noqa: BLE001 - jinja's errors (TemplateError, UndefinedError, ...) are bad input
        raise APIError(f"cannot apply the chat template to these messages: {type(e).__name__}: {e}",
                       param=param) from None
    if (problem := utf8_problem(text)) is not None:  # a template can write escapes of its own
        raise APIError(f"the chat template's output {problem}", param=param)
    # The template writes the special tokens (BOS, role markers) itself.
    token_ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    return text, list(token_ids)


def _render_and_truncate(state: ServerState, req: ChatCompletionRequest, messages: list[ChatMessage],
                         add_generation_prompt: bool, param: str) -> tuple[str, list[int]]:
    text, token_ids = render_chat(state, messages, add_generation_prompt=add_generation_prompt, param=param,
                                  continue_final_message=bool(req.continue_final_message), tools=req.tools,
                                  template_kwargs=req.chat_template_kwargs)
    truncated = state.truncate(req, token_ids)
    if len(truncated) < len(token_ids):
        text = state.engine.tokenizer.decode(truncated)
    return text, truncated


def echo_text(req: ChatCompletionRequest, messages: list[ChatMessage]) -> str:
    """vLLM's chat ``echo``: the last message's text when it is the assistant's (what the answer
    continues, with ``continue_final_message``), else nothing."""
    last = messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text or "" for part in last.content)


def chat_params(state: ServerState, req: ChatCompletionRequest
                ) -> tuple[SamplingParams, int | None, ToolChoice, str | None]:
    """The checks of a chat request that do not need its messages; (params, number of logprobs,
    tool choice, the field the params' structured outputs come from)."""
    check_model(state, req.model)
    check_engine(state)
    check_generative(state, "Chat Completions API (/v1/chat/completions)")
    if req.use_beam_search:
        raise APIError("use_beam_search=true is supported on /v1/completions only; leave it false here",
                       param="use_beam_search")
    tool_choice = resolve_tool_choice(req, auto_tool_parser=state.tool_call_parser)
    structured, structured_param = request_params(req, req.response_format)
    if tool_choice.structured_outputs is not None:
        if structured is not None:
            raise APIError(f"tool_choice={req.tool_choice!r} constrains the output to tool calls: it cannot be "
                           f"combined with {structured_param}", param=structured_param)
        structured, structured_param = tool_choice.structured_outputs, "tools"
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_logprobs = state.resolve_logprobs(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
    num_prompt_logprobs = state.resolve_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if num_prompt_logprobs is not None and stream:
        raise APIError("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    params = make_sampling_params(req, max_tokens=max_tokens, logprobs=num_logprobs,
                                  prompt_logprobs=num_prompt_logprobs, stream=stream,
                                  max_logprobs=state.max_logprobs)
    params.structured_outputs = structured
    if tool_choice.mode == "auto" and state.tool_parser_class.needs_special_tokens:  # type: ignore[union-attr]
        params.skip_special_tokens = False  # the parser reads its tags, which are special tokens
    return params, num_logprobs, tool_choice, structured_param


async def chat_prompt(state: ServerState, req: ChatCompletionRequest, messages: list[ChatMessage],
                      params: SamplingParams, param: str = "messages") -> tuple[str, list[int]]:
    """One conversation templated, tokenized (off the event loop), truncated and validated."""
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    check_messages_length(state, messages, param)
    text, token_ids = await off_loop(_render_and_truncate, state, req, messages, add_generation_prompt, param)
    try:
        state.engine.validate_prompt(token_ids, params)
    except ValueError as e:
        error = bad_request(e, prompt_param=param)
        if params.max_tokens is not None and "max_tokens" in error.message:
            error.param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise error from None
    return text, token_ids


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Any:
    params, num_logprobs, tool_choice, structured_param = chat_params(state, req)
    if params.structured_outputs is not None:
        await check_compiles(state, params.structured_outputs, structured_param or "structured_outputs")
    stream = bool(req.stream)
    check_sequences(state, 1, params.n)
    multimodal = await multimodal_chat_prompt(state, req, req.messages, params)
    if multimodal is None:
        text, token_ids = await chat_prompt(state, req, req.messages, params)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
    else:
        prompt, text, token_ids = multimodal
    request_id = random_id("chatcmpl")
    priority = request_priority(state, req)
    gen = state.engine.generate(prompt, params, request_id, lora_request=state.lora_request(req.model),
                                priority=priority)
    builder = _ChatBuilder(state, request_id, int(time.time()), num_logprobs, token_ids,
                           return_ids=bool(req.return_token_ids), prompt_logprobs=req.prompt_logprobs is not None,
                           echo=echo_text(req, req.messages), as_ids=state.tokens_as_ids(req),
                           tool_choice=tool_choice, explicit_logprobs=bool(req.logprob_token_ids))
    builder.model = state.response_model(req.model)
    if stream:
        return SSEResponse(builder.stream(gen, params.n, *state.stream_usage(req)))

    async def collect() -> RequestOutput | None:
        final = None
        async for out in gen:
            final = out
        return final

    try:
        final = await until_disconnect(raw, collect())
    except EngineDeadError as e:
        return error_response(engine_dead(e))
    if final is None:  # the client went away
        return JSONResponse({}, status_code=499)
    return JSONResponse(builder.response(final))


class _ChatBuilder:
    def __init__(self, state: ServerState, request_id: str, created: int, num_logprobs: int | None,
                 prompt_token_ids: list[int], *, return_ids: bool = False, prompt_logprobs: bool = False,
                 echo: str = "", as_ids: bool = False, tool_choice: ToolChoice | None = None,
                 explicit_logprobs: bool = False) -> None:
        self.tool_choice = tool_choice or ToolChoice("none")
        self.prompt_logprobs = prompt_logprobs
        self.echo = echo
        self.as_ids = as_ids
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.engine.tokenizer
        self.model = state.model_name
        self.id = request_id
        self.created = created
        self.num_logprobs = num_logprobs
        #: the request named its logprobs' ids (logprob_token_ids): they replace the top ones
        self.explicit_logprobs = explicit_logprobs
        self.num_prompt_tokens = len(prompt_token_ids)
        #: the prompt's ids when the request asked for token ids (``return_token_ids``), else None
        self.prompt_token_ids = list(prompt_token_ids) if return_ids else None
        self.return_ids = return_ids

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        content = []
        for tid, position in zip(token_ids, logprobs or []):
            entry = position.get(tid)
            text = token_text(self.tokenizer, tid, entry, self.as_ids)
            top = [{"token": (t := token_text(self.tokenizer, alt, lp, self.as_ids)), "logprob": finite(lp.logprob),
                    "bytes": list(t.encode("utf-8"))} for alt, lp in top_entries(position, self.num_logprobs,
                                                                            self.explicit_logprobs)]
            content.append({"token": text, "logprob": finite(entry.logprob) if entry is not None else -9999.0,
                            "bytes": list(text.encode("utf-8")), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _choice_message(self) -> ChoiceMessage:
        state = self.state
        parser = state.tool_parser_class(self.tokenizer) if self.tool_choice.mode == "auto" else None
        return ChoiceMessage(self.tool_choice, state.reasoning_parser, parser)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        if out.error:
            raise APIError(f"generation failed: {out.error}", status=500)
        choices = []
        for c in out.outputs:
            # reasoning (and its older name reasoning_content): null without a reasoning parser, as vLLM
            chosen = self._choice_message()
            message = {"role": "assistant", "refusal": None, **chosen.message(c.text)}
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": chosen.finish_reason(finish_reason(c.finish_reason)),
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if self.return_ids else None,
            })
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        # vLLM's extensions are always there, null unless asked for
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices,
                "usage": self.state.usage(len(out.prompt_token_ids), num_generated, out.num_cached_tokens),
                "prompt_logprobs": (prompt_logprobs_body(self.tokenizer, out.prompt_logprobs)
                                    if self.prompt_logprobs else None),
                "prompt_token_ids": list(out.prompt_token_ids) if self.return_ids else None}
        if out.kv_transfer_params is not None:  # a KV connector's (a prefill instance's): vLLM's field
            body["kv_transfer_params"] = out.kv_transfer_params
        return body

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": choices}
        if include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return body

    async def stream(self, gen: AsyncGenerator[RequestOutput, None], n: int, include_usage: bool,
                     continuous_usage: bool = False):
        """SSE events; an error after the 200 status line is sent in-band, then ``[DONE]``."""
        try:
            async for event in self._events(gen, n, include_usage, continuous_usage):
                yield event
        except (APIError, EngineDeadError) as e:
            yield sse_error(e)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, then end
            logger.exception("chat stream %s failed", self.id)
            yield sse_error(e)
        finally:
            self.engine.abort(self.id)  # however the stream ends (client gone included)
        yield SSE_DONE

    async def _events(self, gen: AsyncGenerator[RequestOutput, None], n: int, include_usage: bool,
                      continuous_usage: bool):
        num_prompt = self.num_prompt_tokens
        generated = [0] * n  # tokens so far per choice (continuous usage)
        # The role comes first, in a chunk of its own for every choice (one choice per chunk, as
        # OpenAI and vLLM send them), with the prompt's ids.
        for i in range(n):
            first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], include_usage)
            first["prompt_token_ids"] = self.prompt_token_ids
            if continuous_usage:
                first["usage"] = usage(num_prompt, 0)
            yield sse(first)
        if self.echo:  # vLLM's echo: the last message's content, a chunk per choice
            for i in range(n):
                chunk = self._chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                      "finish_reason": None}], include_usage)
                if continuous_usage:
                    chunk["usage"] = usage(num_prompt, 0)
                yield sse(chunk)
        finished: set[int] = set()
        chosen = [self._choice_message() for _ in range(n)]
        num_generated = num_cached = 0
        async for out in gen:
            if out.error:
                raise APIError(f"generation failed: {out.error}", status=500)
            num_prompt = len(out.prompt_token_ids)
            num_cached = out.num_cached_tokens
            for c in out.outputs:
                if c.index in finished:
                    continue
                num_generated += len(c.token_ids)
                generated[c.index] += len(c.token_ids)
                reason = finish_reason(c.finish_reason)
                if reason is not None:
                    finished.add(c.index)
                elif not c.text and not c.token_ids:
                    continue  # nothing new (tokens that decode to no text, e.g. half a character, still go out)
                delta = chosen[c.index].delta(c.text, final=reason is not None)
                if not delta and reason is None:
                    delta = {"content": ""}
                reason = chosen[c.index].finish_reason(reason)
                chunk = self._chunk([{"index": c.index, "delta": delta,
                                      "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": reason,
                                      "stop_reason": c.stop_reason,
                                      "token_ids": list(c.token_ids) if self.return_ids else None}], include_usage)
                if continuous_usage:  # vLLM's: this choice's tokens so far
                    chunk["usage"] = usage(num_prompt, generated[c.index])
                yield sse(chunk)
        if include_usage:
            body = self._chunk([], False)
            body["usage"] = self.state.usage(num_prompt, num_generated, num_cached)
            yield sse(body)
