"""The W4A16 tensor-core GEMV (CUDA C++ through NVRTC) against dequantize-then-matmul, on a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core.layers.quantization.utils import pack_rows, wna16_gemm_ref

pytestmark = [pytest.mark.cuda]

#: Llama-3.1-8B's decode products (q/k/v, o, gate/up, down), a split-free one, a small one
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 512), (48, 256)]


def _inputs(m, n, k, group, zeros, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32) if zeros else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    return [None if t is None else t.cuda() for t in (x, pack_rows(q, 4), scales, z)]


def _check(m, n, k, group, zeros, dtype, **tuning):
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack, w4a16_mma_gemv

    g = k if group == -1 else group
    x, qw, s, z = _inputs(m, n, k, g, zeros, dtype)
    out = w4a16_mma_gemv(x, mma_repack(qw), s, z, g, **tuning)
    ref = wna16_gemm_ref(x.float(), qw, s.float(), z, None, 4, g)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    return out


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("group, zeros", [(128, False), (128, True), (64, False), (256, True), (-1, False)])
@pytest.mark.parametrize("n, k", SHAPES)
def test_mma_gemv_matches_dequantize_then_matmul(m, n, k, group, zeros, device):
    _check(m, n, k, group, zeros, torch.bfloat16)


@pytest.mark.parametrize("tuning", [dict(bulk=True), dict(bulk=True, stages=1), dict(bulk=True, stages=8),
                                    dict(bulk=True, warps=1, stages=2)])
@pytest.mark.parametrize("m, group, zeros", [(1, 128, False), (5, 128, True), (8, -1, False)])
def test_mma_gemv_with_bulk_copies(m, group, zeros, tuning, device):
    """The bulk-copy variant (``PAGEDLM_CUDA_W4A16_BULK``, sm_90+): the same results at every ring
    depth, with group ends at fixed slots and counted."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("bulk copies are sm_90 instructions")
    for n, k in [(4096, 14336), (48, 256), (6144, 4096)]:
        _check(m, n, k, group, zeros, torch.bfloat16, **tuning)


@pytest.mark.parametrize("m", [9, 20, 32])
def test_mma_gemv_takes_more_rows_a_launch_per_eight(m, device):
    """Past 8 rows the GEMV runs once per 8 rows (the last chunk partial) into one output."""
    out = _check(m, 4096, 14336, 128, True, torch.bfloat16)
    assert out.is_contiguous()


@pytest.mark.parametrize("zeros", [False, True])
def test_mma_gemv_in_float16(zeros, device):
    _check(3, 4096, 4096, 128, zeros, torch.float16)


@pytest.mark.parametrize("tuning", [dict(warps=1, stages=2), dict(warps=2, warps_per_sm=2), dict(stages=1),
                                    dict(warps=8, warps_per_sm=256), dict(stages=8)])
def test_mma_gemv_configs(tuning, device):
    """Blocks of one warp, long slices (a split of one), one block in flight (group ends counted at
    run time), one K block a warp (and slices past K), 8 blocks in flight (a ring of 4 groups'
    scales): the same results."""
    _check(2, 4096, 14336, 128, True, torch.bfloat16, **tuning)


def test_mma_gemv_is_deterministic_and_reads_unaligned_rows(device):
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack, w4a16_mma_gemv

    x, qw, s, _ = _inputs(4, 4096, 14336, 128, False, torch.bfloat16)
    qw = mma_repack(qw)
    first = w4a16_mma_gemv(x, qw, s, None, 128)
    assert torch.equal(first, w4a16_mma_gemv(x, qw, s, None, 128))
    buf = torch.empty(4 * 14336 + 1, dtype=torch.bfloat16, device="cuda")
    view = buf[1:].view(4, 14336)  # 2 bytes past a 16-byte boundary
    view.copy_(x)
    assert torch.equal(first, w4a16_mma_gemv(view, qw, s, None, 128))


def test_mma_gemv_replays_in_a_cuda_graph(device):
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack, w4a16_mma_gemv

    x, qw, s, z = _inputs(1, 4096, 14336, 128, True, torch.bfloat16)
    qw = mma_repack(qw)
    eager = w4a16_mma_gemv(x, qw, s, z, 128)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_out = w4a16_mma_gemv(static_x, qw, s, z, 128)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(static_out, w4a16_mma_gemv(static_x, qw, s, z, 128))
    static_x.copy_(x)
    graph.replay()
    assert torch.equal(static_out, eager)


def test_wna16_op_takes_the_mma_kernel_for_its_layout(device):
    """Through the ops (repack, then gemm) at 1 to 32 rows (the tensor-core GEMV, a launch per 8
    rows) and 33 to 300 rows (the same layout dequantized for cuBLAS)."""
    from pagedlm.backends.cuda.kernels.quant_gemm import wna16_gemm, wna16_repack

    x, qw, s, z = _inputs(300, 4096, 4096, 128, True, torch.bfloat16)
    packed = wna16_repack(qw, s, z, None, 4, 128)
    assert not torch.equal(packed, qw) and packed.shape == qw.shape
    ref = wna16_gemm_ref(x.float(), qw, s.float(), z, None, 4, 128)
    for m in (1, 8, 9, 20, 32, 33, 64, 300):
        out = wna16_gemm(x[:m], packed, s, z, None, 4, 128)
        torch.testing.assert_close(out.float(), ref[:m], atol=1e-2 * ref.abs().max().item(), rtol=1e-2)

