"""Multi-LoRA against HF transformers + PEFT (fp32, CPU): one batch mixing the base model and three
adapters gives every request the greedy tokens of its adapter, also with chunked prefill, with one
slot (requests queue for it), under preemption, and with prefix caching (adapters never share
KV blocks)."""

from __future__ import annotations

import pytest
from lora_helpers import lora_requests, mixed_batch, run_and_compare

from pagedlm.core import LLM

BASE = {"dtype": "float32", "device": "cpu", "enable_lora": True, "max_lora_rank": 16, "max_model_len": 128}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_matches_hf_peft(arch, lora_setups):
    setup = lora_setups[arch]
    llm = LLM(setup.model, max_loras=3, **BASE)
    run_and_compare(llm, setup)
    # again, with the prompts' blocks now in the prefix cache: each adapter hits only its own
    run_and_compare(llm, setup)
    llm.shutdown()


def test_chunked_prefill_and_small_batches(lora_setups):
    setup = lora_setups["llama"]
    llm = LLM(setup.model, max_loras=2, max_num_batched_tokens=12, max_num_seqs=5, enable_prefix_caching=False,
              **BASE)
    run_and_compare(llm, setup)
    llm.shutdown()


def test_one_slot_requests_queue(lora_setups):
    """max_loras=1 and max_cpu_loras=1: adapters take turns in the slot and are re-read from disk."""
    setup = lora_setups["qwen3"]
    llm = LLM(setup.model, max_loras=1, max_cpu_loras=1, **BASE)
    seen: list[int] = []
    core = llm.llm_engine.core
    schedule = core.scheduler.schedule

    def counting():
        out = schedule()
        ids = {r.lora_request.lora_int_id for r in core.scheduler.running if r.lora_request is not None}
        seen.append(len(ids))
        return out

    core.scheduler.schedule = counting
    run_and_compare(llm, setup)
    assert max(seen) == 1
    llm.shutdown()


def test_preemption(lora_setups):
    setup = lora_setups["llama"]
    llm = LLM(setup.model, max_loras=3, block_size=8, num_gpu_blocks_override=10, **{**BASE, "max_model_len": 64})
    run_and_compare(llm, setup)
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    llm.shutdown()


def test_base_only_engine_unchanged_and_adapter_api(lora_setups):
    """enable_lora with base requests only; add_lora / list_loras / remove_lora (vLLM's)."""
    setup = lora_setups["llama"]
    llm = LLM(setup.model, max_loras=2, max_cpu_loras=2, **BASE)
    run_and_compare(llm, setup, [(None, i) for i in range(4)])
    engine = llm.llm_engine
    loras = lora_requests(setup)
    assert engine.list_loras() == set()
    assert engine.add_lora(loras["all-r8"]) is True
    assert engine.add_lora(loras["all-r8"]) is False
    assert engine.list_loras() == {1}
    assert engine.remove_lora(1) is True
    assert engine.list_loras() == set()
    assert engine.remove_lora(1) is False
    run_and_compare(llm, setup, [("all-r8", 0), ("mlp-r16", 1), (None, 2)])
    assert engine.list_loras() == {1, 3}
    llm.shutdown()


def test_chat_with_lora(lora_setups):
    from pagedlm.core import SamplingParams

    setup = lora_setups["llama"]
    llm = LLM(setup.model, max_loras=1, **BASE)
    loras = lora_requests(setup)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "user", "content": "hello"}]
    base = llm.chat(messages, params, use_tqdm=False)[0]
    adapted = llm.chat(messages, params, use_tqdm=False, lora_request=loras["all-r8"])[0]
    prompt = {"prompt_token_ids": list(base.prompt_token_ids)}
    assert list(adapted.outputs[0].token_ids) == list(
        llm.generate(prompt, params, use_tqdm=False, lora_request=loras["all-r8"])[0].outputs[0].token_ids)
    assert list(adapted.outputs[0].token_ids) != list(base.outputs[0].token_ids)
    llm.shutdown()


def test_mixed_batch_pairs_cover_everything(lora_setups):
    assert len(mixed_batch(lora_setups["llama"])) == 16
