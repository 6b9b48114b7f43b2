"""The CUDA backend's norms and SiLU-and-mul fused with FP8 quantization (kernels/norm_quant.py)
against the unfused kernels followed by the quantization: the same scales and bytes.

The op contracts define the fused result as core's ``quantize_fp8_per_token`` of the platform's
unfused op (layer_ops' kernels, which test_layer_ops.py checks against core's torch layers), so
that is the reference: bit for bit. Runs on a GPU, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), where the float8 cast is numpy's (off for some values below 1), so the
bytes are compared with core's quantization on the GPU only; against the interpreted unfused
kernels, which cast alike, they are compared everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedlm.core.layers.quantization.utils import quantize_fp8_per_token

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]

DTYPES = [torch.bfloat16, torch.float16]
ROWS = [1, 7, 40] if INTERPRET else [1, 7, 300]
HIDDEN = [64, 100] if INTERPRET else [4096, 4100]
#: intermediate sizes: held in registers (up to 16384 values, a ragged block included), and walked
#: twice in chunks of 4096 (16400: the last chunk ragged)
INTER = [48, 4100, 16400] if INTERPRET else [4100, 14336, 16400]


def _rows(t: int, n: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=gen) * (torch.rand(t, 1, generator=gen) * 8 + 0.01)
    x[0, :3] = torch.tensor([0.0, -60.0, 1e-3])  # an outlier that sets row 0's scale
    return x.to(dtype).to(device)


def _check(got: tuple[torch.Tensor, torch.Tensor], unfused_out: torch.Tensor) -> None:
    """``got`` is ``quantize_rows`` of the unfused output (bytes and scales), and core's
    quantization of it (scales; bytes on the GPU)."""
    from pagedlm.backends.cuda.kernels.quant_act import quantize_rows

    x_q, scale = got
    t, n = unfused_out.shape
    assert x_q.shape == (t, n) and x_q.dtype == torch.float8_e4m3fn
    assert scale.shape == (t, 1) and scale.dtype == torch.float32
    ref_q, ref_scale = quantize_rows(unfused_out, torch.float8_e4m3fn, None)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    core_q, core_scale = quantize_fp8_per_token(unfused_out.cpu())
    assert torch.equal(scale.cpu(), core_scale)
    if not INTERPRET:
        assert torch.equal(x_q.cpu().view(torch.uint8), core_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("t", ROWS)
def test_rms_norm_fp8_quant_is_the_unfused_norm_quantized(t, n, dtype, device):
    from pagedlm.backends.cuda.kernels.layer_ops import fused_add_rms_norm, rms_norm
    from pagedlm.backends.cuda.kernels.norm_quant import fused_add_rms_norm_fp8_quant, rms_norm_fp8_quant

    x, residual = _rows(t, n, dtype, device), _rows(t, n, dtype, device, seed=1)
    weight = (torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype).to(device)
    _check(rms_norm_fp8_quant(x, weight, 1e-5), rms_norm(x, weight, 1e-5))

    x_q, scale, summed = fused_add_rms_norm_fp8_quant(x, residual, weight, 1e-6)
    normed, ref_summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    _check((x_q, scale), normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp8_quant_reads_strided_rows(dtype, device):
    """Rows of a wider tensor (a column slice): the contract lets x's rows be strided."""
    from pagedlm.backends.cuda.kernels.layer_ops import rms_norm
    from pagedlm.backends.cuda.kernels.norm_quant import rms_norm_fp8_quant

    n = HIDDEN[1]
    wide = _rows(5, n + 16, dtype, device)
    x = wide[:, 8 : 8 + n]
    weight = torch.ones(n, dtype=dtype, device=device)
    _check(rms_norm_fp8_quant(x, weight, 1e-6), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("t", ROWS)
def test_silu_and_mul_fp8_quant_is_the_unfused_op_quantized(t, inter, dtype, device):
    from pagedlm.backends.cuda.kernels.layer_ops import silu_and_mul
    from pagedlm.backends.cuda.kernels.norm_quant import silu_and_mul_fp8_quant

    x = _rows(t, 2 * inter, dtype, device)
    _check(silu_and_mul_fp8_quant(x), silu_and_mul(x))


def test_no_rows(device):
    from pagedlm.backends.cuda.kernels.norm_quant import (
        fused_add_rms_norm_fp8_quant,
        rms_norm_fp8_quant,
        silu_and_mul_fp8_quant,
    )

    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    w = torch.ones(64, dtype=torch.bfloat16, device=device)
    assert rms_norm_fp8_quant(x, w, 1e-6)[0].shape == (0, 64)
    assert fused_add_rms_norm_fp8_quant(x, x, w, 1e-6)[2].shape == (0, 64)
    x_q, scale = silu_and_mul_fp8_quant(x)
    assert x_q.shape == (0, 32) and scale.shape == (0, 1)


def test_fused_ops_are_registered_for_cuda():
    from pagedlm.core.plugins import get_plugins

    ops = {(s.op_name, s.platform): s.function_path for s in get_plugins().ops()}
    for op in ("rms_norm_fp8_quant", "fused_add_rms_norm_fp8_quant", "silu_and_mul_fp8_quant"):
        assert ops[(op, "cuda")] == f"pagedlm.backends.cuda.kernels.norm_quant:{op}"
    assert ops[("fp8_quantized_mm", "cuda")] == "pagedlm.backends.cuda.kernels.quant_gemm:fp8_quantized_mm"


def test_fp8_linear_gives_the_same_output_from_a_quantized_input(device):
    """An FP8 linear layer built on the CUDA ops: its output from the fused norm's
    QuantizedActivation is bit for bit its output from the unfused norm's tensor."""
    from pagedlm.core.layers import RMSNorm, custom_ops
    from pagedlm.core.layers.quantization.schemes import W8A8LinearMethod
    from pagedlm.core.layers.quantization.utils import FP8_DTYPE

    dtype, n, out = torch.bfloat16, HIDDEN[0], 96
    with custom_ops.use_ops(custom_ops.registered_ops("cuda")):
        norm = RMSNorm(n, eps=1e-6).to(dtype).to(device)
        method = W8A8LinearMethod(kind="fp8", per_channel=True, static_input=False)
    assert method.accepts_fp8_activations
    gen = torch.Generator().manual_seed(5)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(out, n, generator=gen) * 8).to(FP8_DTYPE).to(device),
                                      requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.rand(out, generator=gen).to(device) * 1e-2, requires_grad=False)
    layer.input_scale = None
    bias = torch.randn(out, generator=gen).to(dtype).to(device)
    x, residual = _rows(7, n, dtype, device), _rows(7, n, dtype, device, seed=1)
    for rows in (1, 7):
        qa, _ = norm(x[:rows], residual[:rows], quant_fp8=True)
        expected = method.apply(layer, norm(x[:rows], residual[:rows])[0], bias)
        assert torch.equal(method.apply(layer, qa, bias), expected)
