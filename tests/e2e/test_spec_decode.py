"""Speculative decoding end to end: greedy tokens identical to HF transformers and to decoding
without speculation, for the n-gram proposer and for a model drafting for itself, under chunked
prefill and preemption; sampling keeps the target's distribution (a chi-square test, p-value
threshold ``P_VALUE_THRESHOLD``) and seeded requests reproduce.

The prompts repeat text (a span, then the same span again) so that n-gram drafts are found; a
random tiny model accepts few of them, the self-draft nearly all.
"""

from __future__ import annotations

import random

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import compare_greedy, hf_greedy

MAX_NEW = 16
P_VALUE_THRESHOLD = 1e-4
ARCHS = ("llama", "qwen3")

MODES = {
    "default": {},
    # drafts compete for a budget of 8 tokens with prompt chunks
    "chunked-tiny-budget": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    # the 7 prompts need 21 blocks of 16 at the end, the longest 4
    "preemption": {"num_gpu_blocks_override": 8, "max_model_len": 64},
}


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    spans = [[rng.randrange(4, 500) for _ in range(n)] for n in (5, 9, 18)]
    prompts = [span * 2 for span in spans]
    prompts.append([rng.randrange(4, 500) for _ in range(7)])  # no repeat: no drafts at first
    prompts.append(spans[0] + spans[1] + spans[0])
    return prompts


def echo_prompts(model_dir: str) -> list[list[int]]:
    """:func:`repeating_prompts` plus two ``P + greedy_output(P)[:30]`` prompts, whose greedy
    continuation (the rest of that same output) most often repeats n-grams of its own context:
    the n-gram proposer's drafts are then accepted there, by construction."""
    import numpy as np

    from pagedlm.core.spec_decode.ngram_proposer import ngram_drafts

    rng = random.Random(1)
    starts = [[rng.randrange(4, 500) for _ in range(6)] for _ in range(12)]
    llm = LLM(model=model_dir, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=30 + MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in starts], params, use_tqdm=False)
    llm.shutdown()

    def hits(seq: list[int], begin: int) -> int:  # positions where a one-token n-gram draft is right
        return sum(ngram_drafts(np.array(seq[:t]), 1, 3, 1) == [seq[t]] for t in range(begin, len(seq)))

    scored = sorted(((hits(p + list(o.outputs[0].token_ids), len(p) + 30), p + list(o.outputs[0].token_ids)[:30])
                     for p, o in zip(starts, outs, strict=True)), key=lambda x: -x[0])
    assert scored[0][0] > 0, "no greedy continuation repeats itself: the n-gram tests would not be exercised"
    return repeating_prompts() + [prompt for _, prompt in scored[:2]]


