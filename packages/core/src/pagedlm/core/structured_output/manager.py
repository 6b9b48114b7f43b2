"""The engine core's structured-output manager.

Life of a request with ``structured_outputs``:

1. ``hold``: the scheduler hands it over when it arrives. Its grammar compiles on a thread pool
   (one compilation per distinct spec: the futures are cached by ``(kind, spec)``); the request
   stays here, out of the waiting queue, until the grammar is ready.
2. ``take_ready``: at the start of every schedule, requests whose grammar is ready go to the
   waiting queue with a fresh matcher; those whose grammar failed are returned to be finished
   with an error (only they fail).
3. ``grammar_bitmask``: one bitmask row per scheduled request that samples in the step and has a
   live grammar (the others are left out: no row, no cost). Without async scheduling the
   scheduler fills them at the end of ``schedule``; with it, the engine core fills them just
   before it submits the step, once the batch still in flight has come back and its tokens have
   advanced the matchers (``EngineCore._step_with_batch_queue``): a request with a grammar runs
   a step ahead of its token like any other, and its row is still filled from its last token.
4. ``accept_tokens``: the scheduler advances the matcher with each sampled token; a grammar that
   has terminated finishes its request (``stop``).

NOTE: so a matcher always stands at its request's last output token when its row is filled.
Preemption keeps the output tokens (recompute rebuilds the KV cache, not the output), so the
matcher is kept as it is too.

With a reasoning parser (``structured_outputs_config.reasoning_parser``) the grammar starts once
the thinking has ended: no row is filled and no token accepted until then.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedlm.core.logger import init_logger
from pagedlm.core.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from pagedlm.core.structured_output.fill_thread import FillThread
from pagedlm.core.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig
    from pagedlm.core.request import Request

logger = init_logger(__name__)

#: compiled grammars kept for reuse (least recently used ones are dropped)
_CACHE_SIZE = 512
#: how long ``take_ready`` waits for a compilation when nothing else can run
_IDLE_WAIT_S = 0.005
#: bitmask buffers used in turn (see ``_bitmask_rows``)
_NUM_BITMASK_BUFFERS = 3
#: fills expected to take less host time than this run inline: the hand-off to the fill thread
#: costs ~0.1 ms (``fill_thread.py``)
_BACKGROUND_FILL_MIN_S = 0.25e-3


def resolve_backend_class(name: str) -> type[StructuredOutputBackend]:
    """The class of a registered backend; ``"auto"`` is xgrammar."""
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    backends = get_plugins().structured_output_backends()
    key = "xgrammar" if name == "auto" else name
    if key not in backends:
        raise ValueError(f"structured_outputs_config.backend={name!r} is not a registered structured-output backend; "
                         f"registered: auto, {', '.join(sorted(backends))}")
    return resolve_class_path(backends[key])


def validate_structured_outputs(vllm_config: VllmConfig, params: StructuredOutputsParams) -> None:
    """The front end's check of a request's constraint (``ValueError`` naming the field): the
    configured backend must be able to compile it."""
    if vllm_config.model_config.skip_tokenizer_init:
        raise ValueError("structured_outputs need the tokenizer; this engine runs with skip_tokenizer_init=True")
    resolve_backend_class(vllm_config.structured_outputs_config.backend).validate(params)


class _RequestGrammar:
    """One request's structured-output state."""

    __slots__ = ("future", "grammar", "reasoning_ended")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.grammar: StructuredOutputGrammar | None = None
        self.reasoning_ended = True


