"""Model building blocks shared by every model package.

Layers are tensor-parallel aware: they read this process's TP rank and size from
:mod:`pagedlm.core.distributed` when built and hold only this rank's shard of each weight.
Every parameter carries ``param.weight_loader(param, loaded_weight, shard_id=None)``, which
takes the *full* checkpoint tensor and copies this rank's slice, so model ``load_weights``
methods never do sharding arithmetic themselves.
"""

from pagedlm.core.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul_fn
from pagedlm.core.layers.causal_lm import CausalLM, DecoderModel, PreNormDecoderLayer
from pagedlm.core.layers.fused_moe import FusedMoE
from pagedlm.core.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedlm.core.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    maybe_prefix,
    set_attention_heads,
)
from pagedlm.core.layers.mlp import QKV_GATE_UP_STACKED_PARAMS, GatedMLP
from pagedlm.core.layers.pipeline import PPMissingLayer, is_pp_missing, make_layers, pp_layer_range
from pagedlm.core.layers.rotary import RotaryEmbedding, get_rope
from pagedlm.core.layers.vocab_embedding import (
    LogitsProcessor,
    ParallelLMHead,
    VocabParallelEmbedding,
    compute_logits,
)

__all__ = [
    "CausalLM",
    "ColumnParallelLinear",
    "DecoderModel",
    "FusedMoE",
    "GatedMLP",
    "GeluAndMul",
    "GemmaRMSNorm",
    "LinearBase",
    "LogitsProcessor",
    "MergedColumnParallelLinear",
    "PPMissingLayer",
    "PreNormDecoderLayer",
    "QKV_GATE_UP_STACKED_PARAMS",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "compute_logits",
    "get_act_and_mul_fn",
    "get_rope",
    "is_pp_missing",
    "make_layers",
    "maybe_prefix",
    "pp_layer_range",
    "set_attention_heads",
]
