"""Qwen3 dense decoder-only language models.

Qwen2's block with three changes: the q/k/v and o projections have a bias only when
``config.attention_bias``; ``head_dim`` comes from the config (it need not equal
``hidden_size / num_heads``); and each head of q and k is RMS-normalised before rotary.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.core.layers import RMSNorm
from pagedlm.models.qwen.qwen2 import Qwen2Attention, Qwen2ForCausalLM

__all__ = ["Qwen3Attention", "Qwen3ForCausalLM"]


class Qwen3Attention(Qwen2Attention):
    """Qwen2 attention plus per-head ``q_norm`` / ``k_norm`` (weights ``[head_dim]``)."""

    def _biases(self, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: Any, prefix: str, sliding_window: int | None = None) -> None:
        super().__init__(config, prefix, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H * D]``, ``k [T, Hkv * D]``: normalise each ``D``-sized head independently."""
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).reshape(num_tokens, self.q_size)
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, self.kv_size)
        return q, k


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Same interface as :class:`Qwen2ForCausalLM`."""

    attn_cls = Qwen3Attention
