"""GGUF metadata -> an HF config, and GGUF tensor names -> HF parameter names, per architecture.

A GGUF file carries no ``config.json``: its metadata (llama.cpp's key names, prefixed by the
architecture, e.g. ``gemma3.embedding_length``) is the config. We rebuild the same
``transformers`` config object a ``config.json`` would give, so everything downstream
(``ModelConfig``, the model registry, the model classes) is shared with safetensors checkpoints,
and the tensors are renamed and transformed back into HF's conventions before the model's own
``load_weights`` sees them.

Two conversions llama.cpp's exporter applies have to be undone:

- ``llama``: the rows of ``attn_q``/``attn_k`` are permuted per head from HF's rotate-half rope
  layout to ggml's interleaved-pair layout; we permute them back.
- ``gemma3``: every RMSNorm weight is stored as ``1 + w`` (ggml's norm multiplies by the weight,
  Gemma's by ``1 + weight``); we subtract 1 in float32, as HF transformers does when it reads the
  same file, so both compute ``1 + w`` from bit-identical ``w``.

Mixture-of-experts files (``qwen3moe``) store each layer's experts stacked, one tensor per
projection (``blk.N.ffn_gate_exps.weight [E, I, H]``, ``ffn_up_exps``, ``ffn_down_exps [E, H, I]``)
and the router as ``ffn_gate_inp``; the stacks are split back into HF's per-expert tensors
(:func:`hf_expert_stack_name`), so the model loads them as it loads an HF checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedlm.core.model_loader.gguf_reader import GGUFFile

__all__ = ["EXPERT_STACKS", "SUPPORTED_ARCHITECTURES", "GGUFArch", "get_arch", "hf_config_from_gguf",
           "hf_expert_stack_name"]


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF ``general.architecture`` maps onto an HF model."""

    name: str
    hf_architecture: str
    #: ``blk.N.ffn_norm``: the pre-MLP norm, named after the block layout of the HF model
    ffn_norm: str
    #: llama.cpp permuted q/k rows into ggml's interleaved rope layout
    qk_permuted: bool = False
    #: stored norm weights are ``hf + norm_shift``
    norm_shift: float = 0.0
    #: mixture-of-experts layers: stacked experts (``ffn_*_exps``) and a router (``ffn_gate_inp``)
    experts: bool = False


_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", "post_attention_layernorm", qk_permuted=True),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", "post_attention_layernorm"),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", "post_attention_layernorm"),
    "gemma3": GGUFArch("gemma3", "Gemma3ForCausalLM", "pre_feedforward_layernorm", norm_shift=1.0),
    "qwen3moe": GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", "post_attention_layernorm", experts=True),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)

# blk.N.<gguf part> -> model.layers.N.<HF part>; ffn_norm depends on the architecture
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
#: ``blk.N.<stack>``: a MoE layer's experts, stacked ``[E, out, in]`` -> ``mlp.experts.<e>.<HF part>``
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
#: tensors llama.cpp may add that hold nothing the HF model has
_IGNORED = ("rope_freqs.weight",)


def get_arch(gguf: GGUFFile) -> GGUFArch:
    """The :class:`GGUFArch` of the file; ``ValueError`` naming the supported ones otherwise."""
    arch = gguf.architecture
    if arch not in _ARCHS:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCHS[arch]


