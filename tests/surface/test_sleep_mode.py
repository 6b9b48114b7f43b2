"""Sleep mode on the CPU: sleep(1) / sleep(2) then wake_up give the same greedy tokens; the KV cache
(and at level 2 the weights) are really gone while asleep; refusals by name."""

from __future__ import annotations

import pytest

from pagedlm.core import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [1, 17, 42, 99, 7]}, {"prompt_token_ids": [1, 64, 65, 66]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def sleepy(tiny_llama):
    return LLM(tiny_llama, dtype="float32", device="cpu", enable_sleep_mode=True, num_gpu_blocks_override=64)


def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _runner(llm):
    return llm.llm_engine.core.executor.worker.model_runner


@pytest.mark.parametrize("level", [1, 2])
def test_output_is_identical_after_wake_up(sleepy, level):
    before = tokens(sleepy)
    runner = _runner(sleepy)
    first_weight = next(runner.model.parameters()).detach().clone()
    sleepy.sleep(level=level)
    assert sleepy.is_sleeping()
    assert runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attention_layers.values())
    if level == 1:
        assert all(p.numel() == 0 for p in runner.model.parameters())  # the weights wait in host copies
    else:
        assert runner.model is None  # dropped: read from the checkpoint on wake
    with pytest.raises(ValueError, match="the engine is sleeping"):
        sleepy.generate(PROMPTS, GREEDY, use_tqdm=False)
    sleepy.wake_up()
    assert not sleepy.is_sleeping()
    assert next(runner.model.parameters()).equal(first_weight)
    assert tokens(sleepy) == before


def test_wake_up_by_tags_and_refusals(sleepy, tiny_llama):
    before = tokens(sleepy)
    sleepy.sleep(level=2)
    with pytest.raises(ValueError, match="needs the weights awake first"):
        sleepy.wake_up(tags=["kv_cache"])
    with pytest.raises(ValueError, match=r"wake_up tags \['gpu'\] are unknown"):
        sleepy.wake_up(tags=["gpu"])
    sleepy.wake_up(tags=["weights"])
    assert sleepy.is_sleeping()  # the KV cache is still asleep: nothing runs yet
    sleepy.wake_up(tags=["kv_cache"])
    assert not sleepy.is_sleeping() and tokens(sleepy) == before
    with pytest.raises(ValueError, match="level=3 must be 1"):
        sleepy.sleep(level=3)
    plain = LLM(tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="sleep mode is off: start the engine with enable_sleep_mode=True"):
        plain.sleep()
