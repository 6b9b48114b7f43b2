"""The sampler's sort-free top-k path gives the same filtering as the sorting one (CPU and GPU)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core.sample.sampler import apply_top_k_top_p


@pytest.fixture(params=["cpu", "cuda"])
def dev(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch.device(request.param)


def test_topk_without_sort_matches_sort(dev):
    torch.manual_seed(0)
    logits = torch.randn(6, 5000, device=dev)
    logits[2] *= 0.1
    logits[2, :40] = 3.0  # ties at the k-th value are kept by both
    top_k = torch.tensor([1, 7, 20, 0, 5000, 37], device=dev)  # 0 and >= V: off
    fast = apply_top_k_top_p(logits, top_k, None, max_top_k=37)
    slow = apply_top_k_top_p(logits, top_k, None)
    assert torch.equal(fast, slow)
    assert int(torch.isfinite(fast[0]).sum()) == 1 and int(torch.isfinite(fast[2]).sum()) == 40
    assert torch.isfinite(fast[3]).all() and torch.isfinite(fast[4]).all()


def test_metadata_carries_the_largest_top_k():
    from pagedlm.core.sample import build_sampling_metadata
    from pagedlm.core.sampling_params import SamplingParams

    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_k=50),
              SamplingParams(temperature=0.0, top_k=900), SamplingParams(temperature=1.0)]
    md = build_sampling_metadata(params, prompt_token_ids=[[1]] * 4, output_token_ids=[[] for _ in range(4)],
                                 vocab_size=100)
    assert md.max_top_k == 50  # the greedy row's top-k is ignored; k >= vocab is off
    none = build_sampling_metadata(params[3:], prompt_token_ids=[[1]], output_token_ids=[[]], vocab_size=100)
    assert none.max_top_k is None and none.top_k is None
