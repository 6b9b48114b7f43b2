"""The CUDA backend's quantized GEMMs against core's torch references (the op contracts).

Runs on a GPU, or on the CPU under Triton's interpreter: ``TRITON_INTERPRET=1 pytest
tests/cuda/test_quant_kernels.py`` (the FP8 / INT8 ops use torch's ``_scaled_mm`` / ``_int_mm``,
which the CPU build of torch also has).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedlm.core.layers.quantization.utils import (
    fp8_scaled_mm_ref,
    int8_scaled_mm_ref,
    pack_rows,
    wna16_gemm_ref,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]

SHAPES = [(1, 64, 128), (5, 128, 256), (33, 96, 128)] if INTERPRET else [(1, 4096, 4096), (7, 1024, 4096),
                                                                          (64, 4096, 1024), (300, 2048, 4096)]
#: the matrix-vector kernel (M <= 4; split K and reduced in the same launch, K not a multiple of a
#: split, N not a multiple of a tile), and the split-K tensor-core kernel (M <= 16)
SMALL_M_SHAPES = ([(1, 64, 640), (2, 96, 512), (3, 200, 384), (4, 64, 256), (16, 128, 256)] if INTERPRET
                  else [(2, 6144, 4096), (3, 4096, 14336), (4, 28672, 4096), (16, 4096, 4096), (1, 200, 1152)])


def _wna16_inputs(m, n, k, bits, group, zeros, act_order, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), generator=gen, dtype=torch.int32)
    groups = k // group
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 1 << bits, (groups, n), generator=gen, dtype=torch.int32) if zeros else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    t = [pack_rows(q, bits), scales, z, g_idx]
    return x.to(device), *[None if a is None else a.to(device) for a in t]


def _check_wna16(bits, group, zeros, act_order, m, n, k, device, dtype=None):
    from pagedlm.backends.cuda.kernels.quant_gemm import wna16_gemm, wna16_repack

    dtype = dtype or (torch.float32 if INTERPRET else torch.bfloat16)
    g = k if group == -1 else group
    x, qw, s, z, g_idx = _wna16_inputs(m, n, k, bits, g, zeros, act_order, dtype, device)
    # the op reads the weights as the platform's wna16_repack left them (API 1.11)
    out = wna16_gemm(x, wna16_repack(qw, s, z, g_idx, bits, g), s, z, g_idx, bits, g)
    ref = wna16_gemm_ref(x.float(), qw, s.float(), z, g_idx, bits, g)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("zeros, act_order", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_wna16_gemm_matches_dequantize_then_matmul(bits, group, zeros, act_order, m, n, k, device):
    _check_wna16(bits, group, zeros, act_order, m, n, k, device)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("zeros, act_order", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m, n, k", SMALL_M_SHAPES)
def test_wna16_decode_kernels_match_dequantize_then_matmul(bits, group, zeros, act_order, m, n, k, device):
    _check_wna16(bits, group, zeros, act_order, m, n, k, device)


#: the tensor-core GEMV's layout read by the Triton GEMM (rows past the GEMV's 8, or activations in
#: another dtype than the scales): K blocks of 64, 16-row tiles, a partial last GEMM tile
MMA_LAYOUT_SHAPES = [(9, 48, 128), (3, 32, 256)] if INTERPRET else [(9, 4096, 4096), (64, 6144, 4096),
                                                                    (300, 1040, 1024)]


@pytest.mark.parametrize("group, zeros", [(64, False), (128, True), (-1, False)])
@pytest.mark.parametrize("m, n, k", MMA_LAYOUT_SHAPES)
def test_wna16_triton_gemm_reads_the_mma_layout(group, zeros, m, n, k, device):
    from pagedlm.backends.cuda.kernels.quant_gemm import wna16_triton_gemm
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack

    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = k if group == -1 else group
    x, qw, s, z, _ = _wna16_inputs(m, n, k, 4, g, zeros, False, dtype, device)
    out = wna16_triton_gemm(x, mma_repack(qw), s, z, None, 4, g, mma_layout=True)
    ref = wna16_gemm_ref(x.float(), qw, s.float(), z, None, 4, g)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("bits, zeros, act_order", [(4, False, False), (4, True, False), (4, False, True),
                                                    (8, True, False)])
@pytest.mark.parametrize("m, n, k", [(1, 64, 1024), (1, 64, 640), (3, 96, 640)] if INTERPRET
                         else [(1, 4096, 4096), (1, 6144, 4224), (3, 4096, 14336)])
def test_wna16_gemv_variants_match_dequantize_then_matmul(prefetch, bits, zeros, act_order, m, n, k, device):
    """The GEMV with and without the next step's loads in registers, on shapes that tile evenly
    (no masks) and that do not (a step past K, rows past M). The activations and the words are
    views of larger buffers with random values after them, so an unmasked read past K counts."""
    from pagedlm.backends.cuda.kernels.wna16_gemv import wna16_gemv

    dtype = torch.float32 if INTERPRET else torch.bfloat16
    x, qw, s, z, g_idx = _wna16_inputs(m, n, k, bits, 128, zeros, act_order, dtype, device)
    x_buf = torch.randn(m * k + 4096, dtype=dtype, device=device)
    x_buf[:m * k] = x.flatten()
    qw_buf = torch.randint(-2**31, 2**31 - 1, (qw.shape[0] + 64, n), dtype=torch.int32, device=device)
    qw_buf[:qw.shape[0]] = qw
    x, qw = x_buf[:m * k].view(m, k), qw_buf[:qw.shape[0]]
    out = wna16_gemv(x, qw, s, z, g_idx, bits, 128, prefetch=prefetch)
    ref = wna16_gemm_ref(x.float(), qw, s.float(), z, g_idx, bits, 128)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wna16_gemv_in_half_precision(dtype, device):
    # bf16 / fp16 activations and scales (under the interpreter too: the GEMV has no tl.dot)
    _check_wna16(4, 128, True, False, 1, 128, 512, device, dtype=dtype)


def test_wna16_rows_1_to_300_and_split_k_counters_stay_zero(device):
    """Every row count takes the kernel its size selects (GEMV, split-K dot, plain dot) and gives
    the reference's result; every split-K launch leaves its tile counters at zero for the next."""
    from pagedlm.backends.cuda.kernels import wna16_gemv

    rows = [1, 2, 3, 4, 5, 9, 16, 17, 300] if INTERPRET else list(range(1, 33)) + [63, 64, 65, 128, 255, 256, 300]
    n, k = (64, 256) if INTERPRET else (2048, 4096)
    for m in rows:
        _check_wna16(4, 128, True, False, m, n, k, device)
    counters = wna16_gemv._counters.get(device if device.type == "cpu" else torch.device("cuda", device.index or 0))
    assert counters is not None and int(counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_fp8_scaled_mm_matches_reference(static, m, n, k, dtype, device):
    """bf16 within bf16 rounding; float32 (the HF-parity configuration) without a bf16 output
    rounding: within the FP8 tensor cores' accumulation on a GPU (Hopper's FP8 MMAs keep fewer
    bits than float32 between cuBLASLt's promotions: 1.6e-5 of the range at 300 x 2048 x 4096,
    H100, 2026-12-06; the bound is 1e-4)."""
    from pagedlm.backends.cuda.kernels.quant_gemm import fp8_scaled_mm

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(torch.float8_e4m3fn).to(device)
    ws = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(device)
    xs = (x.float().abs().amax() / 448).reshape(1) if static else None
    bias = torch.randn(n, generator=gen).to(dtype).to(device)
    out = fp8_scaled_mm(x, w, ws, xs, bias)
    # on the CPU, as for int8: the op's IEEE division (a GPU's torch divides by the scale through
    # its reciprocal; against a reference on the GPU, 3 of 614,400 values of the float32 case
    # were out of bounds on an H200, 2026-12-06)
    ref = fp8_scaled_mm_ref(*(t.cpu() if t is not None else None for t in (x, w, ws, xs, bias)))
    assert out.dtype == dtype
    # (the interpreter's float8 cast rounds some values wrongly, so it keeps the looser bound)
    tol = 1e-4 if dtype == torch.float32 and not INTERPRET else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


#: (M, N, K) of the Triton row-wise FP8 GEMM: rows and columns that fill no whole tile, K that
#: does not tile (K % 128 = 32 and 16: the masked loop), one row, a down projection's K, and
#: shapes whose few tiles split K (the interpreter's "GPU" has 4 SMs: 1040 = 4 splits of 288,
#: the last one masked)
ROWWISE_SHAPES = ([(1, 64, 128), (37, 96, 160), (100, 200, 256), (5, 32, 1040)] if INTERPRET
                  else [(1, 4096, 4096), (77, 6144, 4096), (256, 4096, 14336), (200, 1000, 4112), (256, 4096, 4096)])
#: tiles beside the table's: one that tiles nothing evenly, and split ones (cuBLASLt's tile size)
ROWWISE_EXTRA_TILES = ([(16, 32, 32, 2, 2, 2, 1), (16, 32, 32, 2, 2, 2, 4)] if INTERPRET
                       else [(16, 32, 32, 2, 2, 2, 1), (128, 128, 128, 8, 8, 3, 4), (64, 128, 128, 8, 4, 4, 4)])


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m, n, k", ROWWISE_SHAPES)
def test_fp8_rowwise_mm_matches_reference_for_every_tile_shape(m, n, k, with_bias, device):
    """The Triton FP8 GEMM with each tile shape of its table (and one that tiles nothing evenly)
    against float32 products of the same FP8 values: within bf16 rounding plus the FP8 tensor
    cores' accumulation between promotions; split along K or not, the same values (partials are
    float32), and the split-K counters left zero for the next launch."""
    from pagedlm.backends.cuda.kernels.fp8_gemm import ROWWISE_TILES, fp8_rowwise_mm, num_sms, product_split
    from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters
    from pagedlm.core.layers.quantization.utils import quantize_fp8_per_token

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(torch.bfloat16)
    x_q, x_scale = quantize_fp8_per_token(x, None)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    ws = torch.rand(n, generator=gen) * 0.01 + 0.001
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    ref = (x_q.float() @ w.float().t()) * x_scale * ws.reshape(1, -1)
    if bias is not None:
        ref = ref + bias.float()
    tol = 1e-2
    splits = set()
    for tiles in [*(t for t in ROWWISE_TILES.values() if t), *ROWWISE_EXTRA_TILES]:
        out = fp8_rowwise_mm(x_q.to(device), x_scale.to(device), w.to(device), ws.to(device),
                             None if bias is None else bias.to(device), torch.bfloat16, tiles)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n), tiles
        torch.testing.assert_close(out.float().cpu(), ref, atol=tol * ref.abs().max().item(), rtol=tol,
                                   msg=lambda text, t=tiles: f"tiles {t}: {text}")
        splits.add(product_split(m, n, k, tiles, num_sms(torch.device(device))))
    if (m, n) in ((5, 32), (256, 4096)):
        assert max(splits) > 1, "no tile shape split K"
        assert not split_k_counters(torch.device(device), 1).any()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m, k", [(1, 128), (7, 4100), (300, 96)] if INTERPRET
                         else [(1, 4096), (7, 14336), (300, 4100)])
