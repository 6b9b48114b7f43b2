"""Speculative decoding: proposers (n-gram, draft model, plugins), lossless verification, metrics.

See docs/speculative.md. Nothing heavy is imported here: the runner and proposers import torch
when the engine builds them.
"""

from pagedlm.core.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
