"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse mixture-of-experts MLP.

Each layer's ``block_sparse_moe`` is a router (``gate``, ``[E, hidden]``, replicated on every
rank) and ``num_local_experts`` gated experts (``experts.N.w1`` gate, ``w3`` up, ``w2`` down)
stacked into one :class:`~pagedlm.core.layers.fused_moe.FusedMoE`; every token goes to its top 2
experts (``num_experts_per_tok``) with their softmax weights renormalised to sum to 1.
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
    PreNormDecoderLayer,
    ReplicatedLinear,
    RMSNorm,
    maybe_prefix,
)
from pagedlm.core.layers.fused_moe import ExpertWeightLoader, FusedMoE
from pagedlm.models.llama.modeling import SKIPPED_WEIGHTS, LlamaAttention

__all__ = ["MixtralForCausalLM", "MixtralModel", "MixtralMoE"]


class MixtralMoE(nn.Module):
    """``hidden [T, H] -> [T, H]``: router logits (model dtype), softmax top-k renormalised, the experts."""

    def __init__(self, config: Any, prefix: str, quant_config: Any = None) -> None:
        super().__init__()
        num_experts = config.num_local_experts
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=maybe_prefix(prefix, "gate"))
        self.experts = FusedMoE(
            num_experts=num_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, reduce_results=True, renormalize=True,
            quant_config=quant_config, prefix=maybe_prefix(prefix, "experts"),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralDecoderLayer(PreNormDecoderLayer):
    """Mistral's pre-norm block with ``block_sparse_moe`` (the checkpoint's name) as its MLP."""

    def __init__(self, config: Any, prefix: str, quant_config: Any = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, maybe_prefix(prefix, "self_attn"),
                                        getattr(config, "sliding_window", None), quant_config)
        self.block_sparse_moe = MixtralMoE(config, maybe_prefix(prefix, "block_sparse_moe"), quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:  # type: ignore[override]
        """What :class:`PreNormDecoderLayer`'s forward runs after attention."""
        return self.block_sparse_moe


class MixtralModel(DecoderModel):
    """Embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.text_config
        quant_config = getattr(vllm_config, "quant_config", None)
        super().__init__(config, prefix, lambda i: MixtralDecoderLayer(
            config, maybe_prefix(prefix, f"layers.{i}"), quant_config), quant_config=quant_config)


class MixtralForCausalLM(CausalLM):
    """Mixtral under :class:`CausalLM`'s LM head; experts load from per-expert checkpoint tensors."""

    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    skipped_weights = SKIPPED_WEIGHTS

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.text_config
        self.model = MixtralModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.init_lm_head(prefix, vllm_config.quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = FusedMoE.make_expert_params_mapping("w1", "w2", "w3", self.config.num_local_experts)
        experts = ExpertWeightLoader(self, mapping)
        return super().load_weights(experts.filter(weights)) | experts.loaded
