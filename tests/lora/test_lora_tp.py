"""TP=2 (gloo, two CPU worker processes): LoRA sharded like its base layers (B's output rows on
column-parallel layers, replicated KV heads included; A's input columns on row-parallel layers)
gives the HF + PEFT greedy tokens of every request of a mixed batch."""

from __future__ import annotations

import pytest
from lora_helpers import run_and_compare

from pagedlm.core import LLM


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_mixed_batch_matches_hf_peft(arch, lora_setups):
    setup = lora_setups[arch]
    llm = LLM(setup.model, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=128, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        run_and_compare(llm, setup)
    finally:
        llm.shutdown()
