"""Qwen3 dense decoder-only language models.

Qwen2's block with three changes: the q/k/v and o projections have a bias only when
``config.attention_bias``; ``head_dim`` comes from the config (it need not equal
``hidden_size / num_heads``); and each head of q and k is RMS-normalised before rotary.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedlm.core.layers import RMSNorm
from pagedlm.core.layers.quantization import QuantizationConfig
from pagedlm.core.layers.rotary import PendingRotary
from pagedlm.models.qwen.qwen2 import Qwen2Attention, Qwen2ForCausalLM

__all__ = ["Qwen3Attention", "Qwen3ForCausalLM"]


class Qwen3Attention(Qwen2Attention):
    """Qwen2 attention plus per-head ``q_norm`` / ``k_norm`` (weights ``[head_dim]``)."""

    def _biases(self, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: Any, prefix: str, sliding_window: int | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, prefix, sliding_window, quant_config)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _rotary(self, positions: torch.Tensor) -> PendingRotary:
        """Normalise each ``D``-sized head of ``q [T, H * D]`` and ``k [T, Hkv * D]``, then rotate
        (one kernel where the platform has it; with the K/V write where the backend fuses it)."""
        return self.rotary_emb.pending(positions, self.q_norm, self.k_norm)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Same interface as :class:`Qwen2ForCausalLM`."""

    attn_cls = Qwen3Attention
