"""Module paths vLLM users import from ``vllm.v1``, re-exporting pagedlm's own classes."""
