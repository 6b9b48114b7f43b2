"""Tests of the device sampler (``pagedlm.core.sample``): greedy, random, seeds, filters,
penalties, min-tokens, logit bias and logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core.sample import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    compute_topk_logprobs,
    process_logits,
)
from pagedlm.core.sample.penalties import apply_penalties
from pagedlm.core.sample.sampler import apply_min_p, apply_top_k_top_p
from pagedlm.core.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def make_md(
    params: list[SamplingParams],
    vocab_size: int,
    device: torch.device,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    return build_sampling_metadata(
        params,
        prompt_token_ids=prompts if prompts is not None else [[0]] * len(params),
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        vocab_size=vocab_size,
        device=device,
        generators=generators,
    )


def seeded(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def test_greedy_equals_argmax(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50, device=device)
    md = make_md([SamplingParams(temperature=0.0)] * 7, 50, device)
    assert md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.device.type == device.type
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs_tensors is None


def test_greedy_ties_take_lowest_index(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]], device=device)
    md = make_md([SamplingParams(temperature=0.0)] * 2, 4, device)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 0]


def test_greedy_accepts_half_precision_and_does_not_mutate_input(device: torch.device) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 30, device=device).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={3: 1.0}, presence_penalty=0.5)] * 4
    md = make_md(params, 30, device, outputs=[[1], [2], [], [3]])
    out = Sampler()(logits, md)
    assert torch.equal(logits, before)
    assert torch.equal(out.sampled_token_ids, process_logits(logits, md).argmax(-1))


def test_temperature_histogram_matches_softmax(device: torch.device) -> None:
    # 20k rows of the same logits in one call: the empirical frequencies must track softmax(l/T).
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device=device)
    n = 20000
    temp = 0.7
    md = make_md([SamplingParams(temperature=temp)] * n, 5, device)
    torch.manual_seed(1234)
    if device.type == "cuda":
        torch.cuda.manual_seed(1234)
    tokens = Sampler()(base.expand(n, 5).clone(), md).sampled_token_ids
    freq = torch.bincount(tokens.cpu(), minlength=5).float() / n
    expected = torch.softmax(base.cpu() / temp, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_seeded_rows_histogram_matches_softmax(device: torch.device) -> None:
    # Same check through the per-row generator path (one generator per row).
    base = torch.tensor([1.0, 0.0, -0.5, 0.3], device=device)
    n = 4000
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    md = make_md(params, 4, device, generators={i: seeded(i, device) for i in range(n)})
    tokens = Sampler()(base.expand(n, 4).clone(), md).sampled_token_ids
    freq = torch.bincount(tokens.cpu(), minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(base.cpu(), -1), atol=0.03), freq


def test_seed_reproducible_across_batch_compositions(device: torch.device) -> None:
    vocab = 64
    steps = 6
    torch.manual_seed(7)
    step_logits = [torch.randn(5, vocab, device=device) for _ in range(steps)]
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=42)

    # Alone: the request is row 0 of a batch of 1.
    gen = seeded(42, device)
    alone = []
    for logits in step_logits:
        md = make_md([target], vocab, device, generators={0: gen})
        alone.append(int(Sampler()(logits[3:4], md).sampled_token_ids[0]))

    # Row 3 of 5, beside unseeded random, greedy, other-seeded and seeded-greedy rows.
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, seed=1, min_p=0.1),
        target,
        SamplingParams(temperature=0.0, seed=3),
    ]
    gens = {2: seeded(1, device), 3: seeded(42, device), 4: seeded(3, device)}
    greedy_state = gens[4].get_state().clone()
    mixed = []
    for logits in step_logits:
        md = make_md(others, vocab, device, generators=gens)
        assert not md.all_greedy and not md.all_random
        out = Sampler()(logits, md).sampled_token_ids
        mixed.append(int(out[3]))
        assert int(out[1]) == int(logits[1].argmax())
        assert int(out[4]) == int(logits[4].argmax())
    assert alone == mixed
    # A greedy row never advances its generator.
    assert torch.equal(gens[4].get_state(), greedy_state)


def test_each_random_row_consumes_one_draw_of_vocab_size(device: torch.device) -> None:
    vocab = 33
    gen = seeded(5, device)
    md = make_md([SamplingParams(temperature=1.0, seed=5)], vocab, device, generators={0: gen})
    Sampler()(torch.randn(1, vocab, device=device), md)
    reference = seeded(5, device)
    torch.empty(vocab, device=device).exponential_(generator=reference)
    assert torch.equal(gen.get_state(), reference.get_state())


def test_top_k_1_equals_greedy(device: torch.device) -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 100, device=device)
    md = make_md([SamplingParams(temperature=1.5, top_k=1)] * 8, 100, device)
    assert md.top_k is not None and md.top_p is None
    for _ in range(5):
        assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_keeps_only_top_token(device: torch.device) -> None:
    torch.manual_seed(4)
    logits = torch.randn(8, 100, device=device)
    md = make_md([SamplingParams(temperature=2.0, top_p=1e-6)] * 8, 100, device)
    filtered = apply_top_k_top_p(logits, None, md.top_p)
    assert torch.equal(torch.isfinite(filtered).sum(-1).cpu(), torch.ones(8, dtype=torch.int64))
    for _ in range(5):
        assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))


def test_top_k_top_p_match_reference(device: torch.device) -> None:
    torch.manual_seed(5)
    vocab = 40
    logits = torch.randn(6, vocab, device=device)
    top_k = torch.tensor([0, 5, 1, 40, 12, 3], device=device)
    top_p = torch.tensor([0.5, 1.0, 0.9, 0.3, 0.8, 0.99], device=device)
    got = apply_top_k_top_p(logits, top_k, top_p).cpu()
    for row in range(6):
        # Reference with a plain per-row loop: keep top-k, then the smallest prefix of the
        # descending order whose mass reaches p (mass measured after top-k).
        values, order = logits[row].cpu().sort(descending=True)
        k = int(top_k[row]) or vocab
        probs = torch.softmax(values[:k], -1)
        keep, mass = [], 0.0
        for i in range(k):
            keep.append(int(order[i]))
            mass += float(probs[i])
            if mass >= float(top_p[row]) - 1e-6:
                break
        assert sorted(torch.isfinite(got[row]).nonzero().flatten().tolist()) == sorted(keep)
        assert torch.equal(got[row][keep], logits[row].cpu()[keep])


def test_top_k_only_without_top_p(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]], device=device)
    got = apply_top_k_top_p(logits, torch.tensor([2, 0], device=device), None)
    inf = float("inf")
    assert got.cpu().tolist() == [[-inf, 4.0, 3.0, -inf], [0.0, 1.0, 2.0, 3.0]]


def test_min_p_filters(device: torch.device) -> None:
    # probs ~ [0.5, 0.3, 0.15, 0.05]; min_p=0.5 keeps p >= 0.25: tokens 0 and 1.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]], device=device)
    logits = probs.log()
    filtered = apply_min_p(logits, torch.tensor([0.5, 0.0], device=device))
    assert torch.isfinite(filtered).cpu().tolist() == [[True, True, False, False], [True] * 4]
    n = 2000
    md = make_md([SamplingParams(temperature=1.0, min_p=0.5)] * n, 4, device)
    tokens = Sampler()(logits[:1].expand(n, 4).clone(), md).sampled_token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_penalties_change_exactly_expected_logits(device: torch.device) -> None:
    vocab = 6
    row = [1.0, 2.0, -1.0, 3.0, -2.0, 0.5]
    logits = torch.tensor([row, row, row], device=device)
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=0.5),  # < 1 rewards repeats
    ]
    prompts = [[1, 2], [1, 2, 3], [4]]  # padded with vocab_size inside the metadata
    outputs = [[2, 3, 3], [0, 0], [5]]
    md = make_md(params, vocab, device, prompts=prompts, outputs=outputs)
    assert not md.no_penalties
    assert md.prompt_token_ids is not None and md.prompt_token_ids.shape == (3, 3)
    got = process_logits(logits, md).cpu().tolist()
    # Row 0, by hand. Repetition over prompt+output {1,2,3}: 2/2=1, -1*2=-2, 3/2=1.5.
    # Frequency over output counts {2:1, 3:2}: -2-0.5=-2.5, 1.5-1.0=0.5. Presence: -0.25 each.
    assert got[0] == pytest.approx([1.0, 1.0, -2.75, 0.25, -2.0, 0.5])
    assert got[1] == pytest.approx(row)
    # Row 2: seen {4, 5}: -2 * 0.5 = -1.0, 0.5 / 0.5 = 1.0.
    assert got[2] == pytest.approx([1.0, 2.0, -1.0, 3.0, -1.0, 1.0])


def test_apply_penalties_ignores_out_of_range_ids(device: torch.device) -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]], device=device)
    prompt = torch.tensor([[0, 3, 3, 7]], device=device)  # 3 is the padding, 7 beyond the logits
    one = torch.ones(1, device=device)
    zero = torch.zeros(1, device=device)
    got = apply_penalties(logits, prompt, [[9, 1]], one, one, 2 * one)
    assert got.cpu().tolist() == [[0.5, -1.5, 1.0]]
    got = apply_penalties(logits, None, [[]], zero, zero, 2 * one)
    assert torch.equal(got, logits)


def test_min_tokens_masks_eos_until_reached(device: torch.device) -> None:
    eos = 5
    logits = torch.zeros(2, 8, device=device)
    logits[:, eos] = 10.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[eos])] * 2
    md = make_md(params, 8, device, outputs=[[1], [1, 2, 3]])
    assert set(md.min_tokens) == {0, 1}
    out = Sampler()(logits, md).sampled_token_ids.tolist()
    assert out[0] != eos and out[1] == eos
    processed = process_logits(logits, md)
    assert processed[0, eos] == float("-inf") and processed[1, eos] == 10.0
    # The random path must respect the mask too.
    md = make_md(
        [SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[eos])] * 200, 8, device, outputs=[[0]] * 200
    )
    assert eos not in Sampler()(logits[:1].expand(200, 8).clone(), md).sampled_token_ids.tolist()


def test_logit_bias_forces_token(device: torch.device) -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 20, device=device)
    params = [SamplingParams(temperature=t, logit_bias={7: 100.0}) for t in (0.0, 1.0, 0.0, 2.0)]
    md = make_md(params, 20, device)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [7, 7, 7, 7]
    # Bias is additive and only on the biased row.
    md = make_md([SamplingParams(logit_bias={2: -1.5}), SamplingParams()], 20, device)
    got = process_logits(logits[:2], md)
    expected = logits[:2].clone()
    expected[0, 2] -= 1.5
    assert torch.allclose(got, expected)


def test_logprobs_are_raw_log_softmax_with_ranks(device: torch.device) -> None:
    torch.manual_seed(8)
    vocab = 50
    logits = torch.randn(4, vocab, device=device) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=10, logprobs=2, presence_penalty=1.0),
        SamplingParams(temperature=1.3, logit_bias={4: 5.0}),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5),
    ]
    md = make_md(params, vocab, device, outputs=[[], [1, 2], [], [int(logits[3].argmax())]])
    assert md.max_num_logprobs == 5
    out = Sampler()(logits, md)
    lt = out.logprobs_tensors
    assert lt is not None
    assert lt.logprob_token_ids.shape == (4, 6) and lt.logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits.double(), -1).float()
    ids, lps, ranks = lt.tolists()
    sampled = out.sampled_token_ids.tolist()
    for r in range(4):
        assert ids[r][0] == sampled[r]
        assert lps[r][0] == pytest.approx(float(raw[r, sampled[r]]), abs=1e-5)
        top = raw[r].topk(5)
        assert ids[r][1:] == top.indices.tolist()
        assert lps[r][1:] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert ranks[r] == 1 + int((raw[r] > raw[r, sampled[r]]).sum())
    assert ranks[0] == 1  # greedy without processing picks the top token


def test_compute_topk_logprobs_k0_and_ranks(device: torch.device) -> None:
    lp = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 3.0], [1.0, 1.0, 0.0, 0.0]], device=device), -1)
    targets = torch.tensor([2, 3], device=device, dtype=torch.int32)
    out = compute_topk_logprobs(lp, 0, targets)
    assert out.logprob_token_ids.shape == (2, 1) and out.logprobs.shape == (2, 1)
    assert out.logprob_token_ids.dtype == torch.int64
    ids, lps, ranks = out.tolists()
    assert ids == [[2], [3]]
    assert lps[0][0] == pytest.approx(float(lp[0, 2]))
    assert ranks == [3, 3]  # row 1: tied tokens share the better rank
    out2 = compute_topk_logprobs(lp, 2, targets)
    assert out2.logprob_token_ids[0].tolist() == [2, 3, 1]
    # topk's order among equal values is unspecified: compare the set.
    assert out2.logprob_token_ids[1, 0] == 3 and set(out2.logprob_token_ids[1, 1:].tolist()) == {0, 1}
    with pytest.raises(ValueError):
        compute_topk_logprobs(lp, -1, targets)


def test_empty_batch(device: torch.device) -> None:
    md = make_md([], 10, device)
    out = Sampler()(torch.empty(0, 10, device=device), md)
    assert out.sampled_token_ids.shape == (0,) and out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs_tensors is None
    md.max_num_logprobs = 3
    out = Sampler()(torch.empty(0, 10, device=device), md)
    assert out.logprobs_tensors is not None
    assert out.logprobs_tensors.logprob_token_ids.shape == (0, 4)
    assert out.logprobs_tensors.tolists() == ([], [], [])


def test_mixed_batch_greedy_rows_unaffected_by_random_filters(device: torch.device) -> None:
    torch.manual_seed(9)
    logits = torch.randn(6, 30, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=2),
    ]
    md = make_md(params, 30, device)
    out = Sampler()(logits, md).sampled_token_ids
    greedy = logits.argmax(-1)
    assert out[0] == greedy[0] and out[2] == greedy[2] and out[4] == greedy[4]
    assert int(out[5]) in logits[5].topk(2).indices.tolist()
    assert int(out[1]) in logits[1].topk(3).indices.tolist()


def test_shape_mismatch_raises() -> None:
    md = make_md([SamplingParams()], 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 4), md)
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(4), md)
