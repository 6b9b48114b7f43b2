"""vLLM's ``allowed_token_ids`` (sample only among these ids) and ``logprob_token_ids`` (return
these ids' logprobs in place of the top-k): in the sampler, and end to end through ``LLM`` with
and without speculative decoding, against the same engine's full-vocabulary logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.sample import Sampler, build_sampling_metadata

ALLOWED = [7, 40, 123, 301]
ASKED = [300, 5, 77]


def sample(logits: torch.Tensor, params: list[SamplingParams]):
    md = build_sampling_metadata(params, prompt_token_ids=[[0]] * len(params),
                                 output_token_ids=[[] for _ in params], vocab_size=logits.shape[1])
    return Sampler()(logits, md)


def test_allowed_token_ids_restrict_sampling_but_not_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 400) * 4
    params = [SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, allowed_token_ids=ALLOWED[:2], seed=1)]
    for _ in range(20):
        out = sample(logits, params)
        sampled = out.sampled_token_ids.tolist()
        assert sampled[0] == max(ALLOWED, key=lambda t: float(logits[0, t]))
        assert sampled[1] == int(logits[1].argmax())
        assert sampled[2] in ALLOWED[:2]
    ids, _, ranks = out.logprobs_tensors.tolists()
    assert ids[0][1:] == logits[0].topk(2).indices.tolist()  # the model's top-k, not the whitelist's
    assert ranks[0] == 1 + int((logits[0] > logits[0, sampled[0]]).sum())


def test_logprob_token_ids_replace_the_top_k_with_true_ranks() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 400) * 3
    params = [SamplingParams(temperature=0.0, logprobs=5, logprob_token_ids=ASKED),
              SamplingParams(temperature=0.0, logprobs=4),
              SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=[9])]
    out = sample(logits, params)
    lt = out.logprobs_tensors
    raw = torch.log_softmax(logits, -1)
    ids, lps, _ = lt.tolists()
    column_ranks = lt.column_ranks.tolist()
    assert ids[0][1:4] == ASKED and ids[2][1:2] == [9]
    for row, asked in ((0, ASKED), (2, [9])):
        for col, tid in enumerate([ids[row][0], *asked]):
            assert lps[row][col] == pytest.approx(float(raw[row, tid]), abs=1e-5)
            assert column_ranks[row][col] == 1 + int((raw[row] > raw[row, tid]).sum())
    assert ids[1][1:] == raw[1].topk(4).indices.tolist()  # other rows keep their top-k
    assert column_ranks[1] == [0] * 5


@pytest.mark.parametrize("bad", [dict(logprob_token_ids=[3]), dict(logprobs=1, logprob_token_ids=[3, 3]),
                                 dict(logprobs=1, logprob_token_ids=[-1]), dict(allowed_token_ids=[True])])
def test_bad_params_name_the_field(bad) -> None:
    with pytest.raises(ValueError, match="logprob_token_ids|allowed_token_ids"):
        SamplingParams(**bad)


def test_out_of_vocabulary_ids_are_refused_by_the_engine(tiny_llama) -> None:
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu")
    try:
        for bad in (dict(allowed_token_ids=[1, 10**6]), dict(logprobs=1, logprob_token_ids=[10**6])):
            with pytest.raises(ValueError, match=r"outside the vocabulary"):
                llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2, **bad), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}])
def test_llm_returns_the_asked_logprobs_and_samples_only_allowed_ids(tiny_llama, speculative) -> None:
    prompts = [{"prompt_token_ids": [11, 12, 13, 14, 11, 12, 13]}, {"prompt_token_ids": [40, 41, 42]}]
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", speculative_config=speculative)
    try:
        vocab = json.loads((Path(tiny_llama) / "config.json").read_text())["vocab_size"]
        base = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
        full = llm.generate(prompts, SamplingParams(**base, logprobs=vocab), use_tqdm=False)
        asked = llm.generate(prompts, SamplingParams(**base, logprobs=5, logprob_token_ids=ASKED), use_tqdm=False)
        allowed = llm.generate(prompts, SamplingParams(**base, logprobs=0, allowed_token_ids=ALLOWED,
                                                       logprob_token_ids=ALLOWED), use_tqdm=False)
    finally:
        llm.shutdown()
    for f, a, w in zip(full, asked, allowed, strict=True):
        f, a, w = f.outputs[0], a.outputs[0], w.outputs[0]
        assert a.token_ids == f.token_ids  # asking for logprobs changes nothing else
        for step, (tid, entry) in enumerate(zip(a.token_ids, a.logprobs, strict=True)):
            assert set(entry) == {tid, *ASKED}, step
            for t, lp in entry.items():
                ref = f.logprobs[step][t]
                assert lp.logprob == pytest.approx(ref.logprob, abs=1e-5) and lp.rank == ref.rank, (step, t)
        assert set(w.token_ids) <= set(ALLOWED)
        for tid, entry in zip(w.token_ids, w.logprobs, strict=True):
            assert set(entry) == set(ALLOWED)
            assert tid == max(ALLOWED, key=lambda t: entry[t].logprob)  # greedy among the allowed
