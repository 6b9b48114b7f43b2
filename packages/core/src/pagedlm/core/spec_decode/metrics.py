"""Acceptance counters of speculative decoding (vLLM's ``spec_decode_*`` metrics).

The scheduler counts, after every verified step: drafts (requests that had at least one draft
token), draft tokens, accepted tokens, and accepted tokens per draft position (position ``j``
counts the requests whose draft ``j`` was accepted). Totals since engine start; they reach the
front end in ``EngineStatsSnapshot`` and from there ``/metrics``, the periodic log and
``LLM.get_metrics()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: ``[num_spec_tokens]``
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified drafts."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1


def format_spec_decode_log(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                           per_pos: list[int]) -> str:
    """The periodic log's line for an interval's counts (differences of the totals)."""
    rate = 100.0 * num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0
    mean_len = 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0
    pos_rates = ", ".join(f"{n / num_drafts:.3f}" if num_drafts else "0.000" for n in per_pos)
    return (f"SpecDecoding metrics: Mean acceptance length: {mean_len:.2f}, Accepted: {num_accepted_tokens} tokens, "
            f"Drafted: {num_draft_tokens} tokens, Per-position acceptance rate: {pos_rates}, "
            f"Avg Draft acceptance rate: {rate:.1f}%")
