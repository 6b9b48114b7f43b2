"""Writing an HF checkpoint directory as a GGUF file (llama.cpp's conventions), with ``gguf``'s writer.

The inverse of what :mod:`gguf_loader` reads, for the architectures it supports: metadata under
llama.cpp's keys, tensors under GGUF names, llama's q/k rows permuted into ggml's rope layout,
Gemma's norms stored as ``1 + w``, and a byte-level BPE tokenizer (``tokenizer.json``) as
``tokenizer.ggml.*`` metadata. Tests use it to turn the tiny random checkpoints into GGUF files;
it is not meant to replace llama.cpp's converter for real models.

Matrices are written in ``tensor_type`` (``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ``Q4_1``,
``Q5_0``, ``Q5_1``: the types ``gguf.quants`` can quantize); 1-D tensors (norms, biases) stay F32 as
llama.cpp keeps them.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch

from pagedlm.core.model_loader.gguf_config import (
    _ARCHS,
    _BLOCK_NAMES,
    _TOP_NAMES,
    EXPERT_STACKS,
    GGUFArch,
    permute_qk,
)
from pagedlm.core.model_loader.gguf_reader import import_gguf

__all__ = ["gguf_tensor_name", "write_gguf"]

_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACK_OF = {hf_part: gguf_part for gguf_part, hf_part in EXPERT_STACKS.items()}
_ARCH_OF = {spec.hf_architecture: spec for spec in _ARCHS.values()}


def gguf_tensor_name(arch: GGUFArch, hf_name: str) -> str:
    """The GGUF name of an HF parameter (the inverse of ``gguf_config.hf_tensor_name``)."""
    m = _HF_BLOCK_RE.match(hf_name)
    if m:
        layer, part, kind = m.groups()
        if part == arch.ffn_norm:
            return f"blk.{layer}.ffn_norm.{kind}"
        for gguf_part, hf_part in _BLOCK_NAMES.items():
            if hf_part == part:
                return f"blk.{layer}.{gguf_part}.{kind}"
    else:
        stem, _, kind = hf_name.rpartition(".")
        for gguf_part, hf_part in _TOP_NAMES.items():
            if hf_part == stem:
                return f"{gguf_part}.{kind}"
    raise ValueError(f"no GGUF name for {hf_name!r} in architecture {arch.name}")


def export_tensor(arch: GGUFArch, hf_name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """The float32 tensor llama.cpp would store for HF parameter ``hf_name``."""
    tensor = tensor.detach().to(torch.float32)
    if arch.qk_permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
        heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
        tensor = permute_qk(tensor, heads)
    if arch.norm_shift and hf_name.endswith("norm.weight"):
        tensor = tensor + arch.norm_shift
    return tensor


def _metadata(writer: Any, arch: GGUFArch, config: Any) -> None:
    a = arch.name
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_uint32(f"{a}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{a}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{a}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{a}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", getattr(config, "num_key_value_heads", None) or heads)
    writer.add_uint32(f"{a}.attention.key_length", head_dim)
    writer.add_uint32(f"{a}.attention.value_length", head_dim)
    writer.add_uint32(f"{a}.rope.dimension_count", head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    params = getattr(config, "rope_parameters", None) or {}
    if a == "gemma3":
        full = params.get("full_attention", {}) if isinstance(params.get("full_attention"), dict) else {}
        local = params.get("sliding_attention", {}) if isinstance(params.get("sliding_attention"), dict) else {}
        writer.add_float32(f"{a}.rope.freq_base", float(full.get("rope_theta", getattr(config, "rope_theta", 1e6))))
        swa = local.get("rope_theta", getattr(config, "rope_local_base_freq", 10000.0))
        writer.add_float32(f"{a}.rope.freq_base_swa", float(swa))
        writer.add_uint32(f"{a}.attention.sliding_window", config.sliding_window)
        writer.add_array(f"{a}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in config.layer_types])
        writer.add_float32(f"{a}.attention.scale", float(config.query_pre_attn_scalar) ** -0.5)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key, None):
                writer.add_float32(f"{a}.{key}", float(getattr(config, key)))
    else:
        theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        writer.add_float32(f"{a}.rope.freq_base", float(theta))
    if arch.experts:
        writer.add_uint32(f"{a}.expert_count", _num_experts(config))
        writer.add_uint32(f"{a}.expert_used_count", config.num_experts_per_tok)
        writer.add_uint32(f"{a}.expert_feed_forward_length", config.moe_intermediate_size)
        writer.add_bool(f"{a}.expert_weights_norm", bool(getattr(config, "norm_topk_prob", True)))
    writer.add_uint32("general.file_type", 0)


def _num_experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def _tokenizer_metadata(writer: Any, model_dir: str, config: Any, arch: GGUFArch) -> None:
    """``tokenizer.json`` (byte-level BPE) as ``tokenizer.ggml.*`` keys; skipped when absent."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: only byte-level BPE tokenizers can be exported (got {model.get('type')!r})")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [1] * size  # NORMAL
    for token, idx in vocab.items():
        tokens[idx] = token
        if token in special:
            types[idx] = 3  # CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.name.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, value in (("bos", config.bos_token_id), ("eos", config.eos_token_id), ("padding", config.pad_token_id)):
        if isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, str):
            writer.add_chat_template(template)


def write_gguf(model_dir: str, out_path: str, tensor_type: str = "F32") -> str:
    """Write the HF checkpoint in ``model_dir`` as the GGUF file ``out_path``; return ``out_path``.

    Raises ``ValueError`` for an architecture :mod:`gguf_loader` does not read or a
    ``tensor_type`` that ``gguf.quants`` cannot produce.
    """
    from transformers import AutoConfig

    from pagedlm.core.model_loader.weight_utils import find_weight_files, safetensors_weights_iterator

    gguf = import_gguf()
    writable = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    if tensor_type not in writable:
        raise ValueError(f"tensor_type={tensor_type!r}: writable types are {', '.join(writable)}")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    config = AutoConfig.from_pretrained(model_dir)
    arch_name = (getattr(config, "architectures", None) or ["?"])[0]
    if arch_name not in _ARCH_OF:
        raise ValueError(f"{model_dir}: architecture {arch_name!r} cannot be written as GGUF; "
                         f"supported: {', '.join(sorted(_ARCH_OF))}")
    arch = _ARCH_OF[arch_name]
    writer = gguf.GGUFWriter(out_path, arch.name)
    writer.add_name(os.path.basename(os.path.normpath(model_dir)))
    _metadata(writer, arch, config)
    _tokenizer_metadata(writer, model_dir, config, arch)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # (layer, projection) -> {expert: tensor}: experts are written stacked, once all have been read
    pending: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in safetensors_weights_iterator(find_weight_files(model_dir, "auto")):
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        data = export_tensor(arch, hf_name, tensor, config).numpy()
        expert = _HF_EXPERT_RE.match(hf_name) if arch.experts else None
        if expert is not None:
            layer, index, proj = expert.groups()
            group = pending.setdefault((layer, proj), {})
            group[int(index)] = data
            if len(group) < _num_experts(config):
                continue
            data = np.stack([group[e] for e in range(len(group))])
            del pending[(layer, proj)]
            name = f"blk.{layer}.{_STACK_OF[proj]}.weight"
        else:
            name = gguf_tensor_name(arch, hf_name)
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            # NOTE: no raw_shape: the writer derives the logical shape from the byte array's shape
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if pending:
        raise ValueError(f"{model_dir}: experts missing from the checkpoint for {sorted(pending)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
