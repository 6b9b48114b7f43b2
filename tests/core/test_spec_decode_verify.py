"""Speculative decoding without a model: the config, n-gram lookup, and the verifier's exactness.

The distribution tests draw many seeded samples through ``verify`` with fixed target logits and
compare the output tokens' frequencies with the target distribution by a chi-square test; they
fail when the p-value is below ``P_VALUE_THRESHOLD`` (a correct sampler fails one run in 10^4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.spec_decode import SpeculativeConfig
from pagedlm.core.spec_decode.ngram_proposer import ngram_drafts
from pagedlm.core.spec_decode.rejection_sampler import VerifyRequest, verify

P_VALUE_THRESHOLD = 1e-4


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "named"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_sizes": 1}, "unknown fields"),
    ({"method": "draft_model", "model": "/", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max"),
])
def test_bad_config_is_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.from_any(fields)


def test_config_defaults_follow_vllm():
    cfg = SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    # a model without a method is a draft model, as vLLM reads it
    assert SpeculativeConfig.from_any({"model": "/", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 1,
                                       "disable_by_batch_size": 4}).speculates(3)
    assert not SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 1,
                                           "disable_by_batch_size": 4}).speculates(4)


def test_unregistered_method_is_refused_naming_the_registered_ones(tiny_llama):
    from pagedlm.core import LLM

    with pytest.raises(ValueError, match=r"method='medusa'.*registered: \['draft_model', 'ngram'"):
        LLM(model=tiny_llama, device="cpu", speculative_config={"method": "medusa", "num_speculative_tokens": 2})


def test_builtin_proposers_come_through_the_hook():
    from pagedlm.core.plugins import get_plugins

    registered = get_plugins().spec_proposers()
    assert registered["ngram"] == "pagedlm.core.spec_decode.ngram_proposer:NgramProposer"
    assert registered["draft_model"] == "pagedlm.core.spec_decode.draft_model_proposer:DraftModelProposer"


def test_cli_takes_speculative_config_json():
    import argparse

    from pagedlm.core.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 4}


# -- n-gram lookup ---------------------------------------------------------------------------------
def test_ngram_drafts_follow_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0 (followed by 4, 9); [2, 3] occurred later at 5 but the longer wins
    assert ngram_drafts(tokens, 1, 3, 2) == [4, 9]
    # with n <= 2 only: the latest [2, 3] (at 5) is followed by 5, 7
    assert ngram_drafts(tokens, 1, 2, 2) == [5, 7]
    assert ngram_drafts(np.array([1, 2, 3, 4]), 1, 3, 4) == []
    assert ngram_drafts(np.array([7, 7]), 1, 3, 4) == [7]
    assert ngram_drafts(np.array([5]), 1, 3, 4) == []


# -- verification ----------------------------------------------------------------------------------
def _request(drafts, temperature=1.0, seed=None, **kw):
    params = SamplingParams(temperature=temperature, max_tokens=8, seed=seed, **kw)
    gen = None
    if seed is not None and temperature > 0:
        gen = torch.Generator().manual_seed(seed)
    return VerifyRequest(params, [1], [], list(drafts), gen)


def test_greedy_verification_accepts_the_longest_matching_prefix_and_the_next_token():
    vocab = 8
    targets = [3, 5, 1, 6]  # argmax of each row
    logits = torch.full((4, vocab), -5.0)
    logits[torch.arange(4), torch.tensor(targets)] = 5.0
    tokens, _ = verify(logits, [_request([3, 5, 2], temperature=0.0)])
    assert tokens == [[3, 5, 1]]  # two accepted, the third replaced by the target's token
    tokens, _ = verify(logits, [_request([3, 5, 1], temperature=0.0)])
    assert tokens == [[3, 5, 1, 6]]  # all accepted plus the bonus token
    tokens, _ = verify(logits[:1], [_request([], temperature=0.0)])
    assert tokens == [[3]]


def test_greedy_verification_applies_what_moves_the_argmax():
    """Plain greedy requests take the raw argmax; a logit bias (or a penalty) is applied first,
    also to a plain request's rows sharing the step with such a request."""
    vocab = 8
    logits = torch.full((3, vocab), -5.0)
    logits[torch.arange(3), torch.tensor([3, 5, 1])] = 5.0
    assert verify(logits[:2], [_request([2], temperature=0.0)])[0] == [[3]]
    biased = _request([2, 2], temperature=0.0, logit_bias={2: 20.0})
    assert verify(logits, [biased])[0] == [[2, 2, 2]]
    # a plain request (row 0) next to the biased one (rows 1-2): its tokens are the plain argmax's
    assert verify(logits, [_request([], temperature=0.0), _request([2], temperature=0.0, logit_bias={2: 20.0})])[0] \
        == [[3], [2, 2]]
    close = torch.zeros(2, vocab)
    close[:, 3], close[:, 4] = 1.0, 0.8
    assert verify(close, [_request([4], temperature=0.0)])[0] == [[3]]
    penalized = _request([4], temperature=0.0, repetition_penalty=2.0)
    penalized.output_token_ids = [3]  # 3 is penalized in row 0, 3 and the draft 4 in row 1
    assert verify(close, [penalized])[0] == [[4, 3]]