class StructuredOutputManager:
    def __init__(self, vllm_config: VllmConfig, pinned_bitmasks: bool = False) -> None:
        """``pinned_bitmasks``: the bitmasks go to workers in this process (page-locked buffers
        where the platform uses them)."""
        self.vllm_config = vllm_config
        self._pinned_bitmasks = pinned_bitmasks
        self.config = vllm_config.structured_outputs_config
        self._backend: StructuredOutputBackend | None = None
        self._reasoner: Any = None
        self._init_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        #: req_id -> state, for every request with a grammar still in the engine
        self._requests: dict[str, _RequestGrammar] = {}
        #: requests whose grammar is compiling, in arrival order
        self._held: list[Request] = []
        self._bitmask_buffers: list[np.ndarray] = []
        self._fill_thread: FillThread | None = None
        self._num_bitmasks = 0
        #: host seconds spent filling bitmasks, and the steps that filled any (``pagedlm bench``)
        self.fill_seconds = 0.0
        self.num_fill_steps = 0

    # -- set-up (on a compile thread, the first time a grammar is needed) ------------------------
    def _ensure_backend(self) -> StructuredOutputBackend:
        with self._init_lock:
            if self._backend is None:
                from pagedlm.core.engine.tokenizer import get_tokenizer

                mc = self.vllm_config.model_config
                if mc.skip_tokenizer_init or mc.tokenizer is None:
                    raise ValueError("structured outputs need the tokenizer; this engine runs with "
                                     "skip_tokenizer_init=True")
                tokenizer = get_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
                backend_cls = resolve_backend_class(self.config.backend)
                start = time.perf_counter()
                self._backend = backend_cls(vllm_config=self.vllm_config, tokenizer=tokenizer,
                                            vocab_size=mc.vocab_size)
                if self.config.reasoning_parser and not self.config.enable_in_reasoning:
                    from pagedlm.core.reasoning import get_reasoning_parser

                    self._reasoner = get_reasoning_parser(self.config.reasoning_parser)(tokenizer)
                logger.info("structured outputs: backend %s ready in %.2fs", type(self._backend).__name__,
                            time.perf_counter() - start)
            return self._backend

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self._ensure_backend().compile(params)

    # -- requests ----------------------------------------------------------------------------
    def hold(self, request: Request) -> bool:
        """Take a request that has ``structured_outputs`` until its grammar is ready; False (and
        nothing held) for one without."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) // 2)),
                                                thread_name_prefix="pagedlm-grammar")
        key = (params.kind, params.spec())
        future = self._compiled.get(key)
        if future is None:
            future = self._executor.submit(self._compile, params)
            self._compiled[key] = future
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        self._requests[request.request_id] = _RequestGrammar(future)
        self._held.append(request)
        return True

    def take_ready(self, block: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """(requests whose grammar is ready, (request, error) of those whose grammar failed).
        ``block``: nothing else can run, so wait briefly for a compilation instead of spinning."""
        if not self._held:
            return [], []
        if block:
            wait_futures([self._requests[r.request_id].future for r in self._held], timeout=_IDLE_WAIT_S,
                         return_when="FIRST_COMPLETED")
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        still: list[Request] = []
        for request in self._held:
            state = self._requests[request.request_id]
            if not state.future.done():
                still.append(request)
                continue
            error = state.future.exception()
            if error is None:
                try:
                    self._start(request, state)
                except Exception as e:  # noqa: BLE001 - a matcher that cannot start fails its request only
                    error = e
            if error is None:
                ready.append(request)
            else:
                self._compiled.pop((request.sampling_params.structured_outputs.kind,  # type: ignore[union-attr]
                                    request.sampling_params.structured_outputs.spec()), None)  # type: ignore[union-attr]
                del self._requests[request.request_id]
                failed.append((request, f"structured output grammar failed: {type(error).__name__}: {error}"))
        self._held = still
        return ready, failed

    def _start(self, request: Request, state: _RequestGrammar) -> None:
        backend = self._backend
        assert backend is not None
        stop = sorted(request.sampling_params.all_stop_token_ids)
        state.grammar = backend.new_grammar(state.future.result(), stop)
        if self._reasoner is not None:
            state.reasoning_ended = self._reasoner.is_reasoning_end(request.prompt_token_ids)

    def remove(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._held = [r for r in self._held if r.request_id != request_id]

    def is_held(self, request: Request) -> bool:
        return any(r is request for r in self._held)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def has_requests(self) -> bool:
        return bool(self._requests)

    def any_in(self, request_ids: dict[str, int]) -> bool:
        """Whether one of these (scheduled) requests has a grammar."""
        requests = self._requests
        return bool(requests) and any(r in requests for r in request_ids)

    # -- per step ----------------------------------------------------------------------------
    def grammar_bitmask(self, requests: dict[str, Request],
                        num_scheduled_tokens: dict[str, int]) -> tuple[dict[str, int], np.ndarray | None]:
        """(req_id -> bitmask row, ``int32 [rows, ceil(V/32)]``) of the scheduled requests that
        sample in this step under a live grammar; ({}, None) when there are none."""
        rows, grammars = self._grammar_rows(requests, num_scheduled_tokens)
        if not grammars:
            return {}, None
        bitmask = self._bitmask_rows(len(grammars))
        self._fill(grammars, bitmask)
        return rows, bitmask

    def grammar_bitmask_deferred(self, requests: dict[str, Request], num_scheduled_tokens: dict[str, int]
                                 ) -> tuple[dict[str, int], np.ndarray | None, Future | None]:
        """:meth:`grammar_bitmask` with the fill left running on the fill thread when it is worth
        a hand-off (:data:`_BACKGROUND_FILL_MIN_S` of expected work): the rows, the bitmask, and
        the fill's future (None: already filled). :meth:`wait_fill` it before the bitmask is read.
        NOTE: the matchers must not move until then (their tokens come with the next update)."""
        rows, grammars = self._grammar_rows(requests, num_scheduled_tokens)
        if not grammars:
            return {}, None, None
        bitmask = self._bitmask_rows(len(grammars))
        backend = self._backend
        assert backend is not None
        if backend.fill_seconds_estimate(len(grammars)) < _BACKGROUND_FILL_MIN_S:
            self._fill(grammars, bitmask)
            return rows, bitmask, None
        if self._fill_thread is None:
            self._fill_thread = FillThread()
        return rows, bitmask, self._fill_thread.submit(lambda: self._fill(grammars, bitmask))

    def wait_fill(self, future: Future) -> None:
        assert self._fill_thread is not None
        self._fill_thread.wait(future)

    @property
    def fill_wait_seconds(self) -> float:
        """Host seconds the engine core waited for fills on the fill thread."""
        return self._fill_thread.wait_seconds if self._fill_thread is not None else 0.0

    def _grammar_rows(self, requests: dict[str, Request], num_scheduled_tokens: dict[str, int]
                      ) -> tuple[dict[str, int], list[StructuredOutputGrammar]]:
        rows: dict[str, int] = {}
        grammars: list[StructuredOutputGrammar] = []
        if not self._requests:
            return rows, grammars
        for req_id in num_scheduled_tokens:
            state = self._requests.get(req_id)
            if state is None or state.grammar is None or not state.reasoning_ended:
                continue
            request = requests.get(req_id)
            # NOTE: counted as computed when scheduled: it samples iff all its tokens are computed
            # (with async scheduling too, once the batch in flight is back)
            if request is None or request.num_computed_tokens < request.num_tokens or state.grammar.is_terminated():
                continue
            rows[req_id] = len(grammars)
            grammars.append(state.grammar)
        return rows, grammars

    def _fill(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray) -> None:
        start = time.perf_counter()
        self._backend.fill_bitmasks(grammars, bitmask)  # type: ignore[union-attr]
        self.fill_seconds += time.perf_counter() - start
        self.num_fill_steps += 1

    def _bitmask_rows(self, num_rows: int) -> np.ndarray:
        """``num_rows`` rows of the next of a few persistent bitmask buffers: no fresh 20 KB a
        row to fault in every step, and, page-locked, the runner copies them to the device
        without staging them.

        NOTE: a buffer is filled again only after its step's output has come back (a step's
        rows are filled once the batch in flight has been taken back), so the copy out of it
        has completed by then.
        """
        backend = self._backend
        assert backend is not None
        capacity = self.vllm_config.scheduler_config.max_num_seqs
        if num_rows > capacity:
            return backend.allocate_bitmask(num_rows)
        if not self._bitmask_buffers:
            import torch

            from pagedlm.core.platforms import current_platform

            pinned = self._pinned_bitmasks and current_platform.is_pin_memory_available()
            for _ in range(_NUM_BITMASK_BUFFERS):
                rows = backend.allocate_bitmask(capacity)
                if pinned:
                    rows = torch.empty(rows.shape, dtype=torch.int32, pin_memory=True).numpy()
                self._bitmask_buffers.append(rows)
        buffer = self._bitmask_buffers[self._num_bitmasks % _NUM_BITMASK_BUFFERS]
        self._num_bitmasks += 1
        return buffer[:num_rows]

    def accept_tokens(self, request: Request, token_ids: list[int]) -> str | None:
        """Advance the request's matcher; returns None, ``"stop"`` (its grammar has ended) or
        an error message (a token its grammar does not allow)."""
        state = self._requests.get(request.request_id)
        if state is None or state.grammar is None:
            return None
        if not state.reasoning_ended:
            reasoner = self._reasoner
            end = reasoner.reasoning_end_index(token_ids)
            if end is None:
                return None
            state.reasoning_ended = True
            token_ids = token_ids[end + 1:]
        if not state.grammar.accept_tokens(token_ids):
            return f"structured output: sampled token(s) {token_ids} are not allowed by the request's grammar"
        return "stop" if state.grammar.is_terminated() else None

    def shutdown(self) -> None:
        if self._fill_thread is not None:
            self._fill_thread.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
