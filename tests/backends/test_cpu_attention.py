"""``cpu_paged`` against an obviously-correct per-request, per-token reference.

Each case builds a batch by hand: requests with a cached prefix already in the paged cache
(written by the test through the block table) plus this step's new tokens, block ids randomly
permuted so the block table matters, and every unused cache slot filled with NaN so that
reading anything outside a request's context would show up in the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedlm.backends.cpu import attention as cpu_attention
from pagedlm.backends.cpu.attention import (
    CpuAttentionMetadata,
    CpuAttentionMetadataBuilder,
    CpuPagedAttentionBackend,
    CpuPagedAttentionImpl,
)
from pagedlm.core.attention import Attention, CommonAttentionMetadata
from pagedlm.core.attention.selector import get_attn_backend_cls
from pagedlm.core.config import DeviceConfig, VllmConfig
from pagedlm.core.forward_context import set_current_vllm_config, set_forward_context

# (cached prefix length, query length): decodes, fresh prefills, prefix-cached prompts and
# chunked-prefill continuations interleaved, so the decode/prefill split must keep row order
MIXED_BATCH = [(0, 7), (20, 1), (35, 9), (0, 1), (50, 1), (16, 16), (3, 2)]


@dataclass
class Step:
    common: CommonAttentionMetadata
    #: per request: context keys/values [seq_len, Hkv, D] (cached prefix + new tokens)
    ctx_k: list[torch.Tensor]
    ctx_v: list[torch.Tensor]
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]


def make_step(
    reqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Step:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + qlen for cached, qlen in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few blocks no request owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 1  # a spare column: tables are wider than needed
    block_table = torch.full((len(reqs), max_blocks), num_blocks - 1, dtype=torch.int32)
    owned: list[list[int]] = []
    for i, n in enumerate(blocks_per_req):
        ids, perm = perm[:n], perm[n:]
        owned.append(ids)
        block_table[i, :n] = torch.tensor(ids, dtype=torch.int32)

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    ctx_k, ctx_v, qs, ks, vs, slots = [], [], [], [], [], []
    for (cached, qlen), ids in zip(reqs, owned, strict=True):
        k = torch.randn(cached + qlen, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(cached + qlen, num_kv_heads, head_size, generator=gen).to(dtype)
        ctx_k.append(k)
        ctx_v.append(v)
        for pos in range(cached + qlen):
            block, off = ids[pos // block_size], pos % block_size
            if pos < cached:  # the prefix is already in the cache
                kv_cache[0, block, off] = k[pos]
                kv_cache[1, block, off] = v[pos]
            else:
                slots.append(block * block_size + off)
        qs.append(torch.randn(qlen, num_heads, head_size, generator=gen).to(dtype))
        ks.append(k[cached:])
        vs.append(v[cached:])

    query_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq,
        seq_lens_cpu=seq.clone(),
        num_computed_tokens_cpu=torch.tensor([c for c, _ in reqs], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(reqs),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return Step(common, ctx_k, ctx_v, torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache)


def reference(
    step: Step,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Loop over requests, tokens and heads in float64, straight from the definitions."""
    out = torch.zeros(step.query.shape, dtype=torch.float64)
    qsl = step.common.query_start_loc_cpu.tolist()
    group = num_heads // num_kv_heads
    for r in range(step.common.num_reqs):
        k, v = step.ctx_k[r].double(), step.ctx_v[r].double()
        seq_len, qlen = k.shape[0], qsl[r + 1] - qsl[r]
        for i in range(qlen):
            row, pos = qsl[r] + i, seq_len - qlen + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                kh, vh = k[lo : pos + 1, h // group], v[lo : pos + 1, h // group]
                scores = (kh @ step.query[row, h].double()) * scale
                if soft_cap is not None:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                out[row, h] = torch.softmax(scores, dim=0) @ vh
    return out


def run_impl(step: Step, impl: CpuPagedAttentionImpl, block_size: int) -> tuple[torch.Tensor, CpuAttentionMetadata]:
    builder = CpuAttentionMetadataBuilder(block_size=block_size, device=torch.device("cpu"))
    metadata = builder.build(step.common)
    return impl.forward(step.query, step.key, step.value, step.kv_cache, metadata), metadata


def make_impl(num_heads, num_kv_heads, head_size, *, use_sdpa=True, sliding_window=None, soft_cap=None):
    impl = CpuPagedAttentionImpl(
        num_heads=num_heads,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=num_kv_heads,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
    )
    impl.use_sdpa = use_sdpa
    return impl


TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def check(step, impl, block_size, dtype, **ref_kwargs):
    out, _ = run_impl(step, impl, block_size)
    assert out.shape == step.query.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    expected = reference(step, num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, scale=impl.scale, **ref_kwargs)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    # this step's K/V landed in their slots
    flat = step.kv_cache.view(2, -1, impl.num_kv_heads, impl.head_size)
    torch.testing.assert_close(flat[0, step.common.slot_mapping], step.key, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, step.common.slot_mapping], step.value, atol=0, rtol=0)


