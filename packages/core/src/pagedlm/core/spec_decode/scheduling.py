"""The scheduler's part of speculative decoding (called from ``sched/scheduler.py``).

NOTE: the invariants. Drafts are scheduled only right after a step that sampled, when exactly one
known token of the request is not computed yet (its newest); they follow it in the step and count
against the token budget like any token, so a tight budget schedules fewer of them. They are never
part of ``Request.all_token_ids``: the KV-cache manager hashes only known (verified) tokens into
the prefix cache. After verification the rejected drafts' slots are given back by rolling
``num_computed_tokens`` back; the blocks stay with the request and the next step's tokens reuse
those slots.
"""

from __future__ import annotations

from pagedlm.core.request import Request
from pagedlm.core.spec_decode.config import SpeculativeConfig
from pagedlm.core.spec_decode.metrics import SpecDecodingStats


class SpecDecodeScheduling:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(num_spec_tokens=int(config.num_speculative_tokens))  # type: ignore[arg-type]
        self.num_lookahead_tokens = config.num_lookahead_tokens

    def drafts_to_schedule(self, request: Request, num_uncomputed: int, num_running: int) -> list[int]:
        """The drafts that may follow the request's uncomputed tokens this step (before the
        token budget cuts them): none unless only its newest token is uncomputed; no more than
        could still be output before its length limit."""
        drafts = request.spec_token_ids
        if num_uncomputed != 1 or not self.config.speculates(num_running):
            return []
        room = request.max_num_tokens - request.num_tokens - 1
        return drafts if len(drafts) <= room else drafts[: max(room, 0)]

    def steps_synchronously(self, num_running: int) -> bool:
        """Whether an engine with async scheduling runs its next step synchronously (one with
        ``num_running`` running requests may get drafts: spec_decode/engine_step.py)."""
        return self.config.speculates(num_running)

    def num_slots(self, num_computed: int, num_new_tokens: int) -> int:
        """KV slots to allocate for ``num_new_tokens`` tokens scheduled after ``num_computed``
        computed ones: plus the draft model's lookahead, within ``max_model_len``."""
        if not self.num_lookahead_tokens:
            return num_new_tokens
        room = self.max_model_len - num_computed - num_new_tokens
        return num_new_tokens + max(0, min(self.num_lookahead_tokens, room))

    def on_verified(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """Roll back the rejected drafts of a request that sampled ``num_sampled`` tokens after
        ``num_drafts`` scheduled drafts (``num_sampled - 1`` of them accepted), and count them."""
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        self.stats.observe(num_drafts, num_accepted)
