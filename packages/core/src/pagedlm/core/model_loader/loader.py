"""Build a model for a ``VllmConfig`` and fill its weights."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedlm.core.forward_context import set_current_vllm_config
from pagedlm.core.logger import init_logger
from pagedlm.core.model_loader.registry import get_model_class
from pagedlm.core.model_loader.weight_utils import (
    find_weight_files,
    initialize_dummy_weights,
    pt_weights_iterator,
    safetensors_weights_iterator,
)

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


def get_weights_iterator(model_dir: str, load_format: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, cpu_tensor)`` pairs of the checkpoint in ``model_dir`` for ``load_format``.

    ``lazy=True`` yields safetensors weights as :class:`LazyWeight` (read slice by slice).
    ``load_format="gguf"`` (or ``"auto"`` with a ``.gguf`` file as ``model_dir``) yields the
    file's tensors under HF names, dequantized to float32 (always whole tensors).
    """
    from pagedlm.core.model_loader.gguf_loader import gguf_weights_iterator, is_gguf_file

    if load_format == "gguf" or (load_format == "auto" and is_gguf_file(model_dir)):
        return gguf_weights_iterator(model_dir)
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
    model_cls = get_model_class(model_config.architectures)

    start = time.perf_counter()
    with _default_dtype(dtype), device, set_current_vllm_config(vllm_config, attn_backend_cls) as ctx:
        model = model_cls(vllm_config=vllm_config, prefix="")
    attention_layers = dict(ctx.attention_layers)

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
        weights = get_weights_iterator(model_config.model, load_format, lazy=lazy)
        loaded = model.load_weights(weights)
        expected = {name for name, _ in model.named_parameters()}
        missing = sorted(expected - set(loaded))
        if missing:
            shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
            raise ValueError(
                f"the checkpoint in {model_config.model} did not provide {len(missing)} parameter(s) of "
                f"{model_cls.__name__}: {shown}"
            )
    model.eval()
    logger.info(
        "loaded %s (%s, %s, load_format=%s) in %.2fs",
        model_cls.__name__, device, str(dtype).removeprefix("torch."), load_format, time.perf_counter() - start,
    )
    return model, attention_layers
