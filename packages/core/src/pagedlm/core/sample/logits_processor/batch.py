"""The model runner's side: the persistent batch as logits processors see it.

:class:`BatchLogitsProcessors` follows the runner's requests (``InputBatch.requests``) and gives
each a dense batch index the way vLLM's persistent batch does (see ``interface``): every step,
before the forward pass, ``update`` turns the joins and leaves since the last step into one
``BatchUpdate`` for every processor. ``step_view`` then maps the step's sampling rows (the logits
the sampler gets: one row per request that samples, in schedule order) to those indices, so that
``apply`` sees ``[batch_size, vocab]`` with row ``i`` belonging to the request at index ``i``.
Rows of requests that do not sample this step (a prompt chunk, or not scheduled) are zeros there,
and what a processor writes into them is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pagedlm.core.sample.logits_processor.interface import LogitsProcessor, MoveDirectionality
from pagedlm.core.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors


class LogitsProcessorsStep:
    """The processors for one step's sampling rows (``SamplingMetadata.logitsprocs``)."""

    def __init__(self, procs: LogitsProcessors, rows: torch.Tensor | None, batch_size: int) -> None:
        self.procs = procs
        #: batch index of each sampling row ``[S]``; None when row ``j`` is index ``j`` for all
        #: ``batch_size`` requests (no scatter needed)
        self.rows = rows
        self.batch_size = batch_size

    @property
    def non_argmax_invariant(self) -> bool:
        return bool(self.procs.non_argmax_invariant)

    @property
    def argmax_invariant(self) -> bool:
        return bool(self.procs.argmax_invariant)

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, V]`` float32 (the caller's copy: modified in place) -> processed ``[S, V]``."""
        return self._apply(self.procs.non_argmax_invariant, logits)

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """As :meth:`apply_non_argmax_invariant`, for the random path (temperature-scaled logits)."""
        return self._apply(self.procs.argmax_invariant, logits)

    def _apply(self, procs: Sequence[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
        if not procs:
            return logits
        if self.rows is None:
            for proc in procs:
                logits = proc.apply(logits)
            return logits
        full = logits.new_zeros((self.batch_size, logits.shape[-1]))
        full.index_copy_(0, self.rows, logits)
        for proc in procs:
            full = proc.apply(full)
        return full.index_select(0, self.rows)


class BatchLogitsProcessors:
    """Dense batch indices for the runner's requests, and the processors' state updates."""

    def __init__(self, procs: LogitsProcessors) -> None:
        self.procs = procs
        self.index_of: dict[str, int] = {}
        self._req_at: list[str | None] = []
        self._version: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self._req_at)

    def update(self, requests: Mapping[str, Any], membership_version: int) -> None:
        """Follow the runner's requests (``CachedRequestState`` by id); ``membership_version``
        changes whenever a request joins or leaves. Calls every processor's ``update_state``."""
        update = None
        if membership_version != self._version:
            self._version = membership_version
            update = self._rebuild(requests)
        for proc in self.procs.all:
            proc.update_state(update)

    def _rebuild(self, requests: Mapping[str, Any]):
        builder = BatchUpdateBuilder()
        req_at, index_of = self._req_at, self.index_of
        for req_id in [r for r in index_of if r not in requests]:
            index = index_of.pop(req_id)
            req_at[index] = None
            builder.removed_append(index)
        for req_id, state in requests.items():
            if req_id in index_of:
                continue
            reused = builder.pop_removed()
            if reused is None:
                index = len(req_at)
                req_at.append(req_id)
            else:
                index = reused
                req_at[index] = req_id
            index_of[req_id] = index
            prompt_ids = None if getattr(state, "prompt_embeds", None) is not None else state.prompt_token_ids
            builder.added.append((index, state.sampling_params, prompt_ids, state.output_token_ids))
        # Condense: fill the holes left below the new size with the highest requests, lowest hole first.
        size = len(index_of)
        holes = [i for i in range(size) if req_at[i] is None]
        sources = [i for i in range(len(req_at) - 1, size - 1, -1) if req_at[i] is not None]
        for hole, src in zip(holes, sources, strict=True):
            moving = req_at[src]
            assert moving is not None
            req_at[hole], req_at[src] = moving, None
            index_of[moving] = hole
            builder.moved.append((src, hole, MoveDirectionality.UNIDIRECTIONAL))
        del req_at[size:]
        return builder.get_and_reset(size)

    def step_view(self, req_ids: Sequence[str], device: torch.device) -> LogitsProcessorsStep:
        """The processors for sampling rows ``req_ids`` (in the order of the logits' rows)."""
        rows = [self.index_of[r] for r in req_ids]
        if rows == list(range(self.batch_size)):
            return LogitsProcessorsStep(self.procs, None, self.batch_size)
        return LogitsProcessorsStep(self.procs, torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                                    self.batch_size)
