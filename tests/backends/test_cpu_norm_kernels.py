"""The CPU platform's norm and rotary kernels (kernels/norm_rope.c) against core's torch code:
bit for bit, on decode rows, prefill chunks (threaded), odd widths, strided views and both dtypes."""

from __future__ import annotations

import pytest
import torch

from pagedlm.backends.cpu.kernels import norm_ops
from pagedlm.core.testing.conformance import op_reference as ref

DTYPES = (torch.float32, torch.bfloat16)
WIDTHS = (3, 64, 100, 256, 640, 1000, 2048, 5120)


@pytest.fixture(autouse=True, scope="module")
def kernels_run():
    assert norm_ops.kernels_reproduce_torch(), "the C sum matched torch's at no width on this CPU"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", (1, 5, 300))
def test_norms_equal_torch_bit_for_bit(dtype, width, rows):
    gen = _gen(width * rows)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    r = torch.randn(rows, width, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(width, generator=gen)).to(dtype)
    assert torch.equal(norm_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert torch.equal(norm_ops.gemma_rms_norm(x, w - 1, 1e-6), ref.gemma_rms_norm(x, w - 1, 1e-6))
    for got, want in ((norm_ops.fused_add_rms_norm(x, r, w, 1e-5), ref.fused_add_rms_norm(x, r, w, 1e-5)),
                      (norm_ops.gemma_fused_add_rms_norm(x, r, w, 1e-6), ref.gemma_fused_add_rms_norm(x, r, w, 1e-6))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gemma_norm_takes_a_float32_weight_on_bf16_rows():
    gen = _gen(1)
    x = torch.randn(7, 640, generator=gen).to(torch.bfloat16)
    w = 0.3 * torch.randn(640, generator=gen)
    assert torch.equal(norm_ops.gemma_rms_norm(x, w, 1e-6), ref.gemma_rms_norm(x, w, 1e-6))


def test_strided_rows_and_head_views():
    gen = _gen(2)
    qkv = torch.randn(9, 1536, generator=gen) * 3
    w = torch.randn(256, generator=gen) * 0.2
    q = qkv[:, :1024]  # rows with a stride: the kernel reads them in place
    wide = torch.randn(1024, generator=gen)
    assert torch.equal(norm_ops.gemma_rms_norm(q, wide, 1e-6), ref.gemma_rms_norm(q, wide, 1e-6))
    assert torch.equal(norm_ops.rms_norm(q, wide, 1e-6), ref.rms_norm(q, wide, 1e-6))
    heads = q.reshape(9, 4, 256)  # [T, H, D] whose leading dimensions do not merge: torch's code runs
    assert torch.equal(norm_ops.gemma_rms_norm(heads, w, 1e-6), ref.gemma_rms_norm(heads, w, 1e-6))


def test_float16_and_mixed_weights_fall_back_to_torch():
    gen = _gen(3)
    x = torch.randn(4, 64, generator=gen).half()
    w = torch.randn(64, generator=gen).half()
    assert torch.equal(norm_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    xb, wf = x.bfloat16(), w.float()  # Llama's norm multiplies in the weight's dtype: torch promotes
    assert torch.equal(norm_ops.rms_norm(xb, wf, 1e-6), ref.rms_norm(xb, wf, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size,partial,neox", [(256, 1.0, True), (128, 0.5, True), (64, 1.0, False),
                                                    (128, 0.25, False)])
@pytest.mark.parametrize("tokens", (1, 13, 700))
def test_rotary_and_qk_norm_equal_torch_bit_for_bit(dtype, head_size, partial, neox, tokens):
    rotary_dim = int(head_size * partial)
    gen = _gen(tokens + head_size)
    cache = ref.cos_sin_cache(1e6, rotary_dim, 32768)
    pos = torch.randint(0, 32768, (tokens,), generator=gen)
    qkv = (torch.randn(tokens, 8 * head_size, generator=gen) * 3).to(dtype)
    q, k = qkv[:, : 4 * head_size], qkv[:, 4 * head_size : 6 * head_size]  # strided, as models pass them
    qw = (1 + 0.2 * torch.randn(head_size, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(head_size, generator=gen)).to(dtype)
    args = (cache, head_size, rotary_dim, neox)
    for got, want in ((norm_ops.rotary_embedding(pos, q, k, *args), ref.rotary_embedding(pos, q, k, *args)),
                      (norm_ops.qk_norm_rotary_embedding(pos, q, k, qw, kw, 1e-6, *args),
                       ref.qk_norm_rotary_embedding(pos, q, k, qw, kw, 1e-6, *args)),
                      (norm_ops.gemma_qk_norm_rotary_embedding(pos, q, k, qw - 1, kw - 1, 1e-6, *args),
                       ref.gemma_qk_norm_rotary_embedding(pos, q, k, qw - 1, kw - 1, 1e-6, *args))):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q_only, none = norm_ops.rotary_embedding(pos, q, None, *args)
    assert none is None and torch.equal(q_only, ref.rotary_embedding(pos, q, None, *args)[0])


def test_a_position_past_the_cache_is_an_index_error():
    cache = ref.cos_sin_cache(1e4, 64, 128)
    q = torch.randn(2, 128)
    with pytest.raises(IndexError, match=r"position is outside \[0, 128\)"):
        norm_ops.rotary_embedding(torch.tensor([3, 128]), q, q, cache, 64, 64, True)


def test_the_width_check_can_fail():
    # The C sum at another width differs from torch's in the last bits on most rows: the check
    # that picks the width is not vacuous.
    lib = norm_ops._lib()
    lanes = norm_ops.reduction_lanes(lib)
    other = 16 if lanes == 8 else 8
    rows = [torch.randn(640, generator=_gen(i)) for i in range(50)]
    differ = sum(lib.pagedlm_torch_order_sum(r.data_ptr(), 640, other) != r.sum().item() for r in rows)
    same = sum(lib.pagedlm_torch_order_sum(r.data_ptr(), 640, lanes) != r.sum().item() for r in rows)
    assert same == 0 and differ > 10
