"""Speculative decoding (n-gram) with async scheduling: steps that may get drafts run
synchronously, steps of at least ``disable_by_batch_size`` running requests asynchronously
without drafts (spec_decode/engine_step.py); greedy tokens stay those of decoding without
speculation and HF's, also under chunked prefill and preemption.
"""

from __future__ import annotations

import dataclasses

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import compare_greedy, hf_greedy

#: output lengths differ so that requests finish one after another and the running count falls
#: below the threshold mid-run: both kinds of steps happen
MAX_TOKENS = (2, 4, 6, 8, 24, 32)
THRESHOLD = 3
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": THRESHOLD}
MODES = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "preemption": {"num_gpu_blocks_override": 8, "max_model_len": 64},
}


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(3)
    spans = [[rng.randrange(4, 500) for _ in range(n)] for n in (4, 6, 9, 5, 7, 3)]
    return [span * 3 for span in spans]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    ps = prompts()
    return ps, hf_greedy(tiny_llama, ps, max(MAX_TOKENS))


def generate(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("mode", list(MODES))
def test_ngram_with_async_scheduling_matches_hf(mode, tiny_llama, reference):
    ps, ref = reference
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=True, speculative_config=SPEC,
              **MODES[mode])
    core = llm.llm_engine.core
    assert core.batch_queue is not None, "n-gram speculation keeps async scheduling"
    steps: list[tuple[bool, int, bool]] = []  # (ran asynchronously, requests, had drafts) per step
    execute = core.executor.execute_model

    def recording(scheduler_output, non_block=False):
        steps.append((non_block, len(scheduler_output.num_scheduled_tokens),
                      bool(scheduler_output.scheduled_spec_decode_tokens)))
        return execute(scheduler_output, non_block)

    core.executor.execute_model = recording
    ours = generate(llm, ps)
    # every request's tokens are HF's up to its own length
    ref = [dataclasses.replace(r, token_ids=r.token_ids[:n], top2_gaps=r.top2_gaps[:n])
           for r, n in zip(ref, MAX_TOKENS, strict=True)]
    mismatches, forgiven = compare_greedy(ours, ref)
    assert mismatches == 0 and forgiven <= 1, (mismatches, forgiven)
    assert any(drafts for _, _, drafts in steps), "no step verified drafts"
    assert any(non_block and n >= THRESHOLD for non_block, n, _ in steps), "no step ran asynchronously"
    assert not any(non_block and drafts for non_block, _, drafts in steps), "drafts in an asynchronous step"
    assert core.scheduler.spec.stats.num_accepted_tokens > 0
    if mode == "preemption":
        assert core.scheduler.num_preemptions_total > 0
    llm.shutdown()
