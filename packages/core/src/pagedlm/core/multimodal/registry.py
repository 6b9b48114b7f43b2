"""Architecture -> multimodal input processor, through the
``pagedlm_register_multimodal_processors`` hook (vLLM's ``MULTIMODAL_REGISTRY``).

A model is multimodal exactly when a processor is registered for one of its architectures.
"""

from __future__ import annotations

from typing import Any

from pagedlm.core.multimodal.processing import BaseMultiModalProcessor


def processor_class_path(model_config: Any) -> str | None:
    """The ``"module:Class"`` registered for the model's architecture, or None (a text model)."""
    from pagedlm.core.plugins import get_plugins

    if model_config.hf_config is None:
        return None
    registry = get_plugins().multimodal_processors()
    return next((registry[a] for a in model_config.architectures if a in registry), None)


def is_multimodal_model(model_config: Any) -> bool:
    return processor_class_path(model_config) is not None


def create_processor(model_config: Any) -> BaseMultiModalProcessor | None:
    """The model's processor (HF's processors inside load on first use), or None for a text model."""
    from pagedlm.core.plugins import resolve_class_path

    path = processor_class_path(model_config)
    if path is None:
        return None
    cls = resolve_class_path(path)
    if not (isinstance(cls, type) and issubclass(cls, BaseMultiModalProcessor)):
        raise TypeError(f"{path} (a multimodal processor) is not a BaseMultiModalProcessor subclass")
    return cls(model_config)


def encoder_budget(vllm_config: Any) -> int:
    """Encoder tokens per step, and the encoder cache's size (vLLM's
    ``max_num_encoder_input_tokens`` and ``encoder_cache_size``): the step's token budget, and at
    least one item of the largest kind, so every item can be scheduled."""
    processor = create_processor(vllm_config.model_config)
    if processor is None:
        return 0
    largest = max(processor.max_tokens_per_item(m) for m in processor.supported_modalities)
    return max(int(vllm_config.scheduler_config.max_num_batched_tokens or 8192), largest)