def spec_configs(model_dir: str) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "self-draft": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3},
    }


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory):
    return {arch: tiny_checkpoint_factory(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints):
    """arch -> (prompts, HF greedy outputs)."""
    refs = {}
    for arch in ARCHS:
        prompts = echo_prompts(checkpoints[arch])
        refs[arch] = prompts, hf_greedy(checkpoints[arch], prompts, MAX_NEW)
    return refs


@pytest.fixture(scope="module")
def spec_off(checkpoints, references):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    out = {}
    for arch in ARCHS:
        llm = LLM(model=checkpoints[arch], dtype="float32", device="cpu")
        out[arch] = [list(r.outputs[0].token_ids) for r in
                     llm.generate([{"prompt_token_ids": p} for p in references[arch][0]], params, use_tqdm=False)]
        llm.shutdown()
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_speculation_matches_hf_and_speculation_off(arch, method, mode, checkpoints, references,
                                                                 spec_off):
    prompts, ref = references[arch]
    model = checkpoints[arch]
    llm = LLM(model=model, dtype="float32", device="cpu", speculative_config=spec_configs(model)[method],
              **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = [list(r.outputs[0].token_ids) for r in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    mismatches, forgiven = compare_greedy(ours, ref)
    assert mismatches == 0 and forgiven <= 1, (mismatches, forgiven)
    assert ours == spec_off[arch]
    core = llm.llm_engine.core
    stats = core.scheduler.spec.stats
    assert stats.num_draft_tokens > 0
    if method == "self-draft":
        # the model drafting for itself agrees with itself (the batch shapes differ: a near-tie may flip)
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95, stats
    else:
        assert stats.num_accepted_tokens > 0, stats
    if mode == "preemption":
        assert core.scheduler.num_preemptions_total > 0, "the small KV cache did not force any preemption"
    llm.shutdown()


def test_single_request_and_a_mixed_batch_of_greedy_and_sampled_requests(checkpoints, references, spec_off):
    """One request alone, then greedy requests sharing steps with sampled ones (their own k of
    drafts each step, some none): the greedy ones stay identical to decoding without speculation."""
    prompts, _ = references["llama"]
    model = checkpoints["llama"]
    llm = LLM(model=model, dtype="float32", device="cpu", speculative_config=spec_configs(model)["self-draft"])
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
    assert list(alone[0].outputs[0].token_ids) == spec_off["llama"][0]
    sampled = SamplingParams(temperature=1.0, top_k=20, max_tokens=MAX_NEW, ignore_eos=True, seed=3)
    batch = [(p, greedy) for p in prompts] + [(p, sampled) for p in prompts[:3]]
    results = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    assert [list(r.outputs[0].token_ids) for r in results[: len(prompts)]] == spec_off["llama"]
    assert all(len(r.outputs[0].token_ids) == MAX_NEW for r in results)
    llm.shutdown()


def test_seeded_sampling_reproduces_whatever_the_batch(checkpoints):
    model = checkpoints["qwen3"]
    llm = LLM(model=model, dtype="float32", device="cpu", speculative_config=spec_configs(model)["self-draft"])
    prompt = {"prompt_token_ids": repeating_prompts()[1]}
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=11, logprobs=2)
    first = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0]
    others = [{"prompt_token_ids": p} for p in repeating_prompts(1)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(others[:2] + [prompt] + others[2:], [unseeded, unseeded, seeded] + [unseeded] * 3,
                         use_tqdm=False)[2].outputs[0]
    assert list(first.token_ids) == list(mixed.token_ids)
    assert len(first.logprobs) == 16 and all(tok in lp for tok, lp in zip(first.token_ids, first.logprobs))
    assert llm.llm_engine.core.scheduler.spec.stats.num_accepted_tokens > 0
    llm.shutdown()


def test_sampled_distribution_with_speculation_equals_without(checkpoints):
    """Two-sample chi-square test on the first three sampled tokens (top-k 2: at most 8 outcomes)
    of many seeded requests, with a self-draft (its greedy drafts are accepted with the target's
    probability of them) against no speculation."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    model = checkpoints["llama"]
    prompt = repeating_prompts()[0]
    num = 500
    samples = {}
    for name, spec in (("on", spec_configs(model)["self-draft"]), ("off", None)):
        llm = LLM(model=model, dtype="float32", device="cpu", speculative_config=spec)
        params = [SamplingParams(temperature=1.5, top_k=2, max_tokens=3, ignore_eos=True, seed=s) for s in range(num)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * num, params, use_tqdm=False)
        samples[name] = Counter(tuple(o.outputs[0].token_ids) for o in outs)
        if spec is not None:
            stats = llm.llm_engine.core.scheduler.spec.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # both outcomes happen
        llm.shutdown()
    outcomes = sorted(set(samples["on"]) | set(samples["off"]))
    assert len(outcomes) >= 4
    table = [[samples[name][o] for o in outcomes] for name in ("on", "off")]
    p_value = chi2_contingency(table).pvalue
    assert p_value > P_VALUE_THRESHOLD, (outcomes, table, p_value)


def test_get_metrics_reports_acceptance(checkpoints):
    model = checkpoints["llama"]
    llm = LLM(model=model, dtype="float32", device="cpu", disable_log_stats=False,
              speculative_config=spec_configs(model)["self-draft"])
    llm.generate([{"prompt_token_ids": p} for p in repeating_prompts()[:2]],
                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["pagedlm:spec_decode_num_drafts"].value
    draft_tokens = metrics["pagedlm:spec_decode_num_draft_tokens"].value
    accepted = metrics["pagedlm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["pagedlm:spec_decode_num_accepted_tokens_per_pos"].values
    assert drafts > 0 and len(per_pos) == 3 and sum(per_pos) == accepted and 0 < accepted <= draft_tokens
    llm.shutdown()


def test_bad_speculative_config_is_a_value_error_naming_the_field(tiny_llama):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=tiny_llama, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(model=tiny_llama, device="cpu", async_scheduling=True,  # a draft model follows every step
            speculative_config={"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2})
