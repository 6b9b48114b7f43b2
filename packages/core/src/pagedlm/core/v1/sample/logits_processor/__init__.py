"""``vllm.v1.sample.logits_processor``: batch-level custom logits processors
(``LLM(logits_processors=[...])``); the implementation is ``pagedlm.core.sample.logits_processor``."""

from pagedlm.core.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    RequestLogitsProcessor,
    build_logitsprocs,
    process_dict_updates,
)

__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitsProcessor",
    "LogitsProcessors",
    "MoveDirectionality",
    "RequestLogitsProcessor",
    "build_logitsprocs",
    "process_dict_updates",
]