@pytest.mark.parametrize("use_sdpa", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_reference(block_size, heads, head_size, dtype, use_sdpa):
    num_heads, num_kv_heads = heads
    step = make_step(MIXED_BATCH, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, dtype=dtype, seed=block_size * 1000 + head_size + num_kv_heads)
    impl = make_impl(num_heads, num_kv_heads, head_size, use_sdpa=use_sdpa)
    check(step, impl, block_size, dtype)


@pytest.mark.parametrize("use_sdpa", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 1000])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window(block_size, sliding_window, dtype, use_sdpa):
    step = make_step(MIXED_BATCH, block_size=block_size, num_heads=8, num_kv_heads=2, head_size=32, dtype=dtype, seed=7)
    impl = make_impl(8, 2, 32, use_sdpa=use_sdpa, sliding_window=sliding_window)
    check(step, impl, block_size, dtype, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("block_size", [1, 16])
def test_logits_soft_cap(block_size, sliding_window, dtype):
    step = make_step(MIXED_BATCH, block_size=block_size, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype, seed=3)
    # large inputs so the cap really bends the scores
    step.query.mul_(4)
    impl = make_impl(4, 2, 64, sliding_window=sliding_window, soft_cap=2.0)
    check(step, impl, block_size, dtype, sliding_window=sliding_window, soft_cap=2.0)


@pytest.mark.parametrize("use_sdpa", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("reqs", [
    [(5, 1), (0, 1), (40, 1), (17, 1)],  # decode only
    [(0, 23)],  # one fresh prefill
    [(32, 5)],  # one prefix-cached prompt
], ids=["decodes", "prefill", "cached-prefill"])
def test_uniform_batches(reqs, use_sdpa):
    step = make_step(reqs, block_size=16, num_heads=4, num_kv_heads=1, head_size=32, dtype=torch.float32)
    impl = make_impl(4, 1, 32, use_sdpa=use_sdpa)
    check(step, impl, 16, torch.float32)


@pytest.mark.parametrize(("heads", "head_size"), [((4, 1), 256), ((8, 2), 64), ((3, 3), 40)])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("reqs", [[(5, 1), (0, 1), (40, 1), (17, 1), (90, 1)], MIXED_BATCH], ids=["decodes", "mixed"])
def test_decode_kernel_matches_reference(reqs, heads, head_size, sliding_window, monkeypatch):
    """float32 decodes go through kernels/attention_decode.c (Gemma 3 270M's 4 query heads of 256 on one
    kv head among the shapes); in a step of decodes only it also writes their K/V."""
    calls = []
    kernel = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(a[-1] is not None) or kernel(*a))
    num_heads, num_kv_heads = heads
    step = make_step(reqs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     dtype=torch.float32, seed=head_size)
    impl = make_impl(num_heads, num_kv_heads, head_size, sliding_window=sliding_window)
    check(step, impl, 16, torch.float32, sliding_window=sliding_window)
    assert calls == [reqs is not MIXED_BATCH]


def test_metadata_groups():
    step = make_step(MIXED_BATCH, block_size=16, num_heads=2, num_kv_heads=2, head_size=32, dtype=torch.float32)
    metadata = CpuAttentionMetadataBuilder(block_size=16, device=torch.device("cpu")).build(step.common)
    assert metadata.num_decodes == 3
    decodes, prefills = metadata.groups
    assert decodes.query_valid is None and decodes.max_query_len == 1 and decodes.max_seq_len == 51
    assert prefills.max_query_len == 16 and prefills.max_seq_len == 44
    rows = torch.cat([decodes.out_index, prefills.out_index]).sort().values
    assert torch.equal(rows, torch.arange(step.common.num_actual_tokens))


def test_chunked_prefill_matches_single_step():
    """The same prompt in one step or in three chunks across steps gives the same outputs."""
    torch.manual_seed(0)
    block_size, heads, kv_heads, d, prompt = 4, 4, 2, 32, 23
    q = torch.randn(prompt, heads, d)
    k = torch.randn(prompt, kv_heads, d)
    v = torch.randn(prompt, kv_heads, d)
    num_blocks = 8
    block_table = torch.tensor([[6, 2, 7, 0, 5, 3, 1]], dtype=torch.int32)
    impl = make_impl(heads, kv_heads, d)
    builder = CpuAttentionMetadataBuilder(block_size=block_size, device=torch.device("cpu"))

    def step_meta(start: int, stop: int) -> CpuAttentionMetadata:
        pos = torch.arange(start, stop)
        slots = block_table[0, pos // block_size].long() * block_size + pos % block_size
        qsl = torch.tensor([0, stop - start], dtype=torch.int32)
        seq = torch.tensor([stop], dtype=torch.int32)
        return builder.build(CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_computed_tokens_cpu=torch.tensor([start], dtype=torch.int32), block_table=block_table,
            slot_mapping=slots, num_reqs=1, num_actual_tokens=stop - start, max_query_len=stop - start,
            max_seq_len=stop,
        ))

    cache = torch.zeros(CpuPagedAttentionBackend.get_kv_cache_shape(num_blocks, block_size, kv_heads, d))
    whole = impl.forward(q, k, v, cache, step_meta(0, prompt))
    cache = torch.zeros_like(cache)
    chunks = [impl.forward(q[a:b], k[a:b], v[a:b], cache, step_meta(a, b)) for a, b in [(0, 9), (9, 10), (10, 23)]]
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=1e-5)


