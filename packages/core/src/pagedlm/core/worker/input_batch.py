"""The model runner's persistent view of the requests it holds.

Each request gets a row of host tables that live as long as the request: its token ids
(``[max_num_reqs, max_model_len]``) and one block table per KV-cache group (``[max_num_reqs,
max_blocks]`` each). A step's flat inputs (one slot mapping and block table per group) are then
gathered with vectorized numpy indexing instead of per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.sched.output import SchedulerOutput

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_tokens: int
    num_computed_tokens: int
    #: entries of its block table in each KV-cache group
    num_blocks: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    #: tokens sampled on the device whose ids the host does not have yet (async scheduling);
    #: they follow the ``num_tokens`` known ones
    num_pending: int = 0
    #: prompt logprobs gathered over the prompt's chunks, sent when the prompt is done
    prompt_logprobs_parts: list[tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    #: ``[num_prompt_tokens, hidden]`` (CPU) for a prompt given as embeddings; its
    #: ``prompt_token_ids`` are placeholders then
    prompt_embeds: Any = None
    #: multimodal items (``MultiModalFeature``) in prompt order
    mm_features: list[Any] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class StepInputs:
    """Host-side flat inputs of one step. ``B`` requests, ``T`` tokens, in schedule order."""

    req_ids: list[str]
    rows: np.ndarray  # [B] table rows
    num_scheduled: np.ndarray  # [B]
    num_computed: np.ndarray  # [B] context in cache before this step
    query_start_loc: np.ndarray  # [B + 1]
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mappings: list[np.ndarray]  # per KV-cache group: [T]
    seq_lens: np.ndarray  # [B]
    block_tables: list[np.ndarray]  # per KV-cache group: [B, max_blocks_in_step]
    #: batch indices of requests whose last scheduled token is their last token
    sample_indices: np.ndarray  # [S]
    #: async scheduling: flat indices into ``input_ids`` whose token is still on the device
    #: (``input_ids`` holds a stand-in there), and for each, its row in the last sampled tensor
    fed_token_indices: np.ndarray = field(default_factory=lambda: _EMPTY)  # [F]
    fed_sample_indices: np.ndarray = field(default_factory=lambda: _EMPTY)  # [F]
    #: multimodal models: (flat token indices [N], encoder embeddings [N, hidden]) on the device
    #: of the step's placeholder positions, set by the model runner; None when there are none
    mm_embeds: Any = None


class InputBatch:
    def __init__(self, *, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device, num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
                             for _ in range(num_kv_cache_groups)]
        self.requests: dict[str, CachedRequestState] = {}
        #: preempted requests: out of the tables (their blocks are gone), their state kept for
        #: when they resume (the generator of a seeded request has to go on where it stopped)
        self.preempted: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        #: the last step's sampled ids ``[S]`` on the device, and each request's row in it
        self.sampled_on_device: torch.Tensor | None = None
        self.sample_row_of: dict[str, int] = {}
        #: bumped whenever a request joins or leaves (per-batch caches key on it)
        self.membership_version = 0

    # -- applying the scheduler's decisions ---------------------------------------------------
    def update(self, sched: SchedulerOutput) -> None:
        cached = sched.scheduled_cached_reqs
        if sched.finished_req_ids or sched.scheduled_new_reqs or sched.preempted_req_ids \
                or any(cached.resumed_from_preemption):
            self.membership_version += 1
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
            self.preempted.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            state = self.requests.pop(req_id)
            self._free_rows.append(state.row)
            # Recomputed from scratch on resume: prompt logprobs gathered so far would repeat.
            state.prompt_logprobs_parts = []
            self.preempted[req_id] = state
        for new in sched.scheduled_new_reqs:
            row = self._take_row()
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            num_prompt = len(new.prompt_token_ids)
            self.token_ids[row, :num_prompt] = new.prompt_token_ids
            for table, ids in zip(self.block_tables, new.block_ids, strict=True):
                table[row, : len(ids)] = ids
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, row=row, prompt_token_ids=list(new.prompt_token_ids), sampling_params=params,
                generator=generator, num_tokens=num_prompt, num_computed_tokens=new.num_computed_tokens,
                num_blocks=[len(ids) for ids in new.block_ids], prompt_embeds=new.prompt_embeds,
                mm_features=new.mm_features,
            )
        # One token per decode row is the common case: those are written in one numpy assignment.
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        requests, max_len = self.requests, self.max_model_len
        for req_id, resumed, new_block_ids, num_computed, new_token_ids, all_token_ids in zip(
                cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens,
                cached.new_token_ids, cached.token_ids, strict=True):
            if resumed:
                state = self._resume(req_id, all_token_ids)
            else:
                state = requests[req_id]
                if len(new_token_ids) == 1 and state.num_tokens < max_len:
                    rows.append(state.row)
                    cols.append(state.num_tokens)
                    values.append(new_token_ids[0])
                    state.num_tokens += 1
                    state.output_token_ids.append(new_token_ids[0])
                    # NOTE: a runner that samples counted this token as pending when it drew it;
                    # a pipeline stage that does not sample never has pending tokens.
                    if state.num_pending:
                        state.num_pending -= 1
                elif new_token_ids:
                    self._append_tokens(state, new_token_ids)
            if any(new_block_ids):  # (most decode rows get no block)
                for g, ids in enumerate(new_block_ids):
                    if ids:
                        start = state.num_blocks[g]
                        self.block_tables[g][state.row, start : start + len(ids)] = ids
                        state.num_blocks[g] += len(ids)
            state.num_computed_tokens = num_computed
        if rows:
            self.token_ids[rows, cols] = values

    def _resume(self, req_id: str, token_ids: list[int] | None) -> CachedRequestState:
        """A preempted request back in the batch, with its full token list."""
        state = self.preempted.pop(req_id)
        state.row = self._take_row()
        state.num_blocks = [0] * len(self.block_tables)
        assert token_ids is not None
        self.token_ids[state.row, : len(token_ids)] = token_ids
        state.num_tokens = len(token_ids)
        # NOTE: in place: cached sampling metadata holds this list. The full token list includes
        # every token this runner sampled before the preemption: none is pending.
        state.output_token_ids[:] = token_ids[state.num_prompt_tokens :]
        state.num_pending = 0
        self.requests[req_id] = state
        return state

    def set_sampled_on_device(self, states: list[CachedRequestState], sampled: torch.Tensor) -> None:
        """Record a step's sampled ids ``[S]`` (row j for ``states[j]``) before they reach the host."""
        self.sampled_on_device = sampled
        self.sample_row_of = {state.req_id: j for j, state in enumerate(states)}
        for state in states:
            state.num_pending += 1

    def _take_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_reqs={self.max_num_reqs} requests in the model runner")
        return self._free_rows.pop()

    def _append_tokens(self, state: CachedRequestState, token_ids: list[int]) -> None:
        """Append tokens the scheduler received for a request (oldest first)."""
        if not token_ids:
            return
        start = state.num_tokens
        end = min(start + len(token_ids), self.max_model_len)
        self.token_ids[state.row, start:end] = token_ids[: end - start]
        state.num_tokens += len(token_ids)
        state.output_token_ids.extend(token_ids)
        # NOTE: a runner that samples counted these tokens as pending when it drew them (they
        # may have been fed to a step on the device since); a pipeline stage that does not
        # sample never has pending tokens.
        state.num_pending = max(state.num_pending - len(token_ids), 0)

    # -- building a step's flat inputs --------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        req_ids = list(sched.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(states)
        # One pass over the states for every per-request number (this runs every step).
        per_req = np.array([(s.row, s.num_computed_tokens, s.num_tokens, s.num_pending) for s in states],
                           dtype=np.int64).reshape(num_reqs, 4)
        rows, num_computed, num_known, num_pending = np.ascontiguousarray(per_req.T)
        num_scheduled = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        if total == num_reqs:  # decode only: one token per request
            token_req = np.arange(num_reqs)
            positions = num_computed
        else:
            # Per flat token: which request (batch index) it belongs to and its offset in the chunk.
            token_req = np.repeat(np.arange(num_reqs), num_scheduled)
            offsets = np.arange(total) - query_start_loc[:-1][token_req]
            positions = num_computed[token_req] + offsets
        token_rows = rows[token_req]
        input_ids = self.token_ids[token_rows, positions]
        seq_lens = num_computed + num_scheduled
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if len(states) else 0
        block_index, block_offset = positions // self.block_size, positions % self.block_size
        block_tables, slot_mappings = [], []
        for table in self.block_tables:
            block_tables.append(table[rows, :max_blocks])
            slot_mappings.append(table[token_rows, block_index].astype(np.int64) * self.block_size + block_offset)
        fed_token_indices = fed_sample_indices = _EMPTY
        if num_pending.any():
            sample_indices = np.nonzero(seq_lens >= num_known + num_pending)[0]
            # NOTE: at most one token per request is in flight (the engine takes a step's result
            # before it runs the step after next), so only position num_known can be unknown.
            fed_token_indices = np.nonzero(positions >= num_known[token_req])[0]
            fed_reqs = token_req[fed_token_indices]
            assert (positions[fed_token_indices] == num_known[fed_reqs]).all()
            fed_sample_indices = np.fromiter((self.sample_row_of[req_ids[b]] for b in fed_reqs), dtype=np.int64,
                                             count=len(fed_reqs))
        else:
            sample_indices = np.nonzero(seq_lens >= num_known)[0]
        return StepInputs(
            req_ids=req_ids, rows=rows, num_scheduled=num_scheduled, num_computed=num_computed,
            query_start_loc=query_start_loc, input_ids=input_ids, positions=positions, slot_mappings=slot_mappings,
            seq_lens=seq_lens, block_tables=block_tables, sample_indices=sample_indices,
            fed_token_indices=fed_token_indices, fed_sample_indices=fed_sample_indices,
        )
