"""Sleep mode on a GPU: after sleep(level=1) the memory PyTorch holds on the device is under 10% of
what it held before, and greedy output after wake_up is identical (CUDA graphs captured again);
level 2 (weights read from the checkpoint again) gives the same output too."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cuda]

PROMPTS = [{"prompt_token_ids": [1, 17, 42, 99, 7]}, {"prompt_token_ids": [1, 64, 65, 66] * 9},
           {"prompt_token_ids": [5]}]


@pytest.fixture(scope="module")
def sleepy(tiny_checkpoint_factory):
    from pagedlm.core import LLM

    # big enough that weights and KV cache (about 2 GiB here), not fixed buffers, fill the device
    path = tiny_checkpoint_factory("qwen3", hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=8,
                                   intermediate_size=2048, vocab_size=2048)
    return LLM(path, dtype="bfloat16", device="cuda", enable_sleep_mode=True, num_gpu_blocks_override=2048,
               max_model_len=512)


def greedy(llm):
    from pagedlm.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def device_bytes() -> tuple[int, int]:
    """(bytes PyTorch holds in tensors, bytes in use on the device as the driver sees it)."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return torch.cuda.memory_allocated(), total - free


def test_sleep_level_1_frees_the_device_and_keeps_the_output(sleepy):
    before_tokens = greedy(sleepy)
    runner = sleepy.llm_engine.core.executor.worker.model_runner
    assert runner.use_graphs and runner._graphs  # graphs were captured and are used
    before, before_used = device_bytes()
    sleepy.sleep(level=1)
    after, after_used = device_bytes()
    print(f"sleep(1): PyTorch-held {before / 2**30:.3f} -> {after / 2**30:.3f} GiB; "
          f"device in use {before_used / 2**30:.3f} -> {after_used / 2**30:.3f} GiB")
    assert after < 0.1 * before
    assert not runner._graphs
    sleepy.wake_up()
    assert runner._graphs  # captured again over the restored tensors
    assert greedy(sleepy) == before_tokens


def test_sleep_level_2_reloads_the_weights(sleepy):
    before_tokens = greedy(sleepy)
    before, _ = device_bytes()
    sleepy.sleep(level=2)
    after, _ = device_bytes()
    assert after < 0.1 * before
    sleepy.wake_up(tags=["weights"])
    sleepy.wake_up(tags=["kv_cache"])
    assert greedy(sleepy) == before_tokens
