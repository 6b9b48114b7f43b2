"""The ``gguf`` load format: a single ``.gguf`` file as config, weights and tokenizer.

``ModelConfig(model="x.gguf")`` calls :func:`load_gguf_model_config`; the loader streams weights
from :func:`gguf_weights_iterator` (HF names, dequantized at load time) into the model's ordinary
``load_weights``; :mod:`pagedlm.core.model_loader.gguf_tokenizer` builds the tokenizer.
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterator
from typing import Any

import torch

from pagedlm.core.layers.quantization.gguf import GGUFWeight
from pagedlm.core.logger import init_logger
from pagedlm.core.model_loader.gguf_config import (
    GGUFArch,
    get_arch,
    hf_config_from_gguf,
    hf_expert_stack_name,
    hf_tensor_name,
    to_hf_tensor,
    unpermute_qk,
)
from pagedlm.core.model_loader.gguf_dequant import SUPPORTED_TYPES, dequantize, is_supported
from pagedlm.core.model_loader.gguf_reader import GGUFFile, read_gguf

logger = init_logger(__name__)

__all__ = ["find_gguf_file", "gguf_weights_iterator", "is_gguf_file", "load_gguf_model_config"]


def is_gguf_file(path: str) -> bool:
    """True for an existing file named ``*.gguf`` or starting with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def find_gguf_file(path: str) -> str | None:
    """The GGUF file ``path`` designates: the file itself, or the one ``*.gguf`` of a directory
    that has no ``config.json``. None when ``path`` is an HF directory or holds no GGUF file.

    Raises ``ValueError`` for a directory with several GGUF files (which one is ambiguous).
    """
    if os.path.isfile(path):
        return path if is_gguf_file(path) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}); pass the one to load as model=FILE")
    return os.path.join(path, found[0]) if found else None


def _check_tensors(gguf: GGUFFile, arch: GGUFArch) -> None:
    """Fail before anything is built if a tensor is of an unsupported type or has an unknown name."""
    unknown, bad_types = [], []
    for info in gguf.tensors:
        if hf_tensor_name(arch, info.name) is None and hf_expert_stack_name(arch, info.name) is None:
            if info.name != "rope_freqs.weight":
                unknown.append(info.name)
        elif not is_supported(info.ggml_type):
            bad_types.append(f"{info.name} ({info.type_name})")
    if bad_types:
        shown = ", ".join(bad_types[:5]) + (f", ... ({len(bad_types) - 5} more)" if len(bad_types) > 5 else "")
        raise ValueError(
            f"{gguf.path}: unsupported GGUF tensor type in {shown}; supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    if unknown:
        shown = ", ".join(unknown[:5]) + (f", ... ({len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise ValueError(
            f"{gguf.path}: tensors {shown} have no counterpart in pagedlm's {arch.hf_architecture}; "
            "the file may hold a variant of the architecture that is not supported"
        )


def load_gguf_model_config(path: str) -> tuple[Any, dict[str, Any]]:
    """``(hf_config, generation_config)`` of the GGUF file at ``path``.

    Reads only the header (well under a second even for a 262k-token vocabulary) and checks every
    tensor's name and type, so an unsupported file fails here, before any weight is read.
    """
    with read_gguf(path) as gguf:
        arch = get_arch(gguf)
        _check_tensors(gguf, arch)
        config = hf_config_from_gguf(gguf)
        eos = [config.eos_token_id] if config.eos_token_id is not None else []
        tokens = gguf.get("tokenizer.ggml.tokens")
        if arch.name == "gemma3" and isinstance(tokens, list) and "<end_of_turn>" in tokens[:1024]:
            # Instruction-tuned Gemma ends a reply with <end_of_turn>, not <eos>; llama.cpp and
            # Google's generation_config.json stop at both.
            eos.append(tokens.index("<end_of_turn>"))
    generation_config: dict[str, Any] = {"eos_token_id": eos} if eos else {}
    if config.bos_token_id is not None:
        generation_config["bos_token_id"] = config.bos_token_id
    return config, generation_config


def gguf_weights_iterator(path: str, hf_config: Any | None = None,
                          quantized: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight of the GGUF file, dequantized, except the
    names in ``quantized``: those come as :class:`GGUFWeight` (the blocks as stored, a view of the file
    that the weight loader copies; the ``gguf`` quantization method computes on them).

    ``hf_config`` (from :func:`load_gguf_model_config`; rebuilt when None) supplies the head counts
    that undoing llama's q/k permutation needs. Tensors are decoded one at a time, so peak memory
    is the model plus one float32 tensor. A stack of experts (``ffn_gate_exps`` ...) is yielded as
    one tensor per expert, under HF's per-expert names.
    """
    with read_gguf(path) as gguf:
        arch = get_arch(gguf)
        _check_tensors(gguf, arch)
        config = hf_config if hf_config is not None else hf_config_from_gguf(gguf)
        for info in gguf.tensors:
            name = hf_tensor_name(arch, info.name)
            stack = hf_expert_stack_name(arch, info.name)
            if name is None and stack is None:
                continue
            if name in quantized:
                yield name, _quantized_weight(arch, name, gguf.tensor_bytes(info), info, config)
                continue
            try:
                tensor = dequantize(gguf.tensor_bytes(info), info.ggml_type, info.shape)
            except ValueError as e:
                raise ValueError(f"{path}: tensor {info.name!r} ({info.type_name}, shape {info.shape}): {e}") from e
            if stack is not None:
                for expert in range(tensor.shape[0]):
                    yield stack.format(expert), tensor[expert]
                continue
            assert name is not None
            yield name, to_hf_tensor(arch, name, tensor, config)


def _quantized_weight(arch: GGUFArch, name: str, data: Any, info: Any, config: Any) -> GGUFWeight:
    """The blocks of a 2-D tensor as ``[rows, row_bytes]``; llama's q/k row permutation is undone on
    whole rows (each row's blocks move together, unchanged)."""
    rows, k = info.shape
    blocks = torch.from_numpy(data).view(rows, -1)
    if arch.qk_permuted and (".q_proj." in name or ".k_proj." in name):
        blocks = unpermute_qk(blocks, config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads)
    return GGUFWeight(blocks, info.ggml_type, (rows, k))