def test_quantize_rows_matches_core_reference(dtype, static, m, k, device):
    """One launch per token row: the scale bit for bit, the values as core's reference on the CPU
    (the op's definition: IEEE division; torch on a GPU divides by a scalar through its
    reciprocal, which moves int8 scales by an ulp and a row's -127.5-step extreme off -128)."""
    from pagedlm.backends.cuda.kernels.quant_act import quantize_rows
    from pagedlm.core.layers.quantization.utils import quantize_fp8_per_token, quantize_int8_per_token

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(torch.bfloat16)
    x[0, :3] = torch.tensor([0.0, -1e4, 1e-3])  # an outlier that sets row 0's scale
    x = x.to(device)
    divisor = 448.0 if dtype == torch.float8_e4m3fn else 127.5
    xs = (x.float().abs().amax() / divisor).reshape(1) if static else None
    ref_fn = quantize_fp8_per_token if dtype == torch.float8_e4m3fn else quantize_int8_per_token
    ref_q, ref_scale = ref_fn(x.cpu(), None if xs is None else xs.cpu())
    got_q, got_scale = quantize_rows(x, dtype, xs, rows=m + 3)
    assert got_q.shape == (m + 3, k) and got_q.dtype == dtype and got_scale.shape == (m, 1)
    assert torch.equal(got_scale.cpu(), ref_scale.expand(m, 1).cpu())
    if INTERPRET and dtype == torch.float8_e4m3fn:
        # the interpreter's float8 cast (numpy) is off for many values below 1 (0.49 -> 0.25);
        # the GPU run checks every byte, the interpreter the scales and the int8 values
        return
    assert torch.equal(got_q[:m].cpu().view(torch.uint8), ref_q.cpu().view(torch.uint8))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_int8_scaled_mm_matches_reference(static, m, n, k, device):
    from pagedlm.backends.cuda.kernels.quant_gemm import int8_scaled_mm

    gen = torch.Generator().manual_seed(2)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
    ws = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(device)
    xs = (x.float().abs().amax() / 127.5).reshape(1) if static else None
    bias = torch.randn(n, generator=gen).to(dtype).to(device) if static else None
    out = int8_scaled_mm(x, w, ws, xs, bias)
    ref = int8_scaled_mm_ref(*(t.cpu() if t is not None else None for t in (x, w, ws, xs, bias)))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, n, k, block", [(1, 256, 384, (128, 128)), (37, 320, 256, (64, 128)),
                                            (200, 256, 300, (128, 128)), (5, 192, 256, (64, 64))])
