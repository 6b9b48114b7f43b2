"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a mixture-of-experts MLP.

Each sparse layer's MLP is a router (``mlp.gate``, a plain ``[E, hidden]`` linear layer, replicated
on every rank) and ``E`` gated experts of width ``moe_intermediate_size`` (``mlp.experts.N.*``,
stacked into one :class:`~pagedlm.core.layers.fused_moe.FusedMoE`); each token goes to its
``num_experts_per_tok`` most probable experts, whose weights are renormalised to sum to 1 when
``norm_topk_prob``. Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step``
rhythm, keep a dense MLP of ``intermediate_size``. There is no shared expert (Qwen2-MoE's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.core.config import VllmConfig
from pagedlm.core.layers import (
    QKV_GATE_UP_STACKED_PARAMS,
    CausalLM,
    DecoderModel,
    GatedMLP,
    PreNormDecoderLayer,
    ReplicatedLinear,
    RMSNorm,
    maybe_prefix,
)
from pagedlm.core.layers.fused_moe import ExpertWeightLoader, FusedMoE
from pagedlm.models.qwen.qwen2 import SKIPPED_WEIGHTS, layer_sliding_window
from pagedlm.models.qwen.qwen3 import Qwen3Attention

__all__ = ["Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeSparseMoeBlock"]


def num_experts_of(config: Any) -> int:
    """The number of routed experts (``num_experts`` in Qwen's configs)."""
    value = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not value:
        raise ValueError("the Qwen3-MoE config names no number of experts (num_experts)")
    return int(value)


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule: a MoE MLP unless listed in ``mlp_only_layers`` or off ``decoder_sparse_step``."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """``hidden [T, H] -> [T, H]``: router logits (model dtype), softmax top-k, the experts."""

    def __init__(self, config: Any, prefix: str, quant_config: Any = None) -> None:
        super().__init__()
        num_experts = num_experts_of(config)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=maybe_prefix(prefix, "gate"))
        self.experts = FusedMoE(
            num_experts=num_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, reduce_results=True,
            renormalize=bool(getattr(config, "norm_topk_prob", False)), quant_config=quant_config,
            prefix=maybe_prefix(prefix, "experts"),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    """Qwen3's pre-norm block with a sparse (or, per the config, dense) MLP."""

    def __init__(self, config: Any, prefix: str, layer_idx: int, quant_config: Any = None) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, maybe_prefix(prefix, "self_attn"),
                                        layer_sliding_window(config, layer_idx), quant_config)
        self.mlp: nn.Module
        if is_sparse_layer(config, layer_idx):
            self.mlp = Qwen3MoeSparseMoeBlock(config, maybe_prefix(prefix, "mlp"), quant_config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                maybe_prefix(prefix, "mlp"), quant_config=quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoeModel(DecoderModel):
    """Embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.text_config
        quant_config = getattr(vllm_config, "quant_config", None)
        super().__init__(config, prefix, lambda i: Qwen3MoeDecoderLayer(
            config, maybe_prefix(prefix, f"layers.{i}"), i, quant_config), quant_config=quant_config)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE under :class:`CausalLM`'s LM head; experts load from per-expert checkpoint tensors."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    skipped_weights = SKIPPED_WEIGHTS

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.text_config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.init_lm_head(prefix, vllm_config.quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts_of(self.config))
        experts = ExpertWeightLoader(self, mapping)
        return super().load_weights(experts.filter(weights)) | experts.loaded
