"""Llama (1/2/3.x) and Mistral decoder-only language models.

All token tensors are flat: the ``T`` scheduled tokens of every request in the step are
concatenated with no batch dimension; the attention backend's metadata says which rows belong to
which request. Head counts below are per tensor-parallel rank.
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

__all__ = ["LlamaForCausalLM", "LlamaModel", "MistralForCausalLM"]

# Buffers some old checkpoints saved; recomputed here.
SKIPPED_WEIGHTS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    """``hidden [T, hidden] -> [T, hidden]``: qkv projection, rotary, paged attention, o_proj."""

    #: forward hands hidden_states to qkv_proj untouched, so the input norm may quantize it
    #: (PreNormDecoderLayer, FP8 activations)
    forwards_hidden_to_qkv_proj = True

    def __init__(self, config: Any, prefix: str, sliding_window: int | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        set_attention_heads(self, config)
        hidden_size = config.hidden_size
        self.scaling = self.head_dim**-0.5
        attention_bias = bool(getattr(config, "attention_bias", False))

        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads,
            bias=attention_bias, prefix=maybe_prefix(prefix, "qkv_proj"), quant_config=quant_config,
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, hidden_size, bias=attention_bias,
            prefix=maybe_prefix(prefix, "o_proj"), quant_config=quant_config,
        )
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
            prefix=maybe_prefix(prefix, "attn"), sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # the rotary goes to the attention unapplied: a backend may fuse it with the K/V write
        return self.o_proj(self.attn(q, k, v, rotary=self.rotary_emb.pending(positions)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Llama's pre-norm block (the forward is :class:`PreNormDecoderLayer`'s)."""

    def __init__(self, config: Any, prefix: str, sliding_window: int | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, maybe_prefix(prefix, "self_attn"), sliding_window, quant_config)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act,
            prefix=maybe_prefix(prefix, "mlp"), bias=bool(getattr(config, "mlp_bias", False)),
            quant_config=quant_config,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(DecoderModel):
    """Embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", use_sliding_window: bool = False) -> None:
        config = vllm_config.model_config.text_config
        sliding_window = getattr(config, "sliding_window", None) if use_sliding_window else None
        quant_config = vllm_config.quant_config
        super().__init__(config, prefix, lambda i: LlamaDecoderLayer(
            config, maybe_prefix(prefix, f"layers.{i}"), sliding_window, quant_config), quant_config=quant_config)


class LlamaForCausalLM(CausalLM):
    """Llama (and, through MistralForCausalLM, Mistral): a decoder body under :class:`CausalLM`'s LM head."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    skipped_weights = SKIPPED_WEIGHTS

    #: Mistral honours config.sliding_window; Llama has no sliding-window attention.
    use_sliding_window = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        self.model = LlamaModel(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
            use_sliding_window=self.use_sliding_window,
        )
        self.init_lm_head(prefix, vllm_config.quant_config)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with an optional sliding attention window (``config.sliding_window``)."""

    use_sliding_window = True
