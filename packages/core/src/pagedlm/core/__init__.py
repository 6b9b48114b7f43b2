"""pagedlm core: the engine, its configuration and the plugin system.

Public API (vLLM-compatible names)::

    from pagedlm.core import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "EngineClient",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "VllmConfig",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
    "ScoringRequestOutput",
    "BeamSearchParams",
]

if TYPE_CHECKING:
    from pagedlm.core.beam_search import BeamSearchParams
    from pagedlm.core.config import VllmConfig
    from pagedlm.core.engine.arg_utils import EngineArgs
    from pagedlm.core.engine.async_llm import AsyncLLM, EngineDeadError
    from pagedlm.core.engine.llm_engine import LLMEngine
    from pagedlm.core.engine.protocol import EngineClient
    from pagedlm.core.entrypoints.llm import LLM
    from pagedlm.core.lora.request import LoRARequest
    from pagedlm.core.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from pagedlm.core.pooling_params import PoolingParams
    from pagedlm.core.sampling_params import SamplingParams

_LAZY = {
    "LLM": "pagedlm.core.entrypoints.llm",
    "AsyncLLM": "pagedlm.core.engine.async_llm",
    "EngineDeadError": "pagedlm.core.engine.async_llm",
    "EngineClient": "pagedlm.core.engine.protocol",
    "LLMEngine": "pagedlm.core.engine.llm_engine",
    "EngineArgs": "pagedlm.core.engine.arg_utils",
    "LoRARequest": "pagedlm.core.lora.request",
    "VllmConfig": "pagedlm.core.config",
    "SamplingParams": "pagedlm.core.sampling_params",
    "RequestOutput": "pagedlm.core.outputs",
    "CompletionOutput": "pagedlm.core.outputs",
    "Logprob": "pagedlm.core.outputs",
    "PoolingParams": "pagedlm.core.pooling_params",
    "PoolingRequestOutput": "pagedlm.core.outputs",
    "EmbeddingRequestOutput": "pagedlm.core.outputs",
    "ScoringRequestOutput": "pagedlm.core.outputs",
    "BeamSearchParams": "pagedlm.core.beam_search",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import pagedlm.core.plugins` (in every plugin) does not import torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedlm.core' has no attribute {name!r}")
