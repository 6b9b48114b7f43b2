"""Quantization methods: the registry (plugins' and core's built-ins) and how a config is chosen.

``get_quant_config(model_config)`` returns the :class:`QuantizationConfig` of a model, or None:

- the user's ``quantization=NAME`` (``LLM(quantization="fp8")``, ``--quantization fp8``), or
- the checkpoint's ``quantization_config`` in ``config.json`` (its ``quant_method``), or
- neither: None (full precision).

A method a registered class claims through ``override_quantization_method`` wins (vLLM's rule).
Both given and disagreeing is an error. Names are the registry's (``pagedlm_register_quantization_methods``):
core registers ``fp8``, ``compressed-tensors``, ``gptq``, ``awq``, ``gguf`` and ``int8`` (a ``.gguf`` model's method is
chosen once the platform is known: :func:`pagedlm.core.layers.quantization.gguf.gguf_quant_config`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from pagedlm.core.layers.quantization.base_config import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
)

if TYPE_CHECKING:
    from pagedlm.core.config import ModelConfig

__all__ = [
    "LinearMethodBase",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "UnquantizedLinearMethod",
    "get_quant_config",
    "get_quantization_config_cls",
    "normalize_method_name",
    "registered_quantization_methods",
]


#: vLLM's names of kernels for a format (``--quantization gptq_marlin``, as vLLM's own log advises)
#: -> the format's method: pagedlm picks its kernels per platform, so they name the same method
KERNEL_ALIASES = {"gptq-marlin": "gptq", "gptq-bitblas": "gptq", "awq-marlin": "awq"}


def normalize_method_name(name: str) -> str:
    """``"compressed_tensors"`` and ``"Compressed-Tensors"`` are ``"compressed-tensors"``;
    ``"gptq_marlin"`` is ``"gptq"`` (:data:`KERNEL_ALIASES`)."""
    key = str(name).strip().lower().replace("_", "-")
    return KERNEL_ALIASES.get(key, key)


def registered_quantization_methods() -> dict[str, str]:
    """Method name -> ``"module:Class"``, from every plugin (and core)."""
    from pagedlm.core.plugins import get_plugins

    return get_plugins().quantization_methods()


def get_quantization_config_cls(name: str) -> type[QuantizationConfig]:
    """The registered class of method ``name``; ``ValueError`` listing the registered ones."""
    from pagedlm.core.plugins import PluginError, resolve_class_path

    methods = registered_quantization_methods()
    key = normalize_method_name(name)
    if key not in methods:
        raise ValueError(f"unknown quantization method {name!r}; supported: {', '.join(sorted(methods))} "
                         "(a plugin adds more through pagedlm_register_quantization_methods)")
    try:
        cls = resolve_class_path(methods[key])
    except Exception as e:
        raise PluginError(f"quantization method {key!r}: cannot import {methods[key]}: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)):
        raise PluginError(f"quantization method {key!r}: {methods[key]} is not a QuantizationConfig subclass")
    return cls


def hf_quant_config(hf_config: Any, model_dir: str | None = None,
                    filenames: tuple[str, ...] = ("quantize_config.json", "quant_config.json"),
                    ) -> dict[str, Any] | None:
    """The checkpoint's quantization config as a dict: ``config.json``'s ``quantization_config``
    (also inside ``text_config``), else a ``quantize_config.json`` beside it (old GPTQ/AWQ exports)."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        raw = getattr(cfg, "quantization_config", None) if cfg is not None else None
        if raw is not None:
            return dict(raw) if isinstance(raw, dict) else dict(raw.to_dict())
    if model_dir and os.path.isdir(model_dir):
        for name in filenames:
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path) as f:
                    data = json.load(f)
                data.setdefault("quant_method", "gptq" if "desc_act" in data else "awq")
                return data
    return None


def get_quant_config(model_config: ModelConfig, *, dummy: bool = False) -> QuantizationConfig | None:
    """The model's quantization config (module docstring), or None. Raises ``ValueError`` for an
    unknown method, a disagreement between ``quantization=`` and the checkpoint, or a checkpoint
    config the method cannot read (naming what it supports).

    ``dummy`` (``load_format="dummy"``): a method named by the user on a config without
    ``quantization_config`` takes the method's ``get_dummy_config()`` (e.g. compressed-tensors
    W4A16, group 128), so published shapes can be benchmarked in a quantized layout without files."""
    user = normalize_method_name(model_config.quantization) if model_config.quantization else None
    if model_config.is_gguf:
        # NOTE: a GGUF file's method depends on the platform; VllmConfig.finalize picks it (gguf.py).
        if user not in (None, "gguf"):
            raise ValueError(f"quantization={model_config.quantization!r} cannot read the GGUF file "
                             f"{model_config.model}: its tensors carry their own ggml types; pass "
                             'quantization="gguf" or leave it unset')
        return None
    hf_config = model_config.hf_config
    ckpt = hf_quant_config(hf_config, model_config.model if not model_config.is_gguf else None) \
        if hf_config is not None else None
    ckpt_method = normalize_method_name(ckpt.get("quant_method", "")) if ckpt else None
    if ckpt is not None and not ckpt_method:
        raise ValueError(f"{model_config.model}: config.json has a quantization_config without quant_method; "
                         f"supported methods: {', '.join(sorted(registered_quantization_methods()))}")
    if user is None and ckpt_method is None:
        return None
    if ckpt is not None:
        for name in sorted(registered_quantization_methods()):
            claimed = get_quantization_config_cls(name).override_quantization_method(ckpt, user)
            if claimed:
                ckpt_method = normalize_method_name(claimed)
                break
    if user is not None and ckpt_method is not None and user != ckpt_method:
        raise ValueError(f"quantization={model_config.quantization!r}, but the checkpoint {model_config.model} is "
                         f"quantized with {ckpt_method!r} (config.json quantization_config); pass "
                         f"quantization={ckpt_method!r} or leave it unset")
    name = user or ckpt_method
    assert name is not None
    cls = get_quantization_config_cls(name)
    if ckpt is None and dummy:
        ckpt = cls.get_dummy_config() or None
    return cls.from_config(ckpt or {})