def hf_tensor_name(arch: GGUFArch, gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None for tensors with no HF counterpart."""
    if gguf_name in _IGNORED:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part == "ffn_gate_inp" and not arch.experts:
            return None
        hf_part = arch.ffn_norm if part == "ffn_norm" else _BLOCK_NAMES.get(part)
        return f"model.layers.{layer}.{hf_part}.{kind}" if hf_part else None
    m = _TOP_RE.match(gguf_name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def hf_expert_stack_name(arch: GGUFArch, gguf_name: str) -> str | None:
    """For a stacked-experts tensor of a MoE architecture, the HF name of expert ``e``'s slice as a
    format string (``"model.layers.3.mlp.experts.{}.gate_proj.weight"``); None otherwise."""
    m = _BLOCK_RE.match(gguf_name)
    if not arch.experts or m is None or m.group(2) not in EXPERT_STACKS:
        return None
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.mlp.experts.{{}}.{EXPERT_STACKS[part]}.{kind}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    ``weight [num_heads * head_dim, ...]`` (a weight or a bias): within each head, ggml stores the
    rope pairs interleaved (row ``2i`` and ``2i + 1`` rotate together); HF's rotate-half layout
    keeps the first half and the second half of the head apart. Returns a new tensor of the same
    shape in HF's layout.
    """
    rest = weight.shape[1:]
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of :func:`unpermute_qk` (HF layout -> ggml's), used when writing GGUF files."""
    rest = weight.shape[1:]
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def to_hf_tensor(arch: GGUFArch, hf_name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """Apply the inverse of llama.cpp's export transforms to one float32 tensor."""
    if arch.qk_permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
        heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        tensor = unpermute_qk(tensor, heads)
    if arch.norm_shift and hf_name.endswith("norm.weight"):
        tensor = tensor.float() - arch.norm_shift
    return tensor


# -- the config ------------------------------------------------------------------------------------


def _int(gguf: GGUFFile, key: str, default: int | None = None) -> int | None:
    value = gguf.get(key)
    if value is None:
        return default
    if isinstance(value, np.ndarray):
        uniq = np.unique(value)
        if len(uniq) != 1:
            raise ValueError(f"{gguf.path}: {key} differs between layers ({value.tolist()}); not supported")
        return int(uniq[0])
    return int(value)


def _require_int(gguf: GGUFFile, key: str) -> int:
    value = _int(gguf, key)
    if value is None:
        raise ValueError(f"{gguf.path}: GGUF metadata lacks {key!r}, which a {gguf.architecture} model needs")
    return value


def _config_dtype(gguf: GGUFFile) -> str:
    """``float16``/``bfloat16`` when every matrix is stored in that type, else ``float32`` (quantized
    files: ``dtype="auto"`` then picks the platform default)."""
    types = {t.ggml_type for t in gguf.tensors if len(t.shape) == 2}
    return {frozenset({1}): "float16", frozenset({30}): "bfloat16"}.get(frozenset(types), "float32")


def _rope_scaling(gguf: GGUFFile, a: str) -> dict[str, Any] | None:
    kind = gguf.get(f"{a}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(gguf.get(f"{a}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        orig = _require_int(gguf, f"{a}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    raise ValueError(f"{gguf.path}: rope scaling type {kind!r} is not supported; supported: linear, yarn")


def hf_config_from_gguf(gguf: GGUFFile) -> Any:
    """The ``transformers`` config object equivalent to the file's metadata.

    Raises ``ValueError`` naming the file for an unsupported architecture or missing metadata.
    """
    from pagedlm.core.model_loader.hf_config import config_class

    arch = get_arch(gguf)
    a = arch.name
    names = {t.name: t for t in gguf.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{gguf.path}: no token_embd.weight tensor; not a complete {a} model")
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{gguf.path}: has a rope_freqs tensor (Llama 3.1-style rope frequency factors), which is not supported yet"
        )
    hidden = _require_int(gguf, f"{a}.embedding_length")
    heads = _require_int(gguf, f"{a}.attention.head_count")
    moe: dict[str, Any] = _moe_kwargs(gguf, names) if a == "qwen3moe" else {}
    head_dim = _int(gguf, f"{a}.attention.key_length") or _int(gguf, f"{a}.rope.dimension_count") or hidden // heads
    kwargs: dict[str, Any] = dict(
        vocab_size=names["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=(_int(gguf, f"{a}.feed_forward_length") or moe["moe_intermediate_size"]) if moe
        else _require_int(gguf, f"{a}.feed_forward_length"),
        num_hidden_layers=_require_int(gguf, f"{a}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_int(gguf, f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=_int(gguf, f"{a}.context_length", 2048),
        rms_norm_eps=float(gguf.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf, a),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_int(gguf, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_int(gguf, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_int(gguf, "tokenizer.ggml.padding_token_id"),
        architectures=[arch.hf_architecture],
    )
    has_qkv_bias = "blk.0.attn_q.bias" in names
    cls: Any
    if a == "llama":
        kwargs.update(attention_bias=has_qkv_bias, mlp_bias=False, hidden_act="silu")
        cls = config_class("LlamaConfig")
    elif a == "qwen2":
        kwargs.update(use_sliding_window=False, hidden_act="silu")
        cls = config_class("Qwen2Config")
    elif a == "qwen3":
        kwargs.update(attention_bias=has_qkv_bias, use_sliding_window=False, hidden_act="silu")
        cls = config_class("Qwen3Config")
    elif a == "qwen3moe":
        kwargs.update(attention_bias=has_qkv_bias, use_sliding_window=False, hidden_act="silu", **moe)
        cls = config_class("Qwen3MoeConfig")
    else:
        kwargs.update(_gemma3_kwargs(gguf, kwargs))
        cls = config_class("Gemma3TextConfig")
    config = cls(**kwargs)
    config.dtype = _config_dtype(gguf)
    return config


def _moe_kwargs(gguf: GGUFFile, names: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert hyperparameters. llama.cpp always renormalises the top-k weights of
    ``qwen3moe`` (as the released models' ``norm_topk_prob`` says), unless the file says otherwise;
    a layer without a router (``ffn_gate_inp``) has a dense MLP (``mlp_only_layers``)."""
    a = gguf.architecture
    layers = _require_int(gguf, f"{a}.block_count")
    norm = gguf.get(f"{a}.expert_weights_norm")
    return dict(
        num_experts=_require_int(gguf, f"{a}.expert_count"),
        num_experts_per_tok=_require_int(gguf, f"{a}.expert_used_count"),
        moe_intermediate_size=_require_int(gguf, f"{a}.expert_feed_forward_length"),
        norm_topk_prob=True if norm is None else bool(norm),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    )


def _gemma3_kwargs(gguf: GGUFFile, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 specifics. llama.cpp writes neither the local rope base nor (in older files) the
    layer pattern; its defaults are the model family's: base 10000 and every 6th layer global."""
    a = "gemma3"
    layers = base["num_hidden_layers"]
    pattern = gguf.get(f"{a}.attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray) and pattern.size == layers:
        sliding = [bool(x) for x in pattern]
    else:
        period = int(pattern) if isinstance(pattern, (int, np.integer)) and int(pattern) > 0 else 6
        sliding = [(i + 1) % period != 0 for i in range(layers)]
    scale = gguf.get(f"{a}.attention.scale")
    if scale:
        # stored as the float32 1/sqrt(scalar); the scalar itself is an integer in every config
        query_pre_attn_scalar = round(1.0 / float(scale) ** 2)
    elif layers == 62:
        # Gemma 3 27B scales queries by hidden_size / num_heads instead of head_dim (its HF
        # config says 168); llama.cpp knows it by the layer count, and so do we.
        query_pre_attn_scalar = base["hidden_size"] // base["num_attention_heads"]
    else:
        query_pre_attn_scalar = base["head_dim"]
    out: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=_int(gguf, f"{a}.attention.sliding_window", 4096),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_base_freq=float(gguf.get(f"{a}.rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=query_pre_attn_scalar,
        attention_bias=False,
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = gguf.get(f"{a}.{key}")
        out[key] = float(value) if value else None
    return out
