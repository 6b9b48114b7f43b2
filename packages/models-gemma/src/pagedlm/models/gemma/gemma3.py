"""Gemma 3 decoder-only language models (the text model, ``Gemma3ForCausalLM``).

Differences from a Llama block, each of which changes the logits if missed:

- token embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the model dtype first;
- every RMSNorm multiplies by ``1 + weight`` and is computed in float32 (cast back at the end);
- q and k are RMS-normalised per head before rotary;
- four norms per block: before and after attention, before and after the MLP, each *sandwiching*
  its sub-layer before the residual add;
- the MLP is gated with tanh-approximated GELU;
- scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``);
- layers alternate between sliding-window ("local") and global attention per
  ``config.layer_types``, each kind with its own RoPE base (10k local, 1M global);
- the LM head is tied to the embedding; optional final logit soft-capping.

All token tensors are flat ``[T, ...]`` (every request of the step concatenated); head counts are
per tensor-parallel rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedlm.core.attention import Attention
from pagedlm.core.config import VllmConfig
from pagedlm.core.layers import (
    QKV_GATE_UP_STACKED_PARAMS,
    GatedMLP,
    GemmaRMSNorm,
    LogitsProcessor,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    maybe_prefix,
    set_attention_heads,
)
from pagedlm.core.layers.quantization import QuantizationConfig
from pagedlm.core.layers.rotary import RotaryEmbedding
from pagedlm.core.model_loader import load_weights_by_name
from pagedlm.models.gemma.chat_template import GEMMA_CHAT_TEMPLATE

__all__ = ["Gemma3Attention", "Gemma3ForCausalLM", "Gemma3Model"]

SKIPPED_WEIGHTS = ("rotary_emb.inv_freq",)
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_type(config: Any, layer_idx: int) -> str:
    """``"sliding_attention"`` or ``"full_attention"`` for layer ``layer_idx``.

    ``config.layer_types`` when present; older configs give a period instead (every
    ``sliding_window_pattern``-th layer is global, 6 by default).
    """
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[layer_idx])
    period = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", None) or 6
    return FULL if (layer_idx + 1) % int(period) == 0 else SLIDING


def _rope(config: Any, kind: str, head_dim: int, max_position: int) -> RotaryEmbedding:
    """The rotary embedding of one layer type.

    transformers >= 5 keeps one ``rope_parameters`` entry per layer type; 4.x configs have the
    global ``rope_theta`` / ``rope_scaling`` plus ``rope_local_base_freq`` (local layers never
    scale), which is translated here to the same thing.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        return get_rope(head_dim, max_position, config, is_neox_style=True, layer_type=kind)
    if kind == FULL:
        return get_rope(head_dim, max_position, config, is_neox_style=True)
    local = SimpleNamespace(rope_theta=getattr(config, "rope_local_base_freq", None) or 10000.0, rope_scaling=None,
                            partial_rotary_factor=1.0)
    return get_rope(head_dim, max_position, local, is_neox_style=True)


class Gemma3Attention(nn.Module):
    """``hidden [T, hidden] -> [T, hidden]``: qkv projection, per-head q/k norm, rotary (this
    layer type's base), paged attention (windowed on local layers), o_proj."""

    def __init__(self, config: Any, prefix: str, layer_idx: int, max_position: int,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        set_attention_heads(self, config)
        hidden_size = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))

        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads,
            bias=bias, prefix=maybe_prefix(prefix, "qkv_proj"), quant_config=quant_config,
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim, hidden_size, bias=bias, prefix=maybe_prefix(prefix, "o_proj"),
            quant_config=quant_config,
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.layer_type = layer_type(config, layer_idx)
        self.rotary_emb = _rope(config, self.layer_type, self.head_dim, max_position)
        sliding_window = config.sliding_window if self.layer_type == SLIDING else None
        scalar = getattr(config, "query_pre_attn_scalar", None) or self.head_dim
        # NOTE: no logits_soft_cap: Gemma 3 dropped Gemma 2's attention soft-capping, and HF's
        # Gemma3Attention ignores config.attn_logit_softcapping even when a config sets it.
        self.attn = Attention(
            self.num_heads, self.head_dim, scalar**-0.5, self.num_kv_heads,
            prefix=maybe_prefix(prefix, "attn"), sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # each head is normalised over its own D values, then rotated
        q, k = self.rotary_emb.forward_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        return self.o_proj(self.attn(q, k, v))


class Gemma3DecoderLayer(nn.Module):
    """Two sandwich-normed residual sub-layers, ``h + post_norm(sublayer(pre_norm(h)))`` for
    attention and then the MLP.

    ``forward(positions, x [T, hidden], residual [T, hidden] | None) -> (x, residual)``: the running
    sum ``h`` is carried as ``x + residual`` so that each add fuses into the next norm (HF adds in
    the model dtype before normalising; the fused ops do the same). ``residual=None`` for the
    first layer, whose ``x`` is ``h`` itself.
    """

    def __init__(self, config: Any, prefix: str, layer_idx: int, max_position: int,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, maybe_prefix(prefix, "self_attn"), layer_idx, max_position,
                                         quant_config)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(hidden, config.intermediate_size, act, maybe_prefix(prefix, "mlp"),
                            quant_config=quant_config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    """Scaled embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.text_config
        self.config = config
        max_position = int(vllm_config.model_config.max_model_len or config.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "embed_tokens"),
            quant_config=vllm_config.quant_config,
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, maybe_prefix(prefix, f"layers.{i}"), i, max_position, vllm_config.quant_config)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # sqrt(hidden) rounded to float32 and then to the model dtype, as HF does (in bf16,
        # sqrt(3072) = 55.43 becomes 55.5, and the trained weights expect exactly that).
        normalizer = torch.tensor(math.sqrt(config.hidden_size), dtype=torch.float32).to(torch.get_default_dtype())
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", normalizer, persistent=False)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.get_input_embeddings(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    """The pagedlm model interface:

    - ``forward(input_ids [T] int64, positions [T] int64) -> hidden_states [T, hidden]``
    - ``compute_logits(hidden_states [N, hidden]) -> [N, vocab] float32`` (soft-capped when the
      config sets ``final_logit_softcapping``)
    - ``load_weights(iterable of (hf_name, tensor)) -> set of parameter names loaded``
    - ``default_chat_template``: used when the checkpoint's tokenizer has none
    """

    default_chat_template = GEMMA_CHAT_TEMPLATE

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
        if pp > 1:
            raise ValueError(
                f"Gemma3ForCausalLM does not support pipeline parallelism yet (got pipeline_parallel_size={pp})"
            )
        config = vllm_config.model_config.text_config
        self.config = config
        self.model = Gemma3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        # Gemma checkpoints have no separate head; configs that omit the flag mean tied.
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(
            config.vocab_size, soft_cap=getattr(config, "final_logit_softcapping", None) or None
        )

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # NOTE: a tied head shares the embedding Parameter; a saved copy would load it twice.
        skip = (*SKIPPED_WEIGHTS, "lm_head.weight") if self.tied else SKIPPED_WEIGHTS
        return load_weights_by_name(self, weights, QKV_GATE_UP_STACKED_PARAMS, skip)