def test_padded_tokens_are_ignored():
    """Rows past num_actual_tokens (slot -1) are neither written nor attended; output zeros."""
    step = make_step([(3, 2), (9, 1)], block_size=4, num_heads=2, num_kv_heads=2, head_size=32, dtype=torch.float32)
    impl = make_impl(2, 2, 32)
    pad = 2
    meta = CpuAttentionMetadataBuilder(block_size=4, device=torch.device("cpu")).build(step.common)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1)])
    cache_before = step.kv_cache.clone()
    query = torch.cat([step.query, torch.randn(pad, 2, 32)])
    key = torch.cat([step.key, torch.randn(pad, 2, 32)])
    out = impl.forward(query, key, torch.cat([step.value, torch.randn(pad, 2, 32)]), step.kv_cache, meta)
    assert torch.equal(out[-pad:], torch.zeros(pad, 2, 32))
    expected = reference(step, num_heads=2, num_kv_heads=2, scale=impl.scale)
    torch.testing.assert_close(out[:-pad].double(), expected, atol=1e-5, rtol=1e-5)
    changed = ~(step.kv_cache.isnan() & cache_before.isnan()) & (step.kv_cache != cache_before)
    assert int(changed.sum()) == 2 * step.common.num_actual_tokens * 2 * 32


def test_explicit_path_chunks_queries(monkeypatch):
    """Long prefills split the float32 score tensor into query chunks; results are unchanged."""
    monkeypatch.setattr(cpu_attention, "_MAX_SCORE_ELEMENTS", 300)
    step = make_step(MIXED_BATCH, block_size=16, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)
    impl = make_impl(4, 2, 32, soft_cap=5.0)
    check(step, impl, 16, torch.float32, soft_cap=5.0)


