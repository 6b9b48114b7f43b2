"""``LLM(enable_prompt_embeds=True)`` with ``{"prompt_embeds": tensor}`` prompts: embeddings taken
from the model's own input embeddings give the tokens the ids give (greedy), chunk by chunk, with
prefix caching, preemption and mixed batches."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.worker.model_runner import ModelRunner

IDS = [[5, 17, 42, 99, 3, 8, 11], [7, 7, 8, 9, 100, 200, 31, 2, 4, 60, 61, 62, 63], [12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_embeddings(model_dir: str, ids: list[list[int]]) -> list[torch.Tensor]:
    """What a vLLM user does: the HF model's input embeddings (Gemma's include its scale)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [hf.get_input_embeddings()(torch.tensor(i)) for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_embeddings_of_the_ids_give_the_ids_tokens(tiny_checkpoint_factory, arch):
    model = tiny_checkpoint_factory(arch)
    llm = LLM(model=model, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, enable_prompt_embeds=True,
              block_size=4)
    expected = _tokens(llm.generate([{"prompt_token_ids": i} for i in IDS], GREEDY, use_tqdm=False))
    embeds = _hf_embeddings(model, IDS)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert _tokens(outs) == expected
    assert all(o.prompt_token_ids is None and o.prompt is None for o in outs)
    # The same embeddings again hit the prefix cache (keyed by a digest of the embeddings) ...
    again = llm.generate([{"prompt_embeds": embeds[1][None]}], GREEDY, use_tqdm=False)[0]  # [1, T, H] works too
    assert again.num_cached_tokens == 12 and list(again.outputs[0].token_ids) == expected[1]
    # ... and other embeddings of the same length never do (their placeholder ids are equal).
    other = _hf_embeddings(model, [[i + 1 for i in IDS[1]]])[0]
    alone = llm.generate([{"prompt_token_ids": [i + 1 for i in IDS[1]]}], GREEDY, use_tqdm=False)[0]
    out = llm.generate([{"prompt_embeds": other}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_mixed_batches_chunked_prefill_and_preemption(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", enable_prompt_embeds=True, block_size=4,
              num_gpu_blocks_override=10, max_num_batched_tokens=5, max_model_len=32)
    embeds = llm.apply_model(lambda model: [model.get_input_embeddings(torch.tensor(i)) for i in IDS])[0]
    prompts = [{"prompt_embeds": embeds[0]}, {"prompt_token_ids": IDS[1]}, {"prompt_embeds": embeds[2]},
               {"prompt_token_ids": IDS[0]}, {"prompt_embeds": embeds[1]}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert outs[0] == outs[3] and outs[1] == outs[4]
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    reference = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    assert outs[:3] == _tokens(reference.generate([{"prompt_token_ids": i} for i in IDS], params, use_tqdm=False))


def test_prompt_embeds_are_checked(tiny_llama):
    plain = LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20)
    hidden = plain.llm_engine.vllm_config.model_config.hidden_size
    with pytest.raises(ValueError, match=r"need LLM\(enable_prompt_embeds=True\)"):
        plain.generate({"prompt_embeds": torch.zeros(3, hidden)}, use_tqdm=False)
    llm = LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20, enable_prompt_embeds=True)
    with pytest.raises(ValueError, match=rf"shape \[num_tokens, hidden_size={hidden}\], got torch.float32 \(3, 5\)"):
        llm.generate({"prompt_embeds": torch.zeros(3, 5)}, use_tqdm=False)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        llm.generate({"prompt_embeds": [[0.0] * hidden]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_embeds": torch.zeros(0, hidden)}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
        llm.generate({"prompt_embeds": torch.zeros(2, hidden)}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="takes no other fields"):
        llm.generate({"prompt_embeds": torch.zeros(2, hidden), "prompt_token_ids": [1, 2]}, use_tqdm=False)


def test_a_runner_whose_forward_does_not_feed_embeddings_refuses_the_option(tiny_llama):
    """What the CUDA runner does (its run_model stages ids for graphs): refused by name at start."""
    from pagedlm.core import EngineArgs

    class StagingRunner(ModelRunner):
        def run_model(self, step):
            raise AssertionError("never reached")

    config = EngineArgs(model=tiny_llama, device="cpu", enable_prompt_embeds=True).create_vllm_config()
    config.finalize()
    with pytest.raises(ValueError, match="enable_prompt_embeds=True is not supported by StagingRunner"):
        StagingRunner(config, torch.device("cpu"))

    class FeedingRunner(StagingRunner):
        supports_prompt_embeds = True

    FeedingRunner(config, torch.device("cpu"))
