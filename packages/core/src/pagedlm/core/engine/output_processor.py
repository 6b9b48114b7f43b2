"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (text, logprobs, stop strings, n > 1).

It runs once per engine step for every request of the step, so each request costs what changed
for it: its new tokens are appended and detokenized, and a ``RequestOutput`` is built only when
one is sent — for ``FINAL_ONLY`` once, when the request finishes; for streamed requests
(``DELTA``, ``CUMULATIVE``) every step, or with ``stream_interval=N`` once at least N new tokens
have collected since the last one (and on the first token, and when the request finishes). The
tokens in between are merged into that output: nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.engine.detokenizer import Decode, IncrementalDetokenizer, make_decode
from pagedlm.core.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagedlm.core.pooling_params import PoolingParams
from pagedlm.core.sample.logprobs import LogprobsLists
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.core.sched import EngineCoreOutput


@dataclass
class _SequenceState:
    """One generated sequence (a request, or one of the n children of a parent request)."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: tokens (and, for DELTA, characters of text) already in an output sent to the user
    sent_tokens: int = 0
    sent_text: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    sequences: dict[str, _SequenceState]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None
    #: sequences not finished yet (kept as a count: finished is read for every request, every step)
    num_unfinished: int = 0
    #: the sequences in output order (their index)
    ordered: list[_SequenceState] = field(default_factory=list)
    #: whether it sends outputs before it finishes (DELTA or CUMULATIVE)
    streams: bool = False
    #: a pooling request's parameters (it ends with a PoolingRequestOutput), else None
    pooling_params: PoolingParams | None = None
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, *, stream_interval: int = 1, pooler_normalize: bool = True) -> None:
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval!r} is invalid: must be an integer >= 1 "
                             "(tokens per streamed output)")
        self.tokenizer = tokenizer
        #: a pooling model's default normalization of embeddings
        self.pooler_normalize = pooler_normalize
        #: a streamed request gets an output once at least this many new tokens collected
        self.stream_interval = stream_interval
        self.requests: dict[str, _RequestState] = {}
        # child (engine) request id -> parent request id
        self.parent_of: dict[str, str] = {}
        # skip_special_tokens -> the tokenizer's decode function (made once, see make_decode)
        # and the texts of single tokens it gave (token id -> text)
        self._decoders: dict[bool, tuple[Decode, dict[int, str]]] = {}
        #: token id -> ``tokenizer.decode([token id])``, the decoded token of logprobs
        self._logprob_token_texts: dict[int, str] = {}

    def _decoder(self, skip_special_tokens: bool) -> tuple[Decode, dict[int, str]]:
        decoder = self._decoders.get(skip_special_tokens)
        if decoder is None:
            decoder = self._decoders[skip_special_tokens] = (make_decode(self.tokenizer, skip_special_tokens), {})
        return decoder

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, child_ids: list[str], child_params: list[SamplingParams],
                    pooling_params: PoolingParams | None = None) -> None:
        sequences = {}
        for index, (child_id, p) in enumerate(zip(child_ids, child_params)):
            detok = None
            if self.tokenizer is not None and p.detokenize:
                decode, token_texts = self._decoder(p.skip_special_tokens)
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids or [], skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens, stop=list(p.stop or []),
                    include_stop_str_in_output=p.include_stop_str_in_output,
                    decode=decode, token_texts=token_texts,
                )
            sequences[child_id] = _SequenceState(
                child_id, index, p, detok, logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None,
            )
            self.parent_of[child_id] = request_id
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, sequences, num_unfinished=len(sequences),
            ordered=sorted(sequences.values(), key=lambda s: s.index),
            streams=params.output_kind != RequestOutputKind.FINAL_ONLY, pooling_params=pooling_params,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parent requests; returns their engine (child) ids to abort in the core."""
        child_ids = []
        for req_id in request_ids:
            state = self.requests.pop(req_id, None)
            if state is None:
                continue
            for child_id in state.sequences:
                self.parent_of.pop(child_id, None)
                child_ids.append(child_id)
        return child_ids

    def finish_requests(self, request_ids: list[str], finish_reason: str) -> tuple[list[RequestOutput], list[str]]:
        """End requests here, as if their unfinished sequences had finished with ``finish_reason``:
        (their final outputs, the engine ids to abort in the core)."""
        endings: list[EngineCoreOutput] = []
        for req_id in request_ids:
            state = self.requests.get(req_id)
            if state is not None:
                endings.extend(EngineCoreOutput(child_id, [], finish_reason=finish_reason)
                               for child_id, seq in state.sequences.items() if seq.finish_reason is None)
        outputs, _ = self.process_outputs(endings)
        return outputs, [out.request_id for out in endings]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs for the user, engine request ids to abort because a stop string hit).

        ``outputs`` may hold several outputs of one request (AsyncLLM passes several steps at
        once when it lags): the request then gets one ``RequestOutput`` for all of them.
        """
        # parent request id -> its state, for the requests that may send an output now
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        parent_of, requests = self.parent_of, self.requests
        for out in outputs:
            parent_id = parent_of.get(out.request_id)
            if parent_id is None:
                continue
            state = requests[parent_id]
            seq = state.sequences[out.request_id]
            if seq.finish_reason is not None:
                # Already stopped (a stop string) by an earlier output of the same call: AsyncLLM
                # passes several steps at once when it lags, and the core stops on the abort.
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = self._prompt_logprobs(out.new_prompt_logprobs)
            if out.error is not None:
                state.error = out.error
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.pooling_output is not None:
                state.pooled = out.pooling_output
            new_token_ids = out.new_token_ids
            seq.token_ids += new_token_ids
            if out.new_logprobs is not None and seq.logprobs is not None:
                self._append_logprobs(seq, out.new_logprobs)
            detok = seq.detokenizer
            detok_ids = new_token_ids
            if out.finish_reason == "stop" and new_token_ids and not seq.params.include_stop_str_in_output \
                    and new_token_ids[-1] in seq.params.all_stop_token_ids:
                detok_ids = new_token_ids[:-1]  # as vLLM: a stop token's text is not output (special or not)
            stop_str = detok.update(detok_ids) if detok is not None else None
            if stop_str is not None:
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                state.num_unfinished -= 1
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                state.num_unfinished -= 1
                if detok is not None:
                    detok.flush()
            elif not state.streams:
                continue  # FINAL_ONLY and not finished: nothing to send
            touched[parent_id] = state

        results = []
        interval = self.stream_interval
        for parent_id, state in touched.items():
            finished = state.num_unfinished == 0
            if finished:
                del requests[parent_id]
                for child_id in state.sequences:
                    parent_of.pop(child_id, None)
            elif not state.streams or (interval > 1 and not self._interval_reached(state)):
                continue
            results.append(self._make_output(state, finished) if state.pooling_params is None
                           else self._make_pooling_output(state))
        return results, to_abort

    def _make_pooling_output(self, state: _RequestState) -> Any:
        """A finished pooling request's ``PoolingRequestOutput`` (a ``RequestOutput`` with the
        error when it failed or was aborted before its prompt was pooled)."""
        if state.pooled is None:
            return self._make_output(state, True)
        assert state.pooling_params is not None
        data = state.pooling_params.finish(state.pooled, self.pooler_normalize)
        return PoolingRequestOutput(state.request_id, PoolingOutput(data), list(state.prompt_token_ids or []),
                                    True, state.num_cached_tokens)

    def _interval_reached(self, state: _RequestState) -> bool:
        """Whether a sequence of the request has its first token, or ``stream_interval`` tokens,
        not sent yet."""
        interval = self.stream_interval
        for seq in state.ordered:
            num_unsent = len(seq.token_ids) - seq.sent_tokens
            if num_unsent >= interval or (num_unsent and not seq.sent_tokens):
                return True
        return False

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for seq in state.ordered:
            text = seq.detokenizer.text if seq.detokenizer is not None else ""
            num_tokens = len(seq.token_ids)
            logprobs = seq.logprobs
            if delta:
                end = len(text)
                if seq.finish_reason is None and seq.params.stop and not seq.params.include_stop_str_in_output:
                    # A stop string that starts in this text but ends in a later token would cut
                    # text already streamed; hold back its longest possible prefix until then.
                    end = max(seq.sent_text, end - max(len(s) for s in seq.params.stop) + 1)
                token_ids, text = seq.token_ids[seq.sent_tokens :], text[seq.sent_text : end]
                if logprobs is not None:
                    logprobs = logprobs[seq.sent_tokens :]
                seq.sent_text += len(text)
            else:
                token_ids = list(seq.token_ids)
                if logprobs is not None:
                    logprobs = list(logprobs)
            seq.sent_tokens = num_tokens
            completions.append(
                CompletionOutput(index=seq.index, text=text, token_ids=token_ids,
                                 cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                                 finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            )
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=completions, finished=finished,
            num_cached_tokens=state.num_cached_tokens, error=state.error, kv_transfer_params=state.kv_transfer_params,
        )

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._logprob_token_texts.get(token_id)
        if text is None:
            # (the same text every time: each token is decoded once, not once per logprob)
            text = self._logprob_token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob_dict(self, ids: list[int], values: list[float], rank: int | list[int]) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        # Column 0 is the sampled (or prompt) token with its true rank; the rest are ranks 1..k,
        # unless the columns are explicitly asked ids, whose ranks come as a list.
        ranks = rank if isinstance(rank, list) else None
        entry[ids[0]] = Logprob(values[0], ranks[0] if ranks else rank, self._decode_token(ids[0]))
        for r, (tid, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, ranks[r] if ranks else r, self._decode_token(tid))
        return entry

    def _append_logprobs(self, seq: _SequenceState, lists: LogprobsLists) -> None:
        assert seq.logprobs is not None
        for ids, values, rank in zip(*lists):
            seq.logprobs.append(self._logprob_dict(ids, values, rank))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + values[0]

    def _prompt_logprobs(self, lists: LogprobsLists) -> PromptLogprobs:
        result: PromptLogprobs = [None]
        for ids, values, rank in zip(*lists):
            result.append(self._logprob_dict(ids, values, rank))
        return result
