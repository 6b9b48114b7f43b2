"""The Triton paged-attention and KV-write kernels against the CPU reference backend.

Each case is a random paged batch: requests with a cached prefix already in the cache (block ids
randomly permuted, so the block table matters), this step's new tokens, and every slot no request
owns poisoned with NaN, so reading outside a context shows up in the output. The reference is
``cpu_paged`` (plain torch, float32) on the same inputs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch

from pagedlm.core.attention import CommonAttentionMetadata

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]

MIXED = [(0, 7), (20, 1), (35, 9), (0, 1), (50, 1), (16, 16), (3, 2)]
DECODES = [(5, 1), (0, 1), (40, 1), (17, 1), (100, 1)]
LONG_DECODES = [(700, 1), (1500, 1), (3, 1)]
if INTERPRET:
    # the interpreter runs each program in numpy: a smaller grid of cases, same code paths
    HEAD_SIZES = [32, 80]
    HEADS = [(4, 4), (4, 2), (6, 2)]
    BLOCK_SIZES = [1, 16]
    DTYPES = [torch.float32, torch.bfloat16]
else:
    HEAD_SIZES = [32, 64, 80, 128, 256]
    HEADS = [(4, 4), (4, 2), (8, 2), (6, 2), (16, 8), (32, 4)]
    BLOCK_SIZES = [1, 16, 32]
    DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


@dataclass
class Case:
    common: CommonAttentionMetadata  # on the CPU
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], NaN where nothing is stored
    new_slots: torch.Tensor  # [T]


def make_case(reqs, *, block_size, num_heads, num_kv_heads, head_size, dtype, seed=0) -> Case:
    """A mixed batch from the conformance kit's generator (random block ids, NaN where nothing is stored)."""
    from pagedlm.core.testing.conformance.paged_batch import make_batch

    batch = make_batch(tuple(reqs), block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, dtype=dtype, seed=seed)
    return Case(batch.common, batch.query, batch.key, batch.value, batch.kv_cache, batch.new_slots)


def reference(case: Case, *, num_heads, num_kv_heads, head_size, sliding_window=None, soft_cap=None,
              scale=None) -> torch.Tensor:
    """``cpu_paged`` in float32 on the same batch (explicit path when soft-capped)."""
    from pagedlm.backends.cpu.attention import CpuAttentionMetadataBuilder, CpuPagedAttentionImpl

    scale = head_size**-0.5 if scale is None else scale
    impl = CpuPagedAttentionImpl(num_heads=num_heads, head_size=head_size, scale=scale,
                                 num_kv_heads=num_kv_heads, sliding_window=sliding_window, logits_soft_cap=soft_cap)
    block_size = case.kv_cache.shape[2]
    meta = CpuAttentionMetadataBuilder(block_size=block_size, device=torch.device("cpu")).build(case.common)
    cache = case.kv_cache.float().clone()
    return impl.forward(case.query.float(), case.key.float(), case.value.float(), cache, meta)


def to_device(common: CommonAttentionMetadata, device: torch.device) -> CommonAttentionMetadata:
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc.to(device), query_start_loc_cpu=common.query_start_loc_cpu,
        seq_lens=common.seq_lens.to(device), seq_lens_cpu=common.seq_lens_cpu,
        num_computed_tokens_cpu=common.num_computed_tokens_cpu, block_table=common.block_table.to(device),
        slot_mapping=common.slot_mapping.to(device), num_reqs=common.num_reqs,
        num_actual_tokens=common.num_actual_tokens, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len, bidirectional_spans=common.bidirectional_spans,
    )


