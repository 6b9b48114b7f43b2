"""Build a model for a ``VllmConfig`` and fill its weights."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedlm.core.forward_context import set_current_vllm_config
from pagedlm.core.logger import init_logger
from pagedlm.core.model_loader.pooling_adapter import (
    is_base_model_checkpoint,
    mark_head_optional,
    model_architectures,
    prefix_body_weights,
)
from pagedlm.core.model_loader.registry import get_model_class
from pagedlm.core.model_loader.weight_utils import (
    find_weight_files,
    initialize_dummy_weights,
    pt_weights_iterator,
    safetensors_weights_iterator,
)
from pagedlm.core.utils.heap import release_free_heap

if TYPE_CHECKING:
    from pagedlm.core.attention.backend import AttentionBackend
    from pagedlm.core.config import ModelConfig, VllmConfig

logger = init_logger(__name__)

__all__ = ["get_weights_iterator", "load_model"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _model_dtype(model_config: ModelConfig) -> torch.dtype:
    dtype = model_config.dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    from pagedlm.core.config import _STR_TO_DTYPE

    # NOTE: the engine resolves dtype in VllmConfig.finalize(); this fallback serves tests and
    # tools that call load_model on an unfinalised config.
    return model_config.config_dtype if dtype == "auto" else _STR_TO_DTYPE[dtype]


def get_weights_iterator(model_dir: str, load_format: str, lazy: bool = False,
                         quant_config: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, cpu_tensor)`` pairs of the checkpoint in ``model_dir`` for ``load_format``.

    ``lazy=True`` yields safetensors weights as :class:`LazyWeight` (read slice by slice).
    ``load_format="gguf"`` (or ``"auto"`` with a ``.gguf`` file as ``model_dir``) yields the
    file's tensors under HF names, dequantized to float32 (always whole tensors), except those a
    ``GGUFConfig`` ``quant_config`` keeps quantized (yielded as ``GGUFWeight``).
    """
    from pagedlm.core.layers.quantization.gguf import GGUFConfig
    from pagedlm.core.model_loader.gguf_loader import gguf_weights_iterator, is_gguf_file

    if load_format == "gguf" or (load_format == "auto" and is_gguf_file(model_dir)):
        quantized = quant_config.quantized_tensors if isinstance(quant_config, GGUFConfig) else ()
        return gguf_weights_iterator(model_dir, quantized=quantized)
    files = find_weight_files(model_dir, load_format)
    if load_format == "pt":
        return pt_weights_iterator(files)
    return safetensors_weights_iterator(files, lazy=lazy)


