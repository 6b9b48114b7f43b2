"""Qwen2 / Qwen2.5 decoder-only language models.

The block is Llama's with a bias on the q/k/v projections (none on o_proj) and optional
sliding-window attention on the layers ``config.layer_types`` marks ``"sliding_attention"``.
All token tensors are flat ``[T, ...]`` (every request of the step concatenated); head counts
are per tensor-parallel rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.attention import Attention
from pagedlm.core.config import VllmConfig
from pagedlm.core.layers import (
    QKV_GATE_UP_STACKED_PARAMS,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    get_rope,
    maybe_prefix,
    set_attention_heads,
)
from pagedlm.core.layers.quantization import QuantizationConfig
from pagedlm.core.layers.rotary import PendingRotary

__all__ = ["Qwen2Attention", "Qwen2ForCausalLM", "Qwen2Model"]

SKIPPED_WEIGHTS = ("rotary_emb.inv_freq",)


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The attention window of layer ``layer_idx``, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    # Configs from before transformers added layer_types.
    if getattr(config, "use_sliding_window", False) and layer_idx >= getattr(config, "max_window_layers", 0):
        return window
    return None


class Qwen2Attention(nn.Module):
    """``hidden [T, hidden] -> [T, hidden]``: qkv projection, rotary, paged attention, o_proj.

    Subclasses change the biases and may normalise q/k in :meth:`_rotary`.
    """

    #: forward hands hidden_states to qkv_proj untouched, so the input norm may quantize it
    #: (PreNormDecoderLayer, FP8 activations)
    forwards_hidden_to_qkv_proj = True

    def _biases(self, config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        return True, False

    def __init__(self, config: Any, prefix: str, sliding_window: int | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        set_attention_heads(self, config)
        hidden_size = config.hidden_size
        qkv_bias, o_bias = self._biases(config)

        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads,
            bias=qkv_bias, prefix=maybe_prefix(prefix, "qkv_proj"), quant_config=quant_config,
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, hidden_size, bias=o_bias, prefix=maybe_prefix(prefix, "o_proj"),
            quant_config=quant_config,
        )
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
            prefix=maybe_prefix(prefix, "attn"), sliding_window=sliding_window,
        )

    def _rotary(self, positions: torch.Tensor) -> PendingRotary:
        """The rotary of ``q [T, H * D]`` and ``k [T, Hkv * D]``, handed to the attention
        unapplied (a backend may fuse it with the K/V write)."""
        return self.rotary_emb.pending(positions)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, rotary=self._rotary(positions)))


class Qwen2DecoderLayer(PreNormDecoderLayer):
    """Qwen2's pre-norm block (the forward is :class:`PreNormDecoderLayer`'s)."""

    def __init__(self, config: Any, prefix: str, attn_cls: type[Qwen2Attention], layer_idx: int,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.self_attn = attn_cls(config, maybe_prefix(prefix, "self_attn"), layer_sliding_window(config, layer_idx),
                                  quant_config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            maybe_prefix(prefix, "mlp"), quant_config=quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen2Model(DecoderModel):
    """Embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 attn_cls: type[Qwen2Attention] = Qwen2Attention) -> None:
        config = vllm_config.model_config.text_config
        quant_config = vllm_config.quant_config
        super().__init__(config, prefix, lambda i: Qwen2DecoderLayer(
            config, maybe_prefix(prefix, f"layers.{i}"), attn_cls, i, quant_config), quant_config=quant_config)


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 (q/k/v biases); Qwen3 subclasses it: a decoder body under the shared LM head of :class:`CausalLM`."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    skipped_weights = SKIPPED_WEIGHTS

    attn_cls: type[Qwen2Attention] = Qwen2Attention

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), attn_cls=self.attn_cls)
        self.init_lm_head(prefix, vllm_config.quant_config)
