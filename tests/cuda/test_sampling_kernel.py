"""The fused Gumbel-max sampler (``kernels/sampling.py``): greedy rows are ``torch.argmax``,
random rows follow ``softmax(logits / t)``, masked tokens are never drawn, the noise is a
function of ``(seed, offset)``, and core's Sampler takes the fused path exactly when it may.

Under ``TRITON_INTERPRET=1`` every program runs in Python (a random row of a small vocabulary
costs ~15 ms), so sample counts are small there and large on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

try:  # optional where these tests are only collected
    import triton
    import triton.language as tl

    from pagedlm.backends.cuda.kernels.sampling import _gumbel_noise
except ImportError:
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Qwen's vocabulary: not a multiple of any tile size, several chunks
LARGE_VOCAB = 151936
#: chi-square with 6 degrees of freedom exceeds this with probability 1e-4
CHI2_DF6_P1E4 = 27.86


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gumbel_sample(*args, **kwargs):
    from pagedlm.backends.cuda.kernels.sampling import gumbel_sample as fn

    return fn(*args, **kwargs)


if triton is not None:

    @triton.jit
    def _noise_kernel(bits_ptr, out_ptr, BLOCK: tl.constexpr):
        """The sampler's bits -> Gumbel transform, elementwise."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True)
        tl.store(out_ptr + offs, _gumbel_noise(bits))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_greedy_rows_are_torch_argmax(device, dtype):
    """Temperature 0 takes the argmax, lowest index on ties, over a strided row view."""
    torch.manual_seed(0)
    vocab = 5000  # several tiles, the last partial
    storage = torch.randn(6, vocab + 40, device=device).to(dtype)
    logits = storage[:, 3 : vocab + 3]  # row stride vocab + 40: not contiguous
    assert not logits.is_contiguous()
    logits[0] = 1.0  # all tied: column 0
    logits[1, 17] = logits[1, 4100] = 9.0  # tie across tiles: 17
    logits[2, 4999] = 9.0  # the last column
    logits[3, :4000] = float("-inf")  # masked prefix
    logits[4] = float("-inf")  # nothing left: any column, no crash
    out = gumbel_sample(logits, torch.zeros(6, device=device), seed=1, offset=0)
    assert out.dtype == torch.int64 and out.shape == (6,)
    ref = logits.argmax(-1)
    assert torch.equal(out[[0, 1, 2, 3, 5]], ref[[0, 1, 2, 3, 5]])
    assert out[:4].tolist() == [0, 17, 4999, int(logits[3, 4000:].argmax()) + 4000]
    assert 0 <= int(out[4]) < vocab


