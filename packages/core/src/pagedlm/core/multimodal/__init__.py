"""Multimodal inputs (vLLM's ``vllm/multimodal``): a registry of per-model input processors,
the items a prompt carries (images), their hashes, the encoder cache and its scheduling.

See docs/multimodal.md. Nothing here is imported by core unless a prompt or a model uses it.
"""
