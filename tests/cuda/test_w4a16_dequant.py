"""Mma-layout int4 weights dequantized into dense matrices for batches past the tensor-core GEMV
(``kernels/w4a16_dequant.py``), on a GPU or under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from pagedlm.core.layers.quantization.utils import pack_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]


@pytest.mark.parametrize("group, zeros", [(64, False), (128, True), (-1, False)])
@pytest.mark.parametrize("n, k", [(48, 256), (96, 640), (64, 64)])
def test_mma_dequantize_gives_each_value_where_a_dense_weight_has_it(n, k, group, zeros, device):
    """``mma_dequantize`` of mma-layout weights: ``(q - z) * s`` rounded once to the scales' dtype,
    at ``[n, k]`` (float16: the interpreter rounds to bfloat16 by truncation), whole and a row
    range; K of 1, 10 and 4 blocks of 64 (programs of 1, 2 and 4 blocks)."""
    from pagedlm.backends.cuda.kernels.w4a16_dequant import mma_dequantize
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack

    g = k if group == -1 or group > k else group
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // g, n, generator=gen) * 0.1 + 0.01).to(torch.float16)
    z = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.int32) if zeros else None
    zz = z if zeros else torch.full((k // g, n), 8, dtype=torch.int32)
    dense = ((q - zz.repeat_interleave(g, 0)).float() * s.float().repeat_interleave(g, 0)).half().t()
    packed = mma_repack(pack_rows(q, 4)).to(device)
    args = (s.to(device), None if z is None else z.to(device), g)
    assert torch.equal(mma_dequantize(packed, *args).cpu(), dense)
    assert torch.equal(mma_dequantize(packed, *args, 16, 32).cpu(), dense[16:48])


def test_the_dequantized_matmul_takes_the_weight_in_chunks(device, monkeypatch):
    """Past ``SCRATCH_BYTES`` the weight is dequantized and multiplied a column chunk at a time:
    the same product as in one piece."""
    from pagedlm.backends.cuda.kernels import w4a16_dequant
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack

    n, k = 80, 256
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // 128, n, generator=gen) * 0.1 + 0.01).to(torch.float16).to(device)
    x = torch.randn(12, k, generator=gen).to(torch.float16).to(device)
    packed = mma_repack(pack_rows(q, 4)).to(device)
    whole = w4a16_dequant.mma_dequantized_matmul(x, packed, s, None, 128)
    monkeypatch.setattr(w4a16_dequant, "SCRATCH_BYTES", 32 * k * 2)  # chunks of 32, 32 and 16 rows
    chunked = w4a16_dequant.mma_dequantized_matmul(x, packed, s, None, 128)
    assert chunked.shape == (12, n)
    torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=1e-3)
    ref = x.float() @ w4a16_dequant.mma_dequantize(packed, s, None, 128).float().t()
    torch.testing.assert_close(chunked.float(), ref, atol=1e-2, rtol=1e-2)
