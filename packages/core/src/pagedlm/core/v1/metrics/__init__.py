"""``vllm.v1.metrics`` names."""
