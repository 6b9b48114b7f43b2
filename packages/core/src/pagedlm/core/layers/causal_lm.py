"""What decoder-only models share: the pre-norm decoder body and the LM head with weight loading."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedlm.core.distributed import IntermediateTensors, get_pp_group
from pagedlm.core.layers.layernorm import RMSNorm
from pagedlm.core.layers.linear import takes_fp8_activations
from pagedlm.core.layers.mlp import FP8_FUSION_DTYPES, GatedMLP
from pagedlm.core.layers.pipeline import PPMissingLayer, is_pp_missing, make_layers
from pagedlm.core.layers.quantization.utils import QuantizedActivation
from pagedlm.core.layers.vocab_embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding


class CausalLM(nn.Module):
    """Base of ``XForCausalLM`` classes: the pagedlm model interface on top of a body.

    - ``forward(input_ids [T] int64, positions [T] int64) -> hidden_states [T, hidden]``
      (or the intermediate tensors handed to the next pipeline stage)
    - ``compute_logits(hidden_states [N, hidden]) -> [N, vocab] float32``
    - ``load_weights(iterable of (hf_name, tensor)) -> set of parameter names loaded``

    A subclass sets ``self.config`` (the HF text config) and ``self.model`` (a body with
    ``embed_tokens``, ``get_input_embeddings`` and ``forward(input_ids, positions,
    intermediate_tensors)``), then calls :meth:`init_lm_head`. ``stacked_params`` and
    ``skipped_weights`` describe its checkpoint for ``load_weights_by_name``.
    """

    stacked_params: tuple[tuple[str, str, Any], ...] = ()
    skipped_weights: tuple[str, ...] = ()
    config: Any
    model: nn.Module

    def init_lm_head(self, prefix: str, quant_config: Any = None) -> None:
        """The LM head (tied to the embedding when the config says so); ``quant_config`` may keep
        an untied head quantized (a method with ``quantizes_embeddings``, e.g. GGUF)."""
        config = self.config
        self.lm_head: ParallelLMHead | PPMissingLayer = PPMissingLayer()
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          prefix=f"{prefix}.lm_head" if prefix else "lm_head",
                                          quant_config=quant_config)
            # NOTE: a last stage that is not also the first holds no embedding to tie to; it
            # gets its own copy, loaded from the embedding's tensor (see load_weights).
            if getattr(config, "tie_word_embeddings", False) and not is_pp_missing(self.model.embed_tokens):
                self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.lm_head, ParallelLMHead), "logits are computed on the last pipeline stage only"
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Imported here: the loader imports the layers package.
        from pagedlm.core.model_loader import load_weights_by_name

        skip = self.skipped_weights
        if getattr(self.config, "tie_word_embeddings", False):
            if is_pp_missing(self.model.embed_tokens) and not is_pp_missing(self.lm_head):
                # A last pipeline stage without the embedding: its untied head copy is the
                # embedding's tensor.
                weights = (("lm_head.weight" if n == "model.embed_tokens.weight" else n, w)
                           for n, w in weights if n != "lm_head.weight")
            else:
                # NOTE: the head shares the embedding Parameter; a saved copy would load it twice.
                skip = (*skip, "lm_head.weight")
        return load_weights_by_name(self, weights, self.stacked_params, skip)


class PreNormDecoderLayer(nn.Module):
    """One pre-norm block (Llama, Qwen2/3): ``norm -> self_attn -> norm -> mlp``. Subclasses build
    ``input_layernorm`` and ``post_attention_layernorm`` (``RMSNorm``), ``self_attn`` and ``mlp``.

    The residual stream is carried separately so each norm fuses the add before it:
    ``forward(positions [T], hidden [T, H], residual) -> (hidden, residual)``, the block's true
    output being ``hidden + residual``.

    FP8 with dynamic per-token activations: a norm whose consumer takes a
    :class:`QuantizedActivation` (``self_attn.qkv_proj``, a :class:`GatedMLP`'s ``gate_up_proj``:
    :func:`takes_fp8_activations`) quantizes its output for it in its own pass, in bf16/fp16
    models; the result is bit for bit the unfused one. The attention side needs the attention
    class to declare ``forwards_hidden_to_qkv_proj = True``: its forward hands ``hidden_states``
    to ``self.qkv_proj`` untouched (a quantized input supports nothing else). Decided at the
    first forward, once LoRA has wrapped whichever layers it adapts.
    """

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    self_attn: nn.Module
    mlp: nn.Module
    #: ``(quantize for qkv_proj, quantize for the MLP)``, set at the first forward
    _fp8_fusion: tuple[bool, bool] | None = None

    def _decide_fp8_fusion(self, dtype: torch.dtype) -> tuple[bool, bool]:
        if dtype not in FP8_FUSION_DTYPES:
            return False, False

        def fusable(norm: nn.Module, consumer: nn.Module | None) -> bool:
            return isinstance(norm, RMSNorm) and consumer is not None and takes_fp8_activations(consumer)

        attn = self.self_attn
        qkv = getattr(attn, "qkv_proj", None) if getattr(attn, "forwards_hidden_to_qkv_proj", False) else None
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, GatedMLP) else None
        return fusable(self.input_layernorm, qkv), fusable(self.post_attention_layernorm, gate_up)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fp8_fusion is None:
            self._fp8_fusion = self._decide_fp8_fusion(hidden_states.dtype)
        quant_qkv, quant_mlp = self._fp8_fusion
        normed: torch.Tensor | QuantizedActivation
        if residual is None:
            residual = hidden_states
            normed = (self.input_layernorm(hidden_states, quant_fp8=True) if quant_qkv
                      else self.input_layernorm(hidden_states))
        elif quant_qkv:
            normed, residual = self.input_layernorm(hidden_states, residual, quant_fp8=True)
        else:
            normed, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, normed)
        if quant_mlp:
            normed, residual = self.post_attention_layernorm(hidden_states, residual, quant_fp8=True)
        else:
            normed, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: ``(input_ids [T], positions [T]) -> [T, hidden]``.

    ``make_layer(i)`` builds decoder layer ``i``; a layer is called as
    ``layer(positions, hidden_states, residual) -> (hidden_states, residual)`` (pre-norm with a
    running residual, as Llama and Qwen are).
    """

    def __init__(self, config: Any, prefix: str, make_layer: Callable[[int], nn.Module],
                 quant_config: Any = None) -> None:
        super().__init__()
        self.config = config
        # NOTE: with pipeline parallelism this rank builds only its stage's modules (the others
        # are parameter-free placeholders), so each stage holds and loads only its share.
        pp = get_pp_group()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                   prefix=f"{prefix}.embed_tokens" if prefix else "embed_tokens",
                                   quant_config=quant_config)
            if pp.is_first_rank else PPMissingLayer()
        )
        self.start_layer, self.end_layer, self.layers = make_layers(config.num_hidden_layers, make_layer)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """A non-first pipeline stage starts from the previous stage's ``intermediate_tensors``;
        a non-last stage returns its activations as ``IntermediateTensors`` instead."""
        residual: torch.Tensor | None
        if intermediate_tensors is None:
            hidden_states = self.get_input_embeddings(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            assert residual is not None
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