def test_noise_is_the_gumbel_quantile_of_the_bits(device):
    """The noise of 32 random bits is ``-log(-log(1 - u))`` with ``u = (bits + 1/2) / 2**32``,
    precise where the argmax is decided (the small ``-log(1 - u)``, large noise), finite
    everywhere (bits 0 and 2**32 - 1 included), so a masked logit stays ``-inf``."""
    if triton is None:
        pytest.skip("needs triton")
    low = torch.arange(0, 2048, dtype=torch.int64)  # u down to 2**-33: noise up to ~23
    spread = torch.arange(0, 2**32, 2**21, dtype=torch.int64) + 12345
    high = 2**32 - 1 - torch.arange(0, 2048, dtype=torch.int64)  # u rounds to 1.0
    bits = torch.cat([low, spread, high])
    signed = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    out = torch.empty(bits.numel(), device=device)
    block = 1024
    assert bits.numel() % block == 0
    _noise_kernel[(bits.numel() // block,)](signed.to(device), out, BLOCK=block)
    out = out.cpu().double()
    u = (bits.double() + 0.5) / 2**32
    expected = -torch.log(-torch.log1p(-u))
    assert torch.isfinite(out).all()
    assert out.max() < 23.0 and out.min() > -3.2
    decisive = u < 0.999  # above, u's float32 rounding dominates: noise below -1.9, never decisive
    err = (out - expected)[decisive].abs()
    assert float(err.max()) < 2e-4, float(err.max())
    assert float(out[:2048].sub(expected[:2048]).abs().max()) < 1e-5  # the largest noise


def test_distribution_matches_softmax_over_temperature(device):
    """Empirical frequencies of many rows and calls against ``softmax(logits / t)``, by a
    chi-square test at p = 1e-4 that the same draws fail for a wrong temperature."""
    base = torch.tensor([0.0, -0.75, 0.75, -0.25, 0.5, -0.5, 0.25])  # exact in bf16
    temp = 0.5
    rows, calls = (128, 4) if INTERPRET else (4096, 16)
    logits = base.to(device=device, dtype=torch.bfloat16).expand(rows, 7)
    temperature = torch.full((rows,), temp, device=device)
    counts = torch.zeros(7, dtype=torch.int64)
    for offset in range(calls):
        counts += torch.bincount(gumbel_sample(logits, temperature, 2024, offset).cpu(), minlength=7)
    assert counts.sum() == rows * calls
    assert chi_square(counts, torch.softmax(base / temp, -1)) < CHI2_DF6_P1E4, counts
    # The test can tell: the same draws are far from what the usual bugs would give.
    for wrong in (1.0, temp * temp, 1.0 / temp):  # not divided, divided twice, multiplied
        assert chi_square(counts, torch.softmax(base / wrong, -1)) > 2 * CHI2_DF6_P1E4, wrong


def test_masked_tokens_are_never_drawn(device):
    """``-inf`` columns are never drawn (a high temperature flattens the rest), and a fully
    masked row still returns an in-range column."""
    torch.manual_seed(1)
    rows, vocab = (48, 50) if INTERPRET else (2048, 50)
    logits = torch.randn(rows, vocab, device=device)
    masked = torch.rand(rows, vocab, device=device) < 0.6
    masked[:, 7] = False  # every row keeps a token
    logits[masked] = float("-inf")
    logits[-1] = float("-inf")
    temperature = torch.full((rows,), 5.0, device=device)
    for offset in range(3):
        out = gumbel_sample(logits, temperature, 7, offset)
        assert ((out >= 0) & (out < vocab)).all()
        assert not masked[:-1].gather(1, out[:-1, None]).any()
    # and the drawn set is broad: masking is not done by always drawing column 7
    assert len(set(out[:-1].tolist())) > min(10, rows // 4)


def test_noise_is_a_function_of_seed_and_offset(device):
    torch.manual_seed(2)
    logits = torch.randn(16, 1000, device=device).to(torch.bfloat16)
    temperature = torch.ones(16, device=device)
    first = gumbel_sample(logits, temperature, seed=11, offset=3)
    assert torch.equal(first, gumbel_sample(logits, temperature, seed=11, offset=3))
    for seed, offset in [(12, 3), (11, 4), (11 + 2**40, 3)]:
        other = gumbel_sample(logits, temperature, seed=seed, offset=offset)
        assert int((other != first).sum()) >= 12, (seed, offset)


def test_philox_key_keeps_one_kernel_signature():
    """Every key is an int64 of the same kind (no recompilation between calls)."""
    from pagedlm.backends.cuda.kernels.sampling import philox_key

    keys = {philox_key(seed, offset) for seed in (0, 1, 2**31, 2**62 - 1, -5) for offset in (0, 1, 2**40)}
    assert len(keys) == 15
    assert all(2**62 <= key < 2**63 for key in keys)


def test_mixed_greedy_and_random_rows(device):
    """Greedy rows (t = 0) are the argmax in every call while random rows of flat logits vary."""
    torch.manual_seed(3)
    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab, device=device) * 0.1  # nearly flat
    temperature = torch.tensor([0.0, 1.0] * (rows // 2), device=device)
    draws = torch.stack([gumbel_sample(logits, temperature, 5, offset) for offset in range(4)])
    assert (draws[:, 0::2] == logits[0::2].argmax(-1)).all()
    random_draws = draws[:, 1::2]
    assert (random_draws != logits[1::2].argmax(-1)).float().mean() > 0.8
    assert len(set(random_draws.flatten().tolist())) > 10


@pytest.mark.parametrize("tiles", ["one_tile_per_chunk", "many_tiles_per_chunk"])
def test_large_vocabulary_winner_in_any_chunk(device, monkeypatch, tiles):
    """V = 151936 (a partial last tile): the winner is found in the first, a middle or the last
    chunk, ties across chunks go to the lowest column, and the draws do not depend on how the
    vocabulary is split between programs."""
    from pagedlm.backends.cuda.kernels import sampling

    torch.manual_seed(4)
    logits = torch.randn(3, LARGE_VOCAB, device=device).to(torch.bfloat16)
    logits[0, LARGE_VOCAB - 5] = 60.0  # greedy row: in the partial last tile
    logits[0, 70000] = logits[0, LARGE_VOCAB - 3] = 60.0  # greedy tie: the lowest column wins
    logits[1, LARGE_VOCAB - 2] = 60.0  # random rows, t = 0.6: 100 above the rest
    logits[2, 4095] = 60.0  # end of a tile
    temperature = torch.tensor([0.0, 0.6, 0.6], device=device)
    split = sampling.tiles_per_chunk(3, LARGE_VOCAB, sampling._num_sms(device))
    if tiles == "many_tiles_per_chunk":
        monkeypatch.setattr(sampling, "_num_sms", lambda device: 1)
        assert sampling.tiles_per_chunk(3, LARGE_VOCAB, 1) == sampling.MAX_TILES_PER_CHUNK
    else:
        assert split == 1
    out = gumbel_sample(logits, temperature, 9, 0)
    assert out.tolist() == [70000, LARGE_VOCAB - 2, 4095]
    # Without a planted winner the random rows' draws are the same however the row is split.
    flat = torch.randn(2, LARGE_VOCAB, device=device)
    draw = gumbel_sample(flat, torch.ones(2, device=device), 9, 1)
    monkeypatch.setattr(sampling, "_num_sms", lambda device: 1 if tiles == "one_tile_per_chunk" else 1000)
    assert torch.equal(draw, gumbel_sample(flat, torch.ones(2, device=device), 9, 1))


def test_vocab_not_a_multiple_of_the_tile(device):
    """Small vocabularies use a smaller tile; the masked tail lanes never win."""
    for vocab in (1, 3, 63, 1000, 4097):
        logits = torch.full((2, vocab), -5.0, device=device)
        logits[:, vocab - 1] = 5.0
        out = gumbel_sample(logits, torch.tensor([0.0, 0.05], device=device), 3, 0)
        assert out.tolist() == [vocab - 1, vocab - 1], vocab


# -- core's Sampler ------------------------------------------------------------------------------


@pytest.fixture
def fused_calls():
    """Samplers built in the test bind the CUDA platform's registered ``gumbel_sample``, wrapped
    to count (and record the dtype of) its calls."""
    from pagedlm.core.layers import custom_ops

    real = custom_ops.registered_ops("cuda")["gumbel_sample"]
    calls: list[torch.dtype] = []

    def counting(logits, *args):
        calls.append(logits.dtype)
        return real(logits, *args)

    with custom_ops.use_ops({"gumbel_sample": counting}):
        yield calls


def _metadata(params, vocab, device, generators=None):
    from pagedlm.core.sample import build_sampling_metadata

    return build_sampling_metadata(
        params,
        prompt_token_ids=[[0]] * len(params),
        output_token_ids=[[1] for _ in params],
        vocab_size=vocab,
        device=device,
        generators=generators,
    )


def test_sampler_uses_the_fused_op_when_it_may(device, fused_calls):
    from pagedlm.core.sample import Sampler
    from pagedlm.core.sampling_params import SamplingParams

    torch.manual_seed(5)
    vocab = 200
    logits = torch.randn(4, vocab, device=device).to(torch.bfloat16)
    sampler = Sampler()

    # Plain temperature batch: one fused call on the raw bf16 logits (no float32 copy).
    md = _metadata([SamplingParams(temperature=0.8)] * 4, vocab, device)
    torch.manual_seed(6)
    first = sampler(logits, md).sampled_token_ids
    assert fused_calls == [torch.bfloat16]
    assert first.dtype == torch.int64 and ((first >= 0) & (first < vocab)).all()
    torch.manual_seed(6)  # the per-call key comes from torch's default generator
    assert torch.equal(sampler(logits, md).sampled_token_ids, first)

    # Mixed greedy and random rows: still fused; the greedy rows get the argmax.
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    fused_calls.clear()
    out = sampler(logits, _metadata(mixed, vocab, device)).sampled_token_ids
    assert fused_calls == [torch.bfloat16]
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()

    # Penalties: processed float32 logits go through the fused op.
    fused_calls.clear()
    sampler(logits, _metadata([SamplingParams(temperature=0.8, presence_penalty=0.5)] * 4, vocab, device))
    assert fused_calls == [torch.float32]

    # A seeded row that is greedy never draws, so it does not block the fused op.
    fused_calls.clear()
    seeded_greedy = [SamplingParams(temperature=0.0, seed=1)] + [SamplingParams(temperature=1.0)] * 3
    gen = torch.Generator(device=device).manual_seed(1)
    sampler(logits, _metadata(seeded_greedy, vocab, device, generators={0: gen}))
    assert fused_calls == [torch.bfloat16]


def test_all_greedy_batches_take_the_fused_argmax(device, fused_calls):
    from pagedlm.core.sample import Sampler
    from pagedlm.core.sampling_params import SamplingParams

    torch.manual_seed(7)
    vocab = 5000
    logits = torch.randn(3, vocab, device=device, dtype=torch.bfloat16)
    logits[1, 17] = logits[1, 4000] = logits[1].max() + 1  # a tie: the lowest index wins, as in torch
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0)] * 3, vocab, device)).sampled_token_ids
    assert fused_calls == [torch.bfloat16]
    assert torch.equal(out, logits.argmax(-1))
    assert int(out[1]) == 17


@pytest.mark.parametrize("case", ["seeded", "top_k", "top_p", "min_p"])
def test_sampler_keeps_the_torch_path(device, fused_calls, case):
    from pagedlm.core.sample import Sampler
    from pagedlm.core.sampling_params import SamplingParams

    torch.manual_seed(7)
    vocab = 200
    logits = torch.randn(3, vocab, device=device)
    generators = None
    params = {
        "seeded": [SamplingParams(temperature=0.8, seed=3)] + [SamplingParams(temperature=0.8)] * 2,
        "top_k": [SamplingParams(temperature=0.8, top_k=5)] * 3,
        "top_p": [SamplingParams(temperature=0.8, top_p=0.9)] * 3,
        "min_p": [SamplingParams(temperature=0.8, min_p=0.1)] * 3,
    }[case]
    if case == "seeded":
        generators = {0: torch.Generator(device=device).manual_seed(3)}
    out = Sampler()(logits, _metadata(params, vocab, device, generators)).sampled_token_ids
    assert fused_calls == []
    assert ((out >= 0) & (out < vocab)).all()
