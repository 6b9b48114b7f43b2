"""CUDA-graph sizes for speculative decoding's verification steps.

A verification step gives each of its ``b`` requests ``1 + k`` query tokens (the newest token and
``k`` drafts), so its shape is a mixed batch's: the runner's mixed-batch graphs replay it. Their
default sizes start at 256 tokens, sized for prompt chunks; a verification step of a few requests
padded to 256 tokens would cost several decode steps. These are the extra, smaller sizes captured
when speculation is on: ``b * (1 + k)`` tokens for every decode batch size ``b`` below the
smallest default size (vLLM captures its "uniform decode" graphs at the same token counts).
Steps with fewer drafts pad up to the next size.
"""

from __future__ import annotations

__all__ = ["verification_capture_sizes"]


def verification_capture_sizes(num_speculative_tokens: int, decode_sizes: list[int], below: int) -> list[int]:
    """Token counts ``b * (1 + num_speculative_tokens)`` for ``b`` in ``decode_sizes``, those under
    ``below`` (where the default mixed-batch sizes take over), ascending."""
    query_len = 1 + num_speculative_tokens
    return sorted({query_len * b for b in decode_sizes if query_len * b < below})