def test_fp8_block_scaled_mm_matches_reference(m, n, k, block, dtype, device):
    """Block-wise FP8: the group quantization's scales bit for bit and its values as core's
    reference, the GEMM within the FP8 tensor cores' accumulation error (K and N not multiples of
    a block included: the last block is partial, as ceil-sized scales say)."""
    from pagedlm.backends.cuda.kernels.fp8_block import fp8_block_scaled_mm, quantize_row_groups
    from pagedlm.core.layers.quantization.utils import (
        fp8_block_dequantize,
        fp8_block_scaled_mm_ref,
        quantize_fp8_per_group,
    )

    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    bn, bk = block
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10).to(dtype)
    x[0, :2] = torch.tensor([300.0, -1e-3])  # one loud group in row 0
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # past 448: NaN
    ws = torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 1e-3 + 1e-4
    bias = torch.randn(n, generator=gen).to(dtype)
    ref_q, ref_scale = quantize_fp8_per_group(x, bk)
    got_q, got_scale = quantize_row_groups(x.to(device), bk)
    assert torch.equal(got_scale.cpu(), ref_scale)
    out = fp8_block_scaled_mm(x.to(device), w.to(device), ws.to(device), bn, bk, bias.to(device))
    assert out.dtype == dtype and out.shape == (m, n)
    if INTERPRET:
        # the interpreter's float8 cast (numpy) is off for many values: the GEMM is checked on the
        # values the group quantization made there, the GPU run checks every byte of those
        x_dq = got_q.float() * got_scale.repeat_interleave(bk, 1)[:, :k]
        ref = (x_dq @ fp8_block_dequantize(w, ws, bn, bk).t() + bias.float()).to(dtype)
    else:
        assert torch.equal(got_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
        ref = fp8_block_scaled_mm_ref(x, w, ws, bn, bk, bias)
    # NOTE: Hopper's FP8 MMAs (wgmma, 64+ rows) accumulate within an instruction with fewer bits
    # than float32: 5-6e-5 of the output's range on an H100 (2026-12-06), 2e-7 at one row (mma.sync)
    tol = (1e-5 if INTERPRET else 2e-4) if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol * ref.float().abs().max().item(), rtol=tol)