def _target(vocab=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 1.5


@pytest.mark.parametrize("params", [{}, {"top_k": 4}, {"top_p": 0.9, "temperature": 1.5},
                                    {"repetition_penalty": 1.7}])
def test_sampled_tokens_follow_the_target_distribution(params):
    """Each request has drafts [likely, unlikely]; over many seeded requests the first output token
    is distributed as the target's row 0, and after an accepted first draft the second token as row 1."""
    num_samples, vocab = 6000, 6
    row0, row1, row2 = _target(vocab, 0), _target(vocab, 1), _target(vocab, 2)
    params = {"temperature": 1.0, **params}
    temperature = params.pop("temperature")
    draft1 = int(row0.argmax())  # accepted often
    draft2 = int(row1.argmin())  # accepted rarely
    requests = [_request([draft1, draft2], temperature=temperature, seed=s, **params) for s in range(num_samples)]
    logits = torch.stack([row0, row1, row2] * num_samples)
    tokens, _ = verify(logits, requests)

    def expected(row, output):  # the target distribution of that row as the plain sampler sees it
        from pagedlm.core.sample import build_sampling_metadata, process_logits
        from pagedlm.core.sample.sampler import apply_top_k_top_p

        p = requests[0].sampling_params
        md = build_sampling_metadata([p], prompt_token_ids=[[1]], output_token_ids=[output], vocab_size=vocab)
        x = process_logits(row.unsqueeze(0), md) / md.random_temperature.unsqueeze(1)
        if md.top_k is not None or md.top_p is not None:
            x = apply_top_k_top_p(x, md.top_k, md.top_p)
        return x.softmax(-1)[0].double().numpy()

    def check(observed_tokens, probs):
        counts = np.bincount(observed_tokens, minlength=vocab)
        support = probs > 0
        assert support.sum() >= 3, "the test needs a target spread over several tokens"
        assert counts[~support].sum() == 0, "a token outside the target's support was sampled"
        exp = probs[support] / probs[support].sum() * counts.sum()
        p_value = chisquare(counts[support], exp).pvalue
        assert p_value > P_VALUE_THRESHOLD, (counts, exp, p_value)

    check(np.array([t[0] for t in tokens]), expected(row0, []))
    second = np.array([t[1] for t in tokens if t[0] == draft1])
    assert len(second) > 1000
    check(second, expected(row1, [draft1]))


def test_seeded_verification_is_reproducible_whatever_the_batch():
    vocab = 6
    rows = torch.stack([_target(vocab, i) for i in range(3)])
    alone = [verify(rows, [_request([1, 2], seed=7)])[0][0] for _ in range(3)]
    mixed = verify(torch.cat([rows[:1], rows, rows[:2]]),
                   [_request([]), _request([1, 2], seed=7), _request([4])])[0][1]
    assert alone[0] == alone[1] == alone[2] == mixed