def load_model(
    vllm_config: VllmConfig,
    attn_backend_cls: type[AttentionBackend],
    device: torch.device | str,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build ``vllm_config``'s model on ``device`` and load its weights.

    The class comes from the model registry (``config.architectures``); it is constructed as
    ``Cls(vllm_config=vllm_config, prefix="")`` with the model dtype as torch's default dtype
    and ``device`` as default device, inside :func:`set_current_vllm_config` so its attention
    layers bind to ``attn_backend_cls``.

    Returns:
        ``(model, attention_layers)``: the model in eval mode and ``{layer prefix: Attention}``
        for every attention layer it built (the runner binds KV-cache tensors to them).
    """
    model_config = vllm_config.model_config
    load_format = vllm_config.load_config.load_format
    dtype = _model_dtype(model_config)
    device = torch.device(device)
    model_cls = get_model_class(model_architectures(model_config))

    quant_config = vllm_config.quant_config
    if quant_config is not None:
        _check_capability(vllm_config, quant_config, device)

    start = time.perf_counter()
    with _default_dtype(dtype), device, set_current_vllm_config(vllm_config, attn_backend_cls) as ctx:
        model = model_cls(vllm_config=vllm_config, prefix="")
    attention_layers = dict(ctx.attention_layers)
    if quant_config is not None and quant_config.requires_quantized_layers:
        _check_quantized_layers(model, model_cls.__name__, quant_config)

    if load_format == "dummy":
        initialize_dummy_weights(model, model_config.seed)
    else:
        if model_config.model is None:
            raise ValueError(
                f'load_format={load_format!r} reads weights from ModelConfig.model, which is not set; '
                'pass model=DIR or load_format="dummy"'
            )
        # NOTE: a multi-rank run reads lazily so each rank reads only its slices (TP) or its
        # stage's layers (PP); one rank keeps plain tensors, which any model code accepts.
        lazy = vllm_config.parallel_config.world_size > 1
        weights = get_weights_iterator(model_config.model, load_format, lazy=lazy, quant_config=quant_config)
        if is_base_model_checkpoint(model_config):  # e.g. a sentence-transformers export (pooling_adapter.py)
            weights = prefix_body_weights(weights)
            mark_head_optional(model)
        loaded = model.load_weights(remap_kv_cache_scales(weights, model, quant_config))
        expected = {name for name, p in model.named_parameters() if not getattr(p, "optional_in_checkpoint", False)}
        missing = sorted(expected - set(loaded))
        if missing:
            shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
            raise ValueError(
                f"the checkpoint in {model_config.model} did not provide {len(missing)} parameter(s) of "
                f"{model_cls.__name__}: {shown}"
            )
    process_weights_after_loading(model)
    model.eval()
    release_free_heap()  # the loading's scratch (decoded tensors, file views) leaves the resident set
    weight_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    model.weight_memory_bytes = weight_bytes  # type: ignore[assignment]
    logger.info(
        "loaded %s (%s, %s, load_format=%s%s) in %.2fs; weights take %.3f GiB on this rank",
        model_cls.__name__, device, str(dtype).removeprefix("torch."), load_format,
        f", quantization={quant_config.describe()}" if quant_config is not None else "",
        time.perf_counter() - start, weight_bytes / 2**30,
    )
    return model, attention_layers


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quantize method (and every attention layer) convert its loaded weights to
    its kernel's layout, one layer at a time."""
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
            hook = getattr(module, "process_weights_after_loading", None)
            if callable(hook):
                hook()


def remap_kv_cache_scales(weights: Iterator[tuple[str, Any]], model: nn.Module,
                          quant_config: Any) -> Iterator[tuple[str, Any]]:
    """Checkpoint KV-cache scales under the attention layers' names (``...self_attn.k_scale`` or the
    method's own, e.g. compressed-tensors' ``k_proj.output_scale``, -> ``...self_attn.attn.k_scale``);
    dropped when the model keeps no scales (``kv_cache_dtype="auto"``)."""
    params = {name for name, _ in model.named_parameters()}
    for name, tensor in weights:
        target = quant_config.get_cache_scale(name) if quant_config is not None else None
        if target is None and name.endswith((".k_scale", ".v_scale")) and ".attn." not in name:
            head, _, scale = name.rpartition(".")
            target = f"{head}.attn.{scale}"
        if target is None:
            yield name, tensor
        elif target in params:
            yield target, tensor


def _check_capability(vllm_config: VllmConfig, quant_config: Any, device: torch.device) -> None:
    from pagedlm.core.platforms import resolve_platform

    capability = resolve_platform(vllm_config.device_config.device).get_device_capability(device)
    if capability is None:
        return  # no compute capability (the CPU): core's torch reference runs every method
    have, need = capability[0] * 10 + capability[1], quant_config.get_min_capability()
    if have < need:
        raise ValueError(
            f"quantization {quant_config.get_name()!r} needs a GPU of compute capability {need // 10}.{need % 10} or "
            f"newer; this one has {capability[0]}.{capability[1]}"
            + (" (FP8 needs Ada or Hopper: 8.9 / 9.0)" if need >= 89 else ""))


def _check_quantized_layers(model: nn.Module, class_name: str, quant_config: Any) -> None:
    from pagedlm.core.layers.fused_moe.layer import FusedMoE
    from pagedlm.core.layers.linear import LinearBase

    linears = [m for m in model.modules() if isinstance(m, (LinearBase, FusedMoE))]
    if linears and not any(m.quant_method.quantized for m in linears):
        raise ValueError(
            f"quantization {quant_config.get_name()!r} left every linear layer of {class_name} unquantized: the model "
            "class must pass quant_config=vllm_config.quant_config (and each layer's prefix) to its linear layers, "
            "or the checkpoint's ignore list covers every layer")