def test_quantized_ops_are_registered_for_cuda():
    from pagedlm.core.plugins import get_plugins

    ops = {(s.op_name, s.platform): s.function_path for s in get_plugins().ops()}
    for op in ("wna16_gemm", "wna16_repack", "fp8_scaled_mm", "int8_scaled_mm"):
        assert ops[(op, "cuda")] == f"pagedlm.backends.cuda.kernels.quant_gemm:{op}"
    assert ops[("fp8_block_scaled_mm", "cuda")] == "pagedlm.backends.cuda.kernels.fp8_block:fp8_block_scaled_mm"


def test_write_kv_fp8_matches_the_cpu_backend(device):
    from pagedlm.backends.cpu.attention import CpuPagedAttentionImpl
    from pagedlm.backends.cuda.kernels.kv_cache_fp8 import write_kv_fp8

    gen = torch.Generator().manual_seed(3)
    t, hkv, d, slots = 6, 2, 32, 40
    key, value = torch.randn(t, hkv, d, generator=gen) * 30, torch.randn(t, hkv, d, generator=gen)
    slot_mapping = torch.tensor([3, 7, -1, 0, 39, 12])
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([2.0])
    ref_k = torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn)
    ref_v = torch.zeros_like(ref_k)
    impl = CpuPagedAttentionImpl(num_heads=4, head_size=d, scale=1.0, num_kv_heads=hkv)
    impl.k_scale, impl.v_scale = k_scale, v_scale
    impl._write_kv(key, value, ref_k, ref_v, slot_mapping)
    kc = torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn, device=device)
    vc = torch.zeros_like(kc)
    write_kv_fp8(key.to(device), value.to(device), kc, vc, slot_mapping.to(device), k_scale.to(device),
                 v_scale.to(device))
    if INTERPRET:
        # the interpreter's float8 cast (numpy) differs from the GPU's round-to-nearest-even on a few
        # values (0.2% here); the GPU run checks every byte
        for got, ref in ((kc, ref_k), (vc, ref_v)):
            same = (got.cpu().view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
            assert same > 0.99, same
    else:
        assert torch.equal(kc.cpu().view(torch.uint8), ref_k.view(torch.uint8))
        assert torch.equal(vc.cpu().view(torch.uint8), ref_v.view(torch.uint8))