def run_triton(case: Case, device, *, num_heads, num_kv_heads, head_size, sliding_window=None, soft_cap=None,
               num_splits=None, config=None, req_order=None, scale=None):
    from pagedlm.backends.cuda.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    builder = TritonAttentionMetadataBuilder(block_size=case.kv_cache.shape[2], device=device)
    builder.num_kv_heads = num_kv_heads
    meta = builder.build(to_device(case.common, device))
    if num_splits is not None:
        meta.num_splits = num_splits
    if req_order is not None:
        meta.req_order = req_order.to(device=device, dtype=torch.int32)
    scale = head_size**-0.5 if scale is None else scale
    impl = TritonAttentionImpl(num_heads=num_heads, head_size=head_size, scale=scale,
                               num_kv_heads=num_kv_heads, sliding_window=sliding_window, logits_soft_cap=soft_cap)
    impl.kernel_config = config
    cache = case.kv_cache.to(device)
    out = impl.forward(case.query.to(device), case.key.to(device), case.value.to(device), cache, meta)
    return out.cpu(), cache.cpu(), meta


def check(case: Case, device, dtype, *, num_heads, num_kv_heads, head_size, **kwargs):
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    ref_kwargs = {k: v for k, v in kwargs.items() if k in ("sliding_window", "soft_cap", "scale")}
    out, cache, meta = run_triton(case, device, **shape, **kwargs)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert torch.isfinite(out).all(), "non-finite output: a kernel read outside a request's context"
    expected = reference(case, **shape, **ref_kwargs)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    flat = cache.view(2, -1, num_kv_heads, head_size)
    assert torch.equal(flat[0, case.new_slots], case.key)
    assert torch.equal(flat[1, case.new_slots], case.value)
    return meta


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_batch(device, block_size, heads, head_size, dtype):
    num_heads, num_kv_heads = heads
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    case = make_case(MIXED, block_size=block_size, dtype=dtype, seed=block_size + head_size + num_heads, **shape)
    check(case, device, dtype, **shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_batch_and_split_kv(device, heads, num_splits, dtype):
    num_heads, num_kv_heads = heads
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64)
    case = make_case(DECODES, block_size=16, dtype=dtype, seed=num_splits, **shape)
    check(case, device, dtype, num_splits=num_splits, **shape)


@pytest.mark.parametrize("order", ["longest-first", "random"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_order(device, order, num_splits):
    """Decode programs taken in any order of the requests (the runner passes longest first):
    every request's rows are still computed once, from its own context."""
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64)
    reqs = DECODES + LONG_DECODES
    case = make_case(reqs, block_size=16, dtype=torch.bfloat16, seed=13, **shape)
    if order == "longest-first":
        req_order = torch.argsort(case.common.seq_lens, descending=True, stable=True)
    else:
        req_order = torch.randperm(len(reqs), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(req_order, torch.arange(len(reqs)))
    meta = check(case, device, torch.bfloat16, num_splits=num_splits, req_order=req_order, **shape)
    assert meta.req_order is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_splits", [None, 4, 16])
def test_long_context_decode(device, num_splits, dtype):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64)
    case = make_case(LONG_DECODES, block_size=16, dtype=dtype, seed=5, **shape)
    meta = check(case, device, dtype, num_splits=num_splits, **shape)
    if num_splits is None and device.type == "cuda":
        assert meta.num_splits > 1, "three long decodes should take the split-KV path"


@pytest.mark.parametrize("merge", ["in-kernel", "combine-launch"])
def test_split_merge_paths(device, monkeypatch, merge):
    """Split partials merged by each group's last program (``PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel``)
    or by the combine launch (the default) give the same rows, and the counters are all back at
    zero after each launch (the next split launch, or split-K GEMM, starts there)."""
    from pagedlm.backends.cuda.kernels import paged_attention as pa
    from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters

    monkeypatch.setenv("PAGEDLM_CUDA_SPLIT_KV_MERGE", "kernel" if merge == "in-kernel" else "launch")
    # a fresh cache of the setting, so this test's value does not outlive it
    monkeypatch.setattr(pa, "split_merge_in_kernel", functools.cache(pa.split_merge_in_kernel.__wrapped__))
    launches, real_launch = [], pa.launch
    monkeypatch.setattr(pa, "launch", lambda kernel, *a, **k: (launches.append(kernel), real_launch(kernel, *a, **k)))
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64)
    case = make_case(DECODES + LONG_DECODES, block_size=16, dtype=torch.float32, seed=21, **shape)
    for num_splits in (4, 8, 4):
        launches.clear()
        check(case, device, torch.float32, num_splits=num_splits, **shape)
        assert (pa._combine_splits_kernel in launches) == (merge == "combine-launch"), launches
        assert not split_k_counters(device, 0).any()
    with pytest.raises(ValueError, match="PAGEDLM_CUDA_SPLIT_KV_MERGE='both'.*'launch'.*'kernel'"):
        monkeypatch.setenv("PAGEDLM_CUDA_SPLIT_KV_MERGE", "both")
        pa.split_merge_in_kernel.cache_clear()
        pa.split_merge_in_kernel()


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_on_prefill_chunks(device, num_splits):
    """The kernel's split path is general (the builder only picks it for decodes)."""
    shape = dict(num_heads=4, num_kv_heads=2, head_size=32)
    case = make_case(MIXED, block_size=16, dtype=torch.float32, seed=11, **shape)
    check(case, device, torch.float32, num_splits=num_splits, **shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 1000])
