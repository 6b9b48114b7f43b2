"""What completions and chat share: server state, parameter mapping, SSE, disconnects, logprobs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedlm.core import EngineClient, EngineDeadError
from pagedlm.core.outputs import Logprob
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.server.errors import APIError, error_body, param_of_message, short_repr
from pagedlm.server.protocol import MAX_LOGPROBS, SamplingFields

T = TypeVar("T")

# What OpenAI reports for a logprob too small to represent (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    """Everything the route handlers need, kept on ``app.state.server``."""

    engine: EngineClient
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's template when set
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None  # pagedlm.server.metrics.PrometheusStatLogger
    #: most sequences (prompts x n) one request may create; None: no limit (--max-request-sequences)
    max_request_sequences: int | None = None
    #: usage.prompt_tokens_details (cached tokens) in every usage (--enable-prompt-tokens-details)
    enable_prompt_tokens_details: bool = False
    #: every stream carries usage, on each chunk and in a last chunk (--enable-force-include-usage)
    enable_force_include_usage: bool = False
    #: most logprobs per position a request may ask for; -1: the vocabulary size (--max-logprobs)
    max_logprobs: int = MAX_LOGPROBS
    #: the LoRA adapters served as models of their own (pagedlm.server.lora.LoRAModels; --enable-lora)
    lora: Any = None
    #: logprobs write tokens as ``token_id:<id>`` unless a request says otherwise
    #: (--return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    #: GET /tokenizer_info is served (--enable-tokenizer-info-endpoint)
    enable_tokenizer_info_endpoint: bool = False
    #: generation requests in flight are counted for GET /load (--enable-server-load-tracking)
    enable_server_load_tracking: bool = False
    server_load: int = 0

    def lora_request(self, model: str | None) -> Any:
        """The ``LoRARequest`` a request's ``model`` selects (None: the base model)."""
        return self.lora.adapters.get(model) if self.lora is not None and model is not None else None

    def response_model(self, model: str | None) -> str:
        """The ``model`` of a response: the adapter's name when one was selected (as vLLM's)."""
        return model if model is not None and self.lora_request(model) is not None else self.model_name
    #: --tool-call-parser's name when --enable-auto-tool-choice is on (tool_choice="auto"), and its class
    tool_call_parser: str | None = None
    tool_parser_class: Any = None
    #: the --reasoning-parser (a ReasoningParser, shared: it keeps no per-request state), or None
    reasoning_parser: Any = None

    def tokens_as_ids(self, req: Any) -> bool:
        """Whether a request's logprobs write tokens as ``token_id:<id>``: its own
        ``return_tokens_as_token_ids``, else the server's default."""
        value = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if value is None else bool(value)

    def resolve_logprobs(self, value: int | None, param: str) -> int | None:
        """A logprobs count of a request: -1 means the whole vocabulary, as in vLLM; more than
        --max-logprobs is a 400."""
        if value is None:
            return None
        vocab = self.engine.vocab_size
        count = vocab if value == -1 else value
        limit = vocab if self.max_logprobs == -1 else self.max_logprobs
        if count > limit:
            asked = f"{param}=-1 asks for all {vocab} tokens" if value == -1 else f"{param}={value} is too many"
            raise APIError(f"{asked}: at most {limit} logprobs per position are allowed (the server's "
                           "--max-logprobs; -1 there allows the whole vocabulary)", param=param)
        return count

    def truncate(self, req: SamplingFields, token_ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep that many tokens (-1: max_model_len - 1), from
        ``truncation_side`` (default the tokenizer's, else the start: 'right' truncation)."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return token_ids
        max_len = self.engine.max_model_len
        if keep == -1:
            keep = max_len - 1
        if keep > max_len:
            raise APIError(f"truncate_prompt_tokens={keep} is invalid: must be at most max_model_len={max_len} "
                           "(or -1: max_model_len - 1)", param="truncate_prompt_tokens")
        if len(token_ids) <= keep:
            return token_ids
        side = req.truncation_side or getattr(self.engine.tokenizer, "truncation_side", None) or "right"
        return token_ids[len(token_ids) - keep:] if side == "left" else token_ids[:keep]

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """A usage object; ``prompt_tokens_details`` only with --enable-prompt-tokens-details, and
        then always (``cached_tokens: 0`` too), as vLLM does."""
        return usage(prompt_tokens, completion_tokens, cached_tokens if self.enable_prompt_tokens_details else None)

    def stream_usage(self, req: SamplingFields) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage on every chunk) for a streamed request."""
        if self.enable_force_include_usage:
            return True, True
        options = req.stream_options
        include = bool(options and options.include_usage)
        return include, include and bool(options and options.continuous_usage_stats)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.served_model_names and state.lora_request(model) is None:
        # (quoted cut short: a client's megabyte of "model" must not come back in the error)
        shown = model if len(model) <= 200 else model[:197] + "..."
        served = state.served_model_names + (list(state.lora.adapters) if state.lora is not None else [])
        raise APIError(f"The model `{shown}` does not exist. This server serves: {', '.join(served)}",
                       status=404, param="model", code="model_not_found")


def check_generative(state: ServerState, api: str) -> None:
    """A 400 when the served model is a pooling model (``api`` needs a generative one)."""
    if state.engine.model_config.runner == "pooling":
        raise APIError(f"The model {state.model_name!r} is a pooling (embedding) model and does not support the "
                       f"{api}; use /v1/embeddings or /pooling, or serve it with --runner generate")


def check_engine(state: ServerState) -> None:
    dead = state.engine.dead_error
    if dead is not None:
        raise engine_dead(dead)


def engine_dead(error: BaseException) -> APIError:
    return APIError(f"the engine is not available: {error}", status=503)


# A text longer than this many characters per token of the context cannot fit it (a token is
# rarely more than a few characters; only runs like 32 spaces come close to this), so it is
# refused before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 32


def check_text_length(state: ServerState, num_chars: int, param: str) -> None:
    limit = MAX_CHARS_PER_TOKEN * state.engine.max_model_len
    if num_chars > limit:
        raise APIError(f"{param} is {num_chars} characters long; at most {limit} are accepted "
                       f"({MAX_CHARS_PER_TOKEN} characters per token of max_model_len={state.engine.max_model_len}), "
                       "and even that many would not fit unless tokens averaged that long", param=param)


def check_sequences(state: ServerState, num_prompts: int, n: int) -> None:
    """Bound the work one request creates: every prompt runs n sequences in the engine."""
    limit = state.max_request_sequences
    if limit is not None and num_prompts * n > limit:
        raise APIError(f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; at "
                       f"most {limit} are allowed per request (the server's --max-request-sequences)",
                       param="n" if n > limit or num_prompts == 1 else "prompt")


# One worker: tokenizers are not documented as thread-safe, and one thread also bounds how much
# CPU the preparation of requests can take from the event loop and the engine.
_tokenizer_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-tokenize")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the tokenizer thread: tokenizing, templating or decoding a
    long text takes long enough to stall every other request (and /health) on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_tokenizer_thread, functools.partial(fn, *args, **kwargs))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- parameters --------------------------------------------------------------------------------
# A token id written as a string: ASCII digits only. int() would also take " 7", "+7", "7_0" and
# other scripts' digits ("\u0667"), which no client means as a token id.
_TOKEN_ID_KEY = re.compile(r"[0-9]+")


def parse_logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """Token id -> bias; every bad key and bias is named in one 400, not just the first."""
    if raw is None:
        return None
    bias: dict[int, float] = {}
    bad_keys, bad_values = [], []
    for key, value in raw.items():
        if _TOKEN_ID_KEY.fullmatch(key) is None:
            bad_keys.append(short_repr(key))
        elif not -100.0 <= value <= 100.0:
            bad_values.append(f"{short_repr(key)}: {value}")
        else:
            bias[int(key)] = float(value)
    problems = []
    if bad_keys:
        problems.append(f"keys {', '.join(bad_keys)} are not token ids (keys must be non-negative integers "
                        "written with the digits 0-9 only)")
    if bad_values:
        problems.append(f"biases {{{', '.join(bad_values)}}} are outside [-100, 100]")
    if problems:
        raise APIError(f"logit_bias is invalid: {'; '.join(problems)}", param="logit_bias")
    return bias


def make_sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, stream: bool, max_logprobs: int = -1) -> SamplingParams:
    """SamplingParams from the request; ``SamplingParams``' own checks become 400s.
    ``max_logprobs``: the server's --max-logprobs, which bounds ``logprob_token_ids`` too."""
    if req.logprob_token_ids and logprobs is None:
        raise APIError("logprob_token_ids needs logprobs (logprobs=true in a chat request, logprobs=N in a completion "
                       "request): it chooses which logprobs each generated token returns", param="logprob_token_ids")
    if req.logprob_token_ids and max_logprobs != -1 and len(req.logprob_token_ids) > max_logprobs:
        raise APIError(f"logprob_token_ids has {len(req.logprob_token_ids)} ids; at most --max-logprobs={max_logprobs} "
                       "are allowed", param="logprob_token_ids")
    top_k = req.top_k if req.top_k not in (None, 0) else -1  # vLLM: 0 and -1 both disable
    kwargs: dict[str, Any] = dict(
        n=req.n or 1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=parse_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        logprob_token_ids=req.logprob_token_ids,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        extra_args=req.vllm_xargs,
    )
    if req.kv_transfer_params is not None:  # the KV connector reads them there, as vLLM's
        kwargs["extra_args"] = {"kv_transfer_params": req.kv_transfer_params}
    if isinstance(req.stop, list) and len(req.stop) > 64:
        raise APIError(f"stop has {len(req.stop)} strings; at most 64 are allowed", param="stop")
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise bad_request(e) from None


def request_priority(state: ServerState, req: SamplingFields) -> int:
    """The request's ``priority`` (0 when left out); nonzero under fcfs is a 400, as in vLLM."""
    from pagedlm.core.engine.processor import check_priority

    priority = req.priority or 0
    try:
        check_priority(priority, state.engine.scheduling_policy)
    except ValueError as e:
        raise APIError(str(e), param="priority") from None
    return priority


def bad_request(e: ValueError, *, prompt_param: str = "prompt") -> APIError:
    message = str(e)
    param = param_of_message(message)
    if "+ max_tokens (" in message:
        param = "max_tokens"  # prompt + max_tokens exceed the context: max_tokens is what to change
    elif param == "prompt":
        param = prompt_param
    return APIError(message, param=param)


def finish_reason(reason: str | None) -> str | None:
    # OpenAI knows stop and length; an abort only happens when the client is gone.
    return None if reason is None else ("length" if reason == "length" else "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """A usage object; with ``cached_tokens`` (not None) also ``prompt_tokens_details``."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


# -- logprobs ----------------------------------------------------------------------------------
def finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def token_text(tokenizer: Any, token_id: int, entry: Logprob | None, as_id: bool = False) -> str:
    """A token's text in logprobs (vLLM's ``return_tokens_as_token_ids``: ``token_id:<id>``)."""
    if as_id:
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def prompt_logprobs_body(tokenizer: Any, prompt_logprobs: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position (null first: nothing precedes it),
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token and the top-k."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else {
        str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": token_text(tokenizer, tid, lp)}
        for tid, lp in position.items()} for position in prompt_logprobs]


def top_entries(position: dict[int, Logprob], k: int, explicit: bool = False) -> list[tuple[int, Logprob]]:
    """The top-``k`` alternatives at one position, best first (rank 1..k); with ``explicit``
    (the request's ``logprob_token_ids``) every entry: the sampled token's, then the asked ids."""
    if explicit:
        return list(position.items())
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and 1 <= lp.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


# -- SSE and concurrency -----------------------------------------------------------------------
# NOTE: compact JSON with non-ASCII text as UTF-8, as json.dumps(ensure_ascii=False,
# separators=(",", ":")) writes it, about ten times faster (one event per request per engine step).
_json_encoder = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_json_encoder.encode(payload).decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator when it ends.

    When a client disconnects, Starlette cancels the send in progress and leaves the generator
    suspended at its ``yield``; closing it here runs its ``finally`` (which aborts the request
    in the engine) now, rather than whenever the garbage collector finalizes it.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse_error(error: BaseException) -> str:
    if isinstance(error, APIError):
        return sse(error_body(error.message, status=error.status, param=error.param, code=error.code))
    if isinstance(error, EngineDeadError):
        return sse(error_body(f"the engine is not available: {error}", status=503))
    return sse(error_body(f"internal server error ({type(error).__name__}); see the server log", status=500))


async def merge(generators: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async generators as they come, tagged with the generator's index.

    One task per generator; when the consumer stops (or is cancelled) every task is cancelled,
    which closes its generator (for ``AsyncLLM.generate``: aborts the request).
    """
    if len(generators) == 1:
        async for item in generators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, gen: AsyncGenerator[T, None]) -> None:
        try:
            async for item in gen:
                await queue.put((index, item, None, False))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer below
            await queue.put((index, None, e, True))
            return
        await queue.put((index, None, None, True))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item, error, done = await queue.get()
            if error is not None:
                raise error
            if done:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` unless the client disconnects first; then cancel it and return None.

    Cancelling a non-streaming request's work closes its ``generate`` calls, which aborts them
    in the engine: a client that gives up does not keep holding KV blocks.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(BaseException):
        await task
    return None
