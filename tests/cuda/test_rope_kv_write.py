"""The rotary embedding fused with the K/V-cache write (``layer_ops.rotary_embedding_write_kv``)
against the two kernels it replaces: the rotary op, then ``write_kv_cache`` or ``write_kv_fp8``.

Both sides are the same Triton code compiled for the same device, so the query and every cache
byte must be identical, padding slots and rows past the slot mapping untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]


def _caches(num_blocks, block, heads, head, dtype, device, fill):
    shape = (num_blocks, block, heads, head)
    return (torch.full(shape, fill, device=device).to(dtype), torch.full(shape, -fill, device=device).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fp8", [False, True], ids=["cache16", "fp8"])
@pytest.mark.parametrize(("head", "rot", "neox", "qk_norm"), [
    (64, 64, True, False), (64, 32, False, False), (128, 128, True, True), (64, 32, True, True),
])
def test_matches_rotary_then_write(device, dtype, fp8, head, rot, neox, qk_norm):
    from pagedlm.backends.cuda.kernels.kv_cache_fp8 import write_kv_fp8
    from pagedlm.backends.cuda.kernels.layer_ops import rotary_embedding, rotary_embedding_write_kv
    from pagedlm.backends.cuda.kernels.paged_attention import write_kv_cache
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    gen = torch.Generator().manual_seed(head + rot + 2 * neox + qk_norm)
    hq, hk, tokens, slots_len = 4, 2, 9, 7  # rows 7 and 8: graph padding past the slot mapping
    with torch.device(device):
        rope = RotaryEmbedding(head, rot, 512, _default_inv_freq(10000.0, rot), is_neox_style=neox)
    qkv = (torch.randn(tokens, (hq + 2 * hk) * head, generator=gen) * 3).to(device=device, dtype=dtype)
    q, k, v = qkv[:, : hq * head], qkv[:, hq * head : (hq + hk) * head], qkv[:, (hq + hk) * head :]
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(device)
    slots = torch.tensor([5, 17, -1, 0, 33, 2, -1], device=device)  # -1: padding, stores nothing
    assert slots.numel() == slots_len
    weights = tuple((1 + 0.2 * torch.randn(head, generator=gen)).to(device=device, dtype=dtype)
                    for _ in range(2)) if qk_norm else None
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    scales = (torch.tensor([0.5], device=device), torch.tensor([2.0], device=device)) if fp8 else None

    ref_kc, ref_vc = _caches(3, 16, hk, head, cache_dtype, device, 7.0)
    ref_q, ref_k = rotary_embedding(positions, q, k, rope.cos_sin_cache, head, rot, neox,
                                    qk_norm_weights=weights, eps=1e-6)
    k3, v3 = ref_k[:slots_len].view(slots_len, hk, head), v[:slots_len].view(slots_len, hk, head)
    if fp8:
        write_kv_fp8(k3, v3, ref_kc, ref_vc, slots, *scales)
    else:
        write_kv_cache(k3, v3, ref_kc, ref_vc, slots)

    kc, vc = _caches(3, 16, hk, head, cache_dtype, device, 7.0)
    out_q = rotary_embedding_write_kv(positions, q, k, v, rope.cos_sin_cache, head, rot, neox, kc, vc, slots,
                                      qk_norm_weights=weights, eps=1e-6, kv_scales=scales)
    assert out_q.shape == q.shape and out_q.is_contiguous()
    assert torch.equal(out_q, ref_q)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_vc.view(torch.uint8))
    # the slots written hold the rotated key, not the raw one; the rest still hold the fill
    written = slots[slots >= 0]
    flat_k = kc.view(-1, hk, head)
    assert not torch.equal(flat_k[written].float(), torch.full_like(flat_k[written].float(), 7.0))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[written] = False
    assert (flat_k[untouched].float() == 7.0).all()


def test_the_switch_turns_the_fusion_off_and_refuses_other_values(monkeypatch):
    from pagedlm.backends.cuda import triton_attn

    impl = triton_attn.TritonAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    for value, fused in [(None, True), ("1", True), ("0", False)]:
        triton_attn.rotary_fused_with_kv_write.cache_clear()
        if value is None:
            monkeypatch.delenv("PAGEDLM_CUDA_FUSED_ROTARY", raising=False)
        else:
            monkeypatch.setenv("PAGEDLM_CUDA_FUSED_ROTARY", value)
        assert impl.fuses_rotary is fused
    triton_attn.rotary_fused_with_kv_write.cache_clear()
    monkeypatch.setenv("PAGEDLM_CUDA_FUSED_ROTARY", "yes")
    with pytest.raises(ValueError, match=r"PAGEDLM_CUDA_FUSED_ROTARY='yes'.*allowed values are 1 .* and 0"):
        impl.fuses_rotary  # noqa: B018
    triton_attn.rotary_fused_with_kv_write.cache_clear()