def test_sliding_window(device, sliding_window, dtype):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=32)
    case = make_case(MIXED, block_size=16, dtype=dtype, seed=7, **shape)
    check(case, device, dtype, sliding_window=sliding_window, **shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("sliding_window", [None, 512])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_gemma3_270m_shape(device, sliding_window, num_splits, dtype):
    """Gemma 3 270M's attention exactly: 4 query heads on 1 kv head of size 256, scores scaled by
    ``query_pre_attn_scalar ** -0.5`` (256 there; 192 here so a kernel using ``head_dim`` fails),
    local layers' 512-token window over contexts longer than it, prefill chunks and decodes mixed."""
    shape = dict(num_heads=4, num_kv_heads=1, head_size=256)
    reqs = [(0, 9), (600, 1), (530, 7), (3, 1)] if not INTERPRET else [(0, 5), (520, 1), (3, 2)]
    case = make_case(reqs, block_size=16, dtype=dtype, seed=27, **shape)
    check(case, device, dtype, **shape, scale=192**-0.5, sliding_window=sliding_window, num_splits=num_splits)


#: per request of MIXED, (start, end) positions that attend both ways (Gemma 3's images): inside
#: this step's tokens; two in one request; one that starts in the cached prefix (16 cached, the
#: span from 12); one over a request's whole step
MIXED_SPANS = [[(1, 5)], [], [(37, 43)], [], [], [(12, 20), (22, 30)], [(3, 5)]]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_bidirectional_spans(device, dtype, sliding_window, num_splits):
    """A token of a span also sees the span's keys after it (``cpu_paged``'s span mask), with a
    window and with the key range split; the spans change the output of their tokens only."""
    import dataclasses

    shape = dict(num_heads=4, num_kv_heads=2, head_size=32)
    case = make_case(MIXED, block_size=4, dtype=dtype, seed=31, **shape)
    plain, _, _ = run_triton(case, device, **shape, sliding_window=sliding_window, num_splits=num_splits)
    case.common = dataclasses.replace(case.common, bidirectional_spans=MIXED_SPANS)
    meta = check(case, device, dtype, **shape, sliding_window=sliding_window, num_splits=num_splits)
    assert meta.span_end is not None
    qsl = case.common.query_start_loc_cpu.tolist()
    out, _, _ = run_triton(case, device, **shape, sliding_window=sliding_window, num_splits=num_splits)
    changed = (out.float() - plain.float()).abs().amax(dim=(1, 2)) > 0
    in_span = torch.zeros(len(out), dtype=torch.bool)
    for req, spans in enumerate(MIXED_SPANS):
        context = MIXED[req][0]
        for start, end in spans:
            # the last token of a span sees nothing new
            for pos in range(max(start, context), end - 1):
                in_span[qsl[req] + pos - context] = True
    assert torch.equal(changed, in_span)


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_logits_soft_cap(device, sliding_window, num_splits):
    shape = dict(num_heads=4, num_kv_heads=2, head_size=64)
    case = make_case(MIXED, block_size=16, dtype=torch.float32, seed=3, **shape)
    case.query.mul_(4)  # large scores, so the cap really bends them
    check(case, device, torch.float32, sliding_window=sliding_window, soft_cap=2.0, num_splits=num_splits, **shape)


@pytest.mark.parametrize("config", [{"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 128, "BLOCK_N": 32}])
def test_other_tile_shapes(device, config):
    shape = dict(num_heads=8, num_kv_heads=2, head_size=64)
    case = make_case(MIXED, block_size=16, dtype=torch.float32, seed=9, **shape)
    check(case, device, torch.float32, config=config, **shape)


def test_chunked_prefill_equals_one_step(device):
    """A prompt fed in three chunks (each attending to the cache the earlier ones wrote) gives
    the same outputs as the whole prompt in one step."""
    from pagedlm.backends.cuda.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

    torch.manual_seed(0)
    block_size, heads, kv_heads, d, prompt = 4, 4, 2, 32, 23
    q = torch.randn(prompt, heads, d, device=device)
    k = torch.randn(prompt, kv_heads, d, device=device)
    v = torch.randn(prompt, kv_heads, d, device=device)
    block_table = torch.tensor([[6, 2, 7, 0, 5, 3, 1]], dtype=torch.int32, device=device)
    impl = TritonAttentionImpl(num_heads=heads, head_size=d, scale=d**-0.5, num_kv_heads=kv_heads)

    def meta(start: int, stop: int) -> TritonAttentionMetadata:
        pos = torch.arange(start, stop, device=device)
        slots = block_table[0, pos // block_size].long() * block_size + pos % block_size
        return TritonAttentionMetadata(
            num_reqs=1, num_tokens=stop - start, max_query_len=stop - start, max_seq_len=stop,
            query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([stop], dtype=torch.int32, device=device), block_table=block_table,
            slot_mapping=slots,
        )

    cache = torch.zeros(2, 8, block_size, kv_heads, d, device=device)
    whole = impl.forward(q, k, v, cache, meta(0, prompt))
    cache.zero_()
    chunks = [impl.forward(q[a:b], k[a:b], v[a:b], cache, meta(a, b)) for a, b in [(0, 9), (9, 10), (10, 23)]]
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=1e-5)


def test_padded_rows_and_negative_slots(device):
    """Rows past num_tokens come back as zeros; slot -1 tokens are not written."""
    shape = dict(num_heads=2, num_kv_heads=2, head_size=32)
    case = make_case([(3, 2), (9, 1)], block_size=4, dtype=torch.float32, seed=1, **shape)
    out, cache, _ = run_triton(case, device, **shape)
    expected = reference(case, **shape)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)

    from pagedlm.backends.cuda.kernels.paged_attention import write_kv_cache

    cache_dev = case.kv_cache.to(device)
    before = cache_dev.clone()
    slots = torch.full((3,), -1, dtype=torch.int64, device=device)
    kv = torch.randn(3, 2, 32, device=device)
    write_kv_cache(kv, kv, cache_dev[0], cache_dev[1], slots)
    assert torch.equal(cache_dev.isnan(), before.isnan())
    assert torch.equal(torch.nan_to_num(cache_dev), torch.nan_to_num(before))


def test_choose_num_splits():
    from pagedlm.backends.cuda.kernels.paged_attention import choose_num_splits

    assert choose_num_splits(256, 8, 4096, 132) == 1  # the GPU is full already
    assert choose_num_splits(64, 8, 4096, 132) == 1  # 512 programs: ~3.9 per SM
    assert choose_num_splits(48, 8, 4096, 132) == 2
    assert choose_num_splits(24, 8, 4096, 132) == 4
    assert choose_num_splits(8, 8, 4096, 132) == 8
    assert choose_num_splits(1, 8, 4096, 132) == 16
    assert choose_num_splits(4, 8, 4096, 132) == 16
    assert choose_num_splits(4, 8, 1024, 132) == 8  # splits of at least two 64-key tiles
    assert choose_num_splits(1, 8, 100, 132) == 1  # too short to split
    assert choose_num_splits(1, 8, 300, 132) == 2


def test_triton_builder_declares_its_precompile_variants():
    """The unsplit and the split decode variant (a batch can be built with both here), then one prefill."""
    from pagedlm.backends.cuda.triton_attn import TritonAttentionMetadataBuilder
    from pagedlm.core.attention import CommonAttentionMetadata

    def stage(num_tokens, num_reqs):
        qsl = torch.tensor([0, *range(num_tokens - num_reqs + 1, num_tokens + 1)], dtype=torch.int32)
        seq = torch.ones(num_reqs, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_computed_tokens_cpu=torch.zeros(num_reqs, dtype=torch.int32),
            block_table=torch.zeros(num_reqs, 256, dtype=torch.int32),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64), num_reqs=num_reqs,
            num_actual_tokens=num_tokens, max_query_len=num_tokens - num_reqs + 1, max_seq_len=4096)

    builder = TritonAttentionMetadataBuilder(block_size=16, device=torch.device("cpu"))
    builder.num_sms = 132
    builder.bind_model(num_kv_heads=1, head_size=256)
    variants = list(builder.precompile_metadata([1, 2, 4, 256], 16, stage))
    # the split count is a runtime argument: one unsplit and one split decode variant
    splits = [m.num_splits for n, m in variants[:-1]]
    assert splits[0] == 1 and len(splits) == 2 and splits[1] > 1
    assert all(m.max_query_len == 1 for n, m in variants[:-1])
    assert variants[-1][0] == 16 and variants[-1][1].max_query_len == 16


def test_flash_attn_declares_its_page_size_and_no_graphs():
    from pagedlm.backends.cuda.flash_attn import FlashAttentionBackend

    assert not FlashAttentionBackend.supports_graphs  # never run here: no graphs until it is
    FlashAttentionBackend.validate(head_size=128, dtype=torch.bfloat16, block_size=256)
    with pytest.raises(ValueError, match="'flash_attn' needs block_size to be a multiple of 256; got block_size=16"):
        FlashAttentionBackend.validate(head_size=128, dtype=torch.bfloat16, block_size=16)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("reqs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_fp8_cache_reads_as_its_dequantized_values(device, reqs, num_splits):
    """An FP8 cache (stored = value / scale) gives what a bf16 cache holding the dequantized values
    gives: the kernel applies the scales (folded into the softmax scale and the output for 16-bit
    queries, per tile for float32 ones) and changes nothing else. (The write
    is checked against the CPU backend in test_quant_kernels.py; here the reference cache is what
    the FP8 step stored, dequantized.)"""
    from pagedlm.backends.cuda.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    shape = dict(num_heads=8, num_kv_heads=2, head_size=64)
    case = make_case(reqs, block_size=16, dtype=torch.bfloat16, seed=3, **shape)
    scales = torch.tensor([0.02]), torch.tensor([0.05])
    fp8_cache = torch.stack([(case.kv_cache[i].float() / scales[i]).clamp(-448, 448).to(torch.float8_e4m3fn)
                             for i in range(2)])

    def run(cache, key, value, fp8_kv):
        builder = TritonAttentionMetadataBuilder(block_size=16, device=device)
        builder.num_kv_heads = 2
        meta = builder.build(to_device(case.common, device))
        meta.num_splits = num_splits
        impl = TritonAttentionImpl(scale=64**-0.5, **shape)
        if fp8_kv:
            impl.kv_cache_dtype, impl.k_scale, impl.v_scale = "fp8", scales[0].to(device), scales[1].to(device)
        cache = cache.to(device)
        out = impl.forward(case.query.to(device), key.to(device), value.to(device), cache, meta)
        return out.float().cpu(), cache.cpu()

    out_fp8, stored = run(fp8_cache, case.key, case.value, True)
    dequantized = torch.stack([stored[i].float() * scales[i] for i in range(2)]).to(torch.bfloat16)
    flat = dequantized.view(2, -1, 2, 64)
    out_ref, _ = run(dequantized, flat[0, case.new_slots], flat[1, case.new_slots], False)
    assert torch.isfinite(out_fp8).all()
    assert (stored.view(2, -1, 2, 64)[0, case.new_slots].float() != 0).any()  # this step's keys were written
    torch.testing.assert_close(out_fp8, out_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("num_splits", "sliding_window", "query_gain"),
                         [(1, None, 1.0), (4, None, 1.0), (1, None, 4.0), (1, 40, 1.0)])
def test_fp8_decode_within_bf16_rounding(device, num_splits, sliding_window, query_gain):
    """Decode launches over an FP8 cache under a bf16 query (the transposed loop,
    ``FP8_DECODE``) take the scores as float16 dots of the query (exact: bf16 -> float16 inside
    float16's range) with the e4m3 keys converted to float16 (exact), and P @ V with P in float16
    (2^-11). So the output is asserted within bf16 rounding of float32 attention over the
    dequantized cache: relative (Frobenius) error <= 2^-7 and every value within 1e-2 (bf16 output
    rounding alone is 2^-9 = 0.2 %). (A single e4m3 query tile, tried on the FP8 tensor cores,
    missed the first bound: 2.6 % on an H200, 2026-12-02; 5.2 % with the query x 4.)
    ``query_gain`` 4 makes peaked distributions, where score errors move the output most."""
    from pagedlm.backends.cuda.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    shape = dict(num_heads=16, num_kv_heads=4, head_size=128)
    reqs = DECODES + LONG_DECODES[:1]
    case = make_case(reqs, block_size=16, dtype=torch.bfloat16, seed=11, **shape)
    case.query = (case.query.float() * query_gain).to(torch.bfloat16)
    scales = torch.tensor([0.03]), torch.tensor([0.04])
    fp8_cache = torch.stack([(case.kv_cache[i].float() / scales[i]).clamp(-448, 448).to(torch.float8_e4m3fn)
                             for i in range(2)])
    builder = TritonAttentionMetadataBuilder(block_size=16, device=device)
    builder.num_kv_heads = 4
    meta = builder.build(to_device(case.common, device))
    assert meta.max_query_len == 1  # the decode-only launch, which takes the transposed loop
    meta.num_splits = num_splits
    impl = TritonAttentionImpl(scale=128**-0.5, sliding_window=sliding_window, **shape)
    impl.kv_cache_dtype, impl.k_scale, impl.v_scale = "fp8", scales[0].to(device), scales[1].to(device)
    cache = fp8_cache.to(device)
    out = impl.forward(case.query.to(device), case.key.to(device), case.value.to(device), cache, meta)
    out = out.float().cpu()
    assert torch.isfinite(out).all()

    stored = cache.cpu()
    dequantized = torch.stack([stored[i].float() * scales[i] for i in range(2)])
    flat = dequantized.view(2, -1, 4, 128)
    ref_case = Case(case.common, case.query, flat[0, case.new_slots], flat[1, case.new_slots], dequantized,
                    case.new_slots)
    expected = reference(ref_case, sliding_window=sliding_window, scale=128**-0.5, **shape)
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel <= 2**-7, f"relative error {rel:.4f} over 2^-7"
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
