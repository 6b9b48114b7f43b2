"""``vllm.v1.sample``."""
