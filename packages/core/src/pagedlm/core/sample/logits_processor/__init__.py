"""Custom logits processors with vLLM V1's interface (``vllm.v1.sample.logits_processor``; users
import them from ``pagedlm.core.v1.sample.logits_processor``)."""

from pagedlm.core.sample.logits_processor.batch import BatchLogitsProcessors, LogitsProcessorsStep
from pagedlm.core.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
    RequestLogitsProcessor,
)
from pagedlm.core.sample.logits_processor.load import (
    build_logitsprocs,
    configured_logits_processor_classes,
    installed_logits_processor_classes,
    resolve_logits_processor_classes,
)
from pagedlm.core.sample.logits_processor.state import (
    AdapterLogitsProcessor,
    BatchUpdateBuilder,
    LogitsProcessors,
    process_dict_updates,
)

__all__ = [
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchLogitsProcessors",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitsProcessor",
    "LogitsProcessors",
    "LogitsProcessorsStep",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "build_logitsprocs",
    "process_dict_updates",
    "resolve_logits_processor_classes",
    "configured_logits_processor_classes",
    "installed_logits_processor_classes",
]
