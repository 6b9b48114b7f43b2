"""Sampling on the device: per-row parameters, penalties, logprobs."""

from pagedlm.core.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from pagedlm.core.sample.metadata import SamplingMetadata, build_sampling_metadata
from pagedlm.core.sample.sampler import Sampler, SamplerOutput, process_logits

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "compute_topk_logprobs",
    "process_logits",
]
