"""``vllm.v1.sample.logits_processor.interface``."""

from pagedlm.core.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MovedRequest", "MoveDirectionality", "RemovedRequest"]
