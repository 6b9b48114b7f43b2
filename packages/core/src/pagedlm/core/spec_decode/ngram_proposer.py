"""Prompt-lookup (n-gram) drafts, on the host with numpy.

For each request: the longest suffix of ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens that
occurred earlier in its tokens (prompt and output); the drafts are the tokens that followed its
latest earlier occurrence. Input-grounded tasks (rewriting, quoting, editing code) repeat spans of
the prompt, which is where these drafts are accepted.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedlm.core.spec_decode.proposer import ProposalBatch, SpecProposer


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafts for the 1-D history ``tokens``: what followed the latest earlier
    occurrence of its longest matching suffix of ``max_n`` down to ``min_n`` tokens (``[]``: none)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length-n-1: every occurrence but the suffix itself
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(SpecProposer):
    needs_every_step = False  # drafts come from the request's tokens alone

    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        cfg = self.speculative_config
        lo, hi = int(cfg.prompt_lookup_min), int(cfg.prompt_lookup_max)  # type: ignore[arg-type]
        drafts: list[list[int]] = [[] for _ in batch.rows]
        for b in np.flatnonzero(batch.max_drafts):
            history = batch.token_ids[batch.rows[b], : batch.num_tokens[b]]
            drafts[b] = ngram_drafts(history, lo, hi, int(batch.max_drafts[b]))
        return drafts
