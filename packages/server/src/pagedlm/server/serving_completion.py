"""POST /v1/completions: the legacy text-completion endpoint, as OpenAI serves it.

One engine request per prompt (``{id}-{i}``); choice ``i * n + j`` is choice ``j`` of prompt ``i``.
All prompts are tokenized and validated before any is queued, so a bad prompt is a 400 that
leaves the engine untouched.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedlm.core import EngineDeadError
from pagedlm.core.outputs import PromptLogprobs, RequestOutput, SampleLogprobs
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.server.errors import APIError, error_response, logger
from pagedlm.server.prompt_embeds import decode_prompt_embeds, prompt_embeds_items
from pagedlm.server.protocol import CompletionRequest
from pagedlm.server.serving_beam import beam_search_outputs, beam_search_params
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
    merge,
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
from pagedlm.server.structured import check_compiles, request_params

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    prompt = req.prompt
    assert prompt is not None  # checked first
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt=[] is invalid: give at least one prompt", param="prompt")
    if isinstance(prompt[0], int):
        # NOTE: not copied (nothing changes it; nor in _prepare): a copy of a long prompt that
        # lives as long as its stream is one more list for every garbage collection to walk
        return [prompt]
    return list(prompt)


class _Prompt:
    """One tokenized prompt: its text (decoded for token-id prompts) and token ids; or, for a
    prompt given as embeddings, no text, no ids and its ``[T, hidden]`` tensor."""

    def __init__(self, text: str, token_ids: list[int], embeds: Any = None) -> None:
        self.text = text
        self.token_ids = token_ids
        self.embeds = embeds

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.embeds is None else int(self.embeds.shape[0])

    def engine_input(self) -> dict[str, Any]:
        if self.embeds is not None:
            return {"prompt_embeds": self.embeds}
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def _ids(out: RequestOutput) -> list[int] | None:
    # None for a prompt given as embeddings (it has no ids), as vLLM returns it
    return list(out.prompt_token_ids) if out.prompt_token_ids is not None else None


def _where(req: CompletionRequest, i: int) -> str:
    return "prompt" if not isinstance(req.prompt, list) or isinstance(req.prompt[0], int) else f"prompt[{i}]"


def _prepare(state: ServerState, req: CompletionRequest, params: SamplingParams,
             raw_prompts: list[str | list[int]], need_text: bool) -> list[_Prompt]:
    """Decode the embeddings prompts, tokenize the others, validate every one (slow for long
    prompts: run it off the event loop). A token-id prompt's text (echo, logprobs' offsets) is
    decoded only when ``need_text``."""
    engine = state.engine
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    prompts = []
    if req.prompt_embeds is not None:
        if not engine.vllm_config.model_config.enable_prompt_embeds:
            raise APIError("prompt_embeds needs the server started with --enable-prompt-embeds", param="prompt_embeds")
        for where, item in prompt_embeds_items(req.prompt_embeds):
            tensor = decode_prompt_embeds(item, where)
            if req.truncate_prompt_tokens is not None and tensor.dim() >= 2:
                kept = state.truncate(req, list(range(tensor.shape[-2])))  # the rows to keep
                tensor = tensor[..., kept[0] : kept[-1] + 1, :] if kept else tensor[..., :0, :]
            try:
                prompts.append(_Prompt("", [], engine.validate_prompt_embeds(tensor, params)))
            except ValueError as e:
                error = bad_request(e, prompt_param=where)
                if error.param in ("prompt", "prompt_embeds"):
                    error.param = where  # this item's, not the request's
                raise error from None
    for i, raw in enumerate(raw_prompts):
        where = _where(req, i)
        try:
            if isinstance(raw, str):
                full = engine.tokenize(raw, add_special_tokens=add_special)
                ids = state.truncate(req, full)
                engine.validate_prompt(ids, params)
                text = raw if len(ids) == len(full) else engine.tokenizer.decode(ids)
            else:
                if not raw:
                    raise ValueError(f"{where}=[] is invalid: a token-id prompt needs at least one token")
                ids = state.truncate(req, raw)
                engine.validate_prompt(ids, params)  # checks the vocabulary range, which decode needs
                text = engine.tokenizer.decode(ids) if need_text and engine.tokenizer is not None else ""
        except ValueError as e:
            raise bad_request(e, prompt_param=where) from None
        prompts.append(_Prompt(text, ids))
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Any:
    check_model(state, req.model)
    check_engine(state)
    check_generative(state, "Completions API (/v1/completions)")
    if req.prompt is None and req.prompt_embeds is None:
        raise APIError("prompt is required (or prompt_embeds)", param="prompt")
    if req.suffix is not None:
        raise APIError("suffix is not supported by this server: leave it null", param="suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise APIError(f"best_of={req.best_of} is not supported: it must equal n={n} (or be left out)",
                       param="best_of")
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")
    echo = bool(req.echo)
    num_logprobs = state.resolve_logprobs(req.logprobs, "logprobs")
    # vLLM's: the prompt's logprobs when asked, else (for echo) as many as the generated tokens'
    num_prompt_logprobs = state.resolve_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if num_prompt_logprobs is not None and stream:
        raise APIError("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
    if num_prompt_logprobs is None and echo:
        num_prompt_logprobs = num_logprobs
    beam_params = (beam_search_params(req, n, req.max_tokens or DEFAULT_MAX_TOKENS, stream)
                   if req.use_beam_search else None)
    params = make_sampling_params(req, max_tokens=req.max_tokens or DEFAULT_MAX_TOKENS, logprobs=num_logprobs,
                                  prompt_logprobs=num_prompt_logprobs, stream=stream,
                                  max_logprobs=state.max_logprobs)
    params.structured_outputs, structured_param = request_params(req)
    if params.structured_outputs is not None:
        await check_compiles(state, params.structured_outputs, structured_param or "structured_outputs")
    raw_prompts = _prompts(req) if req.prompt is not None else []
    num_embeds = len(prompt_embeds_items(req.prompt_embeds)) if req.prompt_embeds is not None else 0
    check_sequences(state, num_embeds + len(raw_prompts), n)
    for i, text in enumerate(raw_prompts):
        if isinstance(text, str):
            check_text_length(state, len(text), _where(req, i))
    need_text = echo or num_logprobs is not None
    if req.prompt_embeds is None and not need_text and all(isinstance(raw, list) for raw in raw_prompts):
        # NOTE: token ids only need checking (what pydantic just did to them on this loop, once
        # more): a hop to the tokenizer thread would cost each request a wait for the GIL, held
        # by this loop while it streams (256 requests at once: admission took 0.1-0.3 s longer).
        prompts = _prepare(state, req, params, raw_prompts, need_text)
    else:
        prompts = await off_loop(_prepare, state, req, params, raw_prompts, need_text)
    priority = request_priority(state, req)
    request_id = random_id("cmpl")
    created = int(time.time())
    if beam_params is not None:
        builder = _Builder(state, req, prompts, n, echo, request_id, created, None)
        try:
            beams = await until_disconnect(raw, beam_search_outputs(state, prompts, beam_params, request_id, priority))
        except EngineDeadError as e:
            return error_response(engine_dead(e))
        if beams is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse(builder.response(beams))
    gens = [
        state.engine.generate(p.engine_input(), params, f"{request_id}-{i}",
                              lora_request=state.lora_request(req.model), priority=priority)
        for i, p in enumerate(prompts)
    ]
    builder = _Builder(state, req, prompts, n, echo, request_id, created, num_logprobs)
    if stream:
        return SSEResponse(builder.stream(gens, *state.stream_usage(req)))

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, out in merge(gens):
            finals[i] = out
        return [f for f in finals if f is not None]

    try:
        outputs = await until_disconnect(raw, collect())
    except EngineDeadError as e:
        return error_response(engine_dead(e))
    if outputs is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    return JSONResponse(builder.response(outputs))


class _Builder:
    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[_Prompt], n: int, echo: bool,
                 request_id: str, created: int, num_logprobs: int | None) -> None:
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.engine.tokenizer
        self.model = state.response_model(req.model)
        self.req = req
        self.prompts = prompts
        self.n = n
        self.echo = echo
        self.id = request_id
        self.created = created
        self.num_logprobs = num_logprobs
        #: the request named its logprobs' ids (logprob_token_ids): they replace the top ones
        self.explicit_logprobs = bool(req.logprob_token_ids)
        self.return_ids = bool(req.return_token_ids)
        self.as_ids = state.tokens_as_ids(req)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    # -- logprobs ---------------------------------------------------------------------------
    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | PromptLogprobs,
                  offset: int, explicit: bool = False) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy logprobs object for some tokens; returns it and the next text offset.
        ``explicit``: generated tokens of a request with ``logprob_token_ids``."""
        k = self.num_logprobs or 0
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, position in zip(token_ids, logprobs):
            entry = position.get(tid) if position is not None else None
            text = token_text(self.tokenizer, tid, entry, self.as_ids)
            body["tokens"].append(text)
            # The first prompt token has no logprob (nothing precedes it): null, as OpenAI sends.
            body["token_logprobs"].append(finite(entry.logprob) if entry is not None else None)
            if position is None:
                body["top_logprobs"].append(None)
            else:
                # the position's own token first (as vLLM writes it), then the top-k
                top = {text: finite(entry.logprob)} if entry is not None else {}
                for t, lp in top_entries(position, k, explicit):
                    top.setdefault(token_text(self.tokenizer, t, lp, self.as_ids), finite(lp.logprob))
                body["top_logprobs"].append(top)
            body["text_offset"].append(offset)
            offset += len(text)
        return body, offset

    def _choice_logprobs(self, out: RequestOutput, c: Any, prompt: _Prompt, first: bool,
                         offset: int) -> tuple[dict[str, Any], int]:
        """Logprobs of a choice's (new) tokens, preceded by the prompt's when echoing its first part."""
        parts = []
        if self.echo and first:
            prompt_logprobs = out.prompt_logprobs or [None] * len(prompt.token_ids)
            part, offset = self._logprobs(prompt.token_ids, prompt_logprobs, 0)
            parts.append(part)
        part, offset = self._logprobs(c.token_ids, c.logprobs or [], offset, self.explicit_logprobs)
        parts.append(part)
        if len(parts) == 1:
            return parts[0], offset
        return {key: parts[0][key] + parts[1][key] for key in parts[1]}, offset

    # -- non-streaming ------------------------------------------------------------------------
    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        num_prompt = num_generated = num_cached = 0
        for i, (out, prompt) in enumerate(zip(outputs, self.prompts)):
            if out.error:
                raise APIError(f"generation failed: {out.error}", status=500)
            num_prompt += prompt.num_tokens
            num_cached += out.num_cached_tokens
            for c in out.outputs:
                num_generated += len(c.token_ids)
                logprobs = None
                if self.num_logprobs is not None:
                    start = 0 if self.echo else len(prompt.text)
                    logprobs, _ = self._choice_logprobs(out, c, prompt, True, start)
                # vLLM's extensions are always there, null unless asked for
                choices.append({"index": i * self.n + c.index,
                                "text": (prompt.text if self.echo else "") + c.text,
                                "logprobs": logprobs,
                                "finish_reason": finish_reason(c.finish_reason),
                                "stop_reason": c.stop_reason,
                                "prompt_logprobs": (prompt_logprobs_body(self.tokenizer, out.prompt_logprobs)
                                                    if self.req.prompt_logprobs is not None else None),
                                "prompt_token_ids": _ids(out) if self.return_ids else None,
                                "token_ids": list(c.token_ids) if self.return_ids else None})
        body = self._envelope(sorted(choices, key=lambda c: c["index"]))
        body["usage"] = self.state.usage(num_prompt, num_generated, num_cached)
        kv_params = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params is not None), None)
        if kv_params is not None:  # a KV connector's (a prefill instance's): vLLM's field
            body["kv_transfer_params"] = kv_params
        return body

    # -- streaming ----------------------------------------------------------------------------
    async def stream(self, gens: list[AsyncGenerator[RequestOutput, None]], include_usage: bool,
                     continuous_usage: bool = False):
        """SSE events; an error after the 200 status line is sent in-band, then ``[DONE]``."""
        try:
            async for event in self._events(gens, include_usage, continuous_usage):
                yield event
        except (APIError, EngineDeadError) as e:
            yield sse_error(e)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, then end
            logger.exception("completion stream %s failed", self.id)
            yield sse_error(e)
        finally:
            # However the stream ends (client gone included), nothing of it keeps running.
            for i in range(len(gens)):
                self.engine.abort(f"{self.id}-{i}")
        yield SSE_DONE

    async def _events(self, gens: list[AsyncGenerator[RequestOutput, None]], include_usage: bool,
                      continuous_usage: bool):
        started: set[int] = set()
        generated: dict[int, int] = {}  # choice index -> tokens so far (continuous usage)
        cached: dict[int, int] = {}  # prompt -> its prefix-cache hit
        finished: set[int] = set()
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token (logprobs)
        ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (in their first chunk)
        num_prompt = num_generated = 0
        async for i, out in merge(gens):
            prompt = self.prompts[i]
            if out.error:
                raise APIError(f"generation failed: {out.error}", status=500)
            for c in out.outputs:
                index = i * self.n + c.index
                if index in finished:
                    continue
                text, logprobs = c.text, None
                first = index not in started
                if first:
                    started.add(index)
                    if c.index == 0:
                        num_prompt += prompt.num_tokens
                    generated[index] = 0
                    offsets[index] = 0 if self.echo else len(prompt.text)
                    if self.echo:
                        text = prompt.text + text
                if self.num_logprobs is not None:
                    logprobs, offsets[index] = self._choice_logprobs(out, c, prompt, first, offsets[index])
                num_generated += len(c.token_ids)
                generated[index] += len(c.token_ids)
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                reason = finish_reason(c.finish_reason)
                if reason is not None:
                    finished.add(index)
                if not text and not c.token_ids and reason is None and logprobs is None:
                    continue  # nothing new (a chunk of tokens that decode to no text still goes out)
                prompt_ids = None
                if self.return_ids and index not in ids_sent:
                    ids_sent.add(index)
                    prompt_ids = _ids(out)
                # One choice per chunk, as OpenAI and vLLM send them: clients read choices[0].
                body = self._envelope([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                        "stop_reason": c.stop_reason, "prompt_token_ids": prompt_ids,
                                        "token_ids": list(c.token_ids) if self.return_ids else None}])
                if continuous_usage:  # vLLM's: this choice's tokens so far, with its prompt's
                    body["usage"] = usage(prompt.num_tokens, generated[index])
                yield sse(body)
        if include_usage:
            body = self._envelope([])
            body["usage"] = self.state.usage(num_prompt, num_generated, sum(cached.values()))
            yield sse(body)