def test_backend_description_and_validation():
    assert CpuPagedAttentionBackend.name == "cpu_paged"
    assert CpuPagedAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert CpuPagedAttentionBackend.get_builder_cls() is CpuAttentionMetadataBuilder
    assert CpuPagedAttentionBackend.get_impl_cls() is CpuPagedAttentionImpl
    CpuPagedAttentionBackend.validate(head_size=80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        CpuPagedAttentionBackend.validate(head_size=64, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_impl(6, 4, 32)
    with pytest.raises(ValueError, match="sliding_window"):
        make_impl(4, 4, 32, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        make_impl(4, 4, 32, soft_cap=-1.0)


def test_attention_layer_facade_uses_cpu_backend():
    """The model-facing Attention layer, built in a build context, routes through cpu_paged."""
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))  # "auto" is CUDA on a GPU machine
    backend = get_attn_backend_cls(config)
    assert backend is CpuPagedAttentionBackend
    with set_current_vllm_config(config, backend):
        layer = Attention(4, 32, 32**-0.5, 2, prefix="layers.0.attn")
    step = make_step(MIXED_BATCH, block_size=16, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layer.kv_cache = step.kv_cache
    metadata = CpuAttentionMetadataBuilder(block_size=16, device=torch.device("cpu")).build(step.common)
    t = step.common.num_actual_tokens
    with set_forward_context(metadata):
        out = layer(step.query.reshape(t, -1), step.key.reshape(t, -1), step.value.reshape(t, -1))
    expected = reference(step, num_heads=4, num_kv_heads=2, scale=32**-0.5)
    torch.testing.assert_close(out.view(t, 4, 32).double(), expected, atol=1e-5, rtol=1e-5)


def test_attention_layer_applies_a_pending_rotary_unless_the_impl_fuses_it():
    """``Attention(q, k, v, rotary=...)`` is ``Attention(*rotary(q, k), v)``: applied by the layer
    for an impl without ``fuses_rotary`` (cpu_paged), handed to one that declares it, except where
    no fused kernel computes it (Gemma's q/k norms) or there is no metadata (profiling run)."""
    from pagedlm.core.layers import GemmaRMSNorm, RMSNorm
    from pagedlm.core.layers.rotary import PendingRotary, RotaryEmbedding, _default_inv_freq

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    backend = get_attn_backend_cls(config)

    class FusingImpl(backend.get_impl_cls()):
        fuses_rotary = True
        received: list = []

        def forward(self, query, key, value, kv_cache, metadata, rotary=None):
            type(self).received.append(rotary)
            if metadata is None:  # a profiling run (cpu_paged itself is never given one)
                return torch.zeros_like(query)
            if rotary is not None:
                t = query.shape[0]
                q, k = rotary.apply(query.reshape(t, -1), key.reshape(t, -1))
                query, key = q.view(query.shape), k.view(key.shape)
            return super().forward(query, key, value, kv_cache, metadata)

    class FusingBackend(backend):
        @staticmethod
        def get_impl_cls():
            return FusingImpl

    step = make_step(MIXED_BATCH, block_size=16, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32)
    t = step.common.num_actual_tokens
    q, k, v = (x.reshape(t, -1) for x in (step.query, step.key, step.value))
    rope = RotaryEmbedding(32, 32, 128, _default_inv_freq(10000.0, 32))
    positions = torch.randint(0, 128, (t,), generator=torch.Generator().manual_seed(1))
    metadata = CpuAttentionMetadataBuilder(block_size=16, device=torch.device("cpu")).build(step.common)
    q_norm, k_norm = RMSNorm(32, eps=1e-6), RMSNorm(32, eps=1e-6)
    q_norm.weight.data.normal_(1.0, 0.2)
    k_norm.weight.data.normal_(1.0, 0.2)

    def run(attn_backend, prefix, query, key, pending=None, meta=metadata):
        with set_current_vllm_config(config, attn_backend):
            layer = Attention(4, 32, 32**-0.5, 2, prefix=prefix)
        layer.kv_cache = step.kv_cache.clone()
        with set_forward_context(meta):
            return layer(query, key, v, rotary=pending)

    for norms in [(None, None), (q_norm, k_norm)]:
        pending = rope.pending(positions, *norms)
        assert isinstance(pending, PendingRotary) and pending.fusable
        rq, rk = pending.apply(q, k)
        assert not torch.equal(rq, q)
        expected = run(backend, "rotated", rq, rk)
        torch.testing.assert_close(run(backend, "cpu", q, k, pending), expected, atol=0, rtol=0)
        FusingImpl.received.clear()
        torch.testing.assert_close(run(FusingBackend, "fused", q, k, pending), expected, atol=0, rtol=0)
        assert FusingImpl.received == [pending]

    gemma = rope.pending(positions, GemmaRMSNorm(32, eps=1e-6), GemmaRMSNorm(32, eps=1e-6))
    assert not gemma.fusable
    FusingImpl.received.clear()
    run(FusingBackend, "gemma", q, k, gemma)
    run(FusingBackend, "profiling", q, k, rope.pending(positions), meta=None)
    assert FusingImpl.received == [None, None]


def test_sdpa_without_enable_gqa(monkeypatch):
    """On torch < 2.5 (no ``enable_gqa``) K/V are repeated per query head instead."""
    monkeypatch.setattr(cpu_attention, "_SDPA_HAS_GQA", False)
    step = make_step(MIXED_BATCH, block_size=16, num_heads=8, num_kv_heads=2, head_size=32, dtype=torch.float32)
    check(step, make_impl(8, 2, 32), 16, torch.float32)


def test_a_step_of_decodes_builds_the_general_groups_index_tensors():
    """The decode-only shortcut of the builder gives what the general grouping gives."""
    step = make_step([(5, 1), (17, 1), (0, 1), (33, 1)], block_size=4, num_heads=2, num_kv_heads=1, head_size=32,
                     dtype=torch.float32)
    builder = CpuAttentionMetadataBuilder(block_size=4, device=torch.device("cpu"))
    (fast,) = builder.build(step.common).groups
    common = step.common
    lens = common.query_start_loc_cpu[1:].long() - common.query_start_loc_cpu[:-1].long()
    general = builder._build_group(common, torch.arange(4), lens, common.seq_lens_cpu.long())
    for name in ("query_index", "out_index", "query_pos", "context_slots"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.query_valid is None and general.query_valid is None
