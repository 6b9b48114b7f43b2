"""The Triton quantized ``fused_experts`` ops (FP8 experts, packed W4A16 / W8A16 experts) against
core's torch references (layers/fused_moe/quantized_reference.py).

On a GPU (marked ``cuda``) and, at small sizes, under Triton's interpreter
(``TRITON_INTERPRET=1 pytest tests/cuda/test_fused_moe_quant_kernel.py``). The packed-integer op
dequantizes to the dtype exactly as the reference does, so it agrees as the unquantized op does
(float32 to summation order). The FP8 op agrees to float32 summation order on the products, but
an activation that lands within that noise of an FP8 rounding boundary rounds the other way (a
step of 1/16 relative), so its outputs are compared with a tolerance of a few FP8 steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_fused_moe_kernel import make_inputs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (tokens, hidden, intermediate, experts, top_k): decode, more experts than tokens, top-8 of 16
SMALL = [(1, 64, 32, 4, 2), (13, 128, 64, 8, 3), (40, 64, 32, 16, 8)]
LARGE = [(64, 2048, 768, 128, 8), (512, 2048, 768, 128, 8), (7, 4096, 14336, 8, 2)]


def _fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> float8 weights with per-channel scales ``[E, N]``, one expert at a time
    (see :func:`_packed_experts`)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        expert = w[e].float()
        scale[e] = (expert.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
        q[e] = (expert / scale[e].unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q, scale


def _packed_experts(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """``w [E, N, K]`` -> ``(qweight [E, N, K / pack], scales [E, N, K / G], zeros | None)``.

    One expert at a time: each float32 or int32 copy of a whole model-sized ``w13`` (8 x 28672 x
    4096) is 3.5 GiB and several are alive at once; a worker held 28 GiB while 4 tests beside it
    ran out of GPU memory (8 xdist workers on an 80 GB H100, 2026-12-07)."""
    parts = [_packed_expert(w[e], bits, group, symmetric) for e in range(w.shape[0])]
    packed, scale, zero = (None if parts[0][i] is None else torch.stack([p[i] for p in parts]) for i in range(3))
    return packed, scale, zero


def _packed_expert(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    from pagedlm.core.layers.quantization.utils import pack_cols

    n, k = w.shape
    g = k if group == -1 else group
    grouped = w.float().reshape(n, k // g, g)
    qmax = (1 << bits) - 1
    if symmetric:
        scale = grouped.abs().amax(-1) / (qmax / 2)
        zero = torch.full_like(scale, 1 << (bits - 1)).to(torch.int32)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = (hi - lo) / qmax
        zero = torch.round(-lo / scale.clamp(min=1e-10)).clamp(0, qmax).to(torch.int32)
    scale = scale.clamp(min=1e-10)
    q = torch.round(grouped / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, qmax).to(torch.int32)
    return pack_cols(q.reshape(n, k), bits), scale.to(w.dtype), None if symmetric else zero


def _cpu(*tensors):
    return [None if t is None else t.cpu() for t in tensors]


def _close(out, want, dtype, fp8=False):
    out = out.cpu()
    assert out.shape == want.shape and out.dtype == want.dtype
    truncating = INTERPRET and dtype == torch.bfloat16  # the interpreter truncates float32 -> bf16
    if fp8:
        # a few FP8 steps (1/16 relative) of the output's scale, and most elements much closer
        err = (out.float() - want.float()).abs()
        scale = want.float().abs().amax()
        assert err.max() <= 0.08 * scale + 1e-3, (err.max(), scale)
        assert err.mean() <= (0.01 if truncating else 0.004) * scale + 1e-4, (err.mean(), scale)
    elif truncating:
        torch.testing.assert_close(out.float(), want.float(), atol=0.2, rtol=0.05)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), want.float(), atol=16 * eps, rtol=8 * eps)


def _check_fp8(shape, dtype, device, expert_map=None):
    from pagedlm.backends.cuda.kernels.fused_moe_quant import fused_experts_fp8
    from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_fp8 as reference

    x, w13, w2, weights, ids = make_inputs(*shape, dtype, device)
    if expert_map is not None:
        expert_map = expert_map.to(device)
        local = int((expert_map >= 0).sum())
        w13, w2 = w13[-local:].contiguous(), w2[-local:].contiguous()
    q13, s13 = _fp8_experts(w13)
    q2, s2 = _fp8_experts(w2)
    args = (x, q13, q2, s13, s2, weights, ids, expert_map)
    _close(fused_experts_fp8(*args), reference(*_cpu(*args)), dtype, fp8=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=str)
def test_fp8_matches_reference(device, shape, dtype):
    _check_fp8(shape, dtype, device)


def test_fp8_leaves_other_ranks_experts_out(device):
    _check_fp8((11, 64, 32, 8, 2), torch.bfloat16, device,
               expert_map=torch.tensor([-1] * 4 + list(range(4)), dtype=torch.int32))


def _check_wna16(shape, dtype, device, bits, group, symmetric, expert_map=None, config=None):
    from pagedlm.backends.cuda.kernels.fused_moe_quant import fused_experts_wna16
    from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_wna16 as reference

    x, w13, w2, weights, ids = make_inputs(*shape, dtype, device)
    if expert_map is not None:
        expert_map = expert_map.to(device)
        local = int((expert_map >= 0).sum())
        w13, w2 = w13[-local:].contiguous(), w2[-local:].contiguous()
    p13, s13, z13 = _packed_experts(w13, bits, group, symmetric)
    p2, s2, z2 = _packed_experts(w2, bits, group, symmetric)
    args = (x, p13, p2, s13, s2, z13, z2, weights, ids, expert_map)
    out = fused_experts_wna16(*args, bits, group, config=config)
    _close(out, reference(*_cpu(*args), bits, group), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SMALL, ids=str)
def test_wna16_matches_reference(device, shape, dtype):
    _check_wna16(shape, dtype, device, bits=4, group=32, symmetric=True)


@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 32, False), (8, -1, True), (8, 16, False),
                                                          (4, -1, False)])
def test_wna16_bits_groups_and_zero_points(device, bits, group, symmetric):
    _check_wna16((9, 64, 96, 8, 2), torch.float32, device, bits, group, symmetric)


def test_wna16_leaves_other_ranks_experts_out_and_any_block_gives_the_same(device):
    expert_map = torch.tensor(list(range(4)) + [-1] * 4, dtype=torch.int32)
    _check_wna16((11, 64, 32, 8, 2), torch.float32, device, 4, 32, False, expert_map=expert_map)
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 2}
    _check_wna16((21, 64, 64, 4, 2), torch.float32, device, 4, 32, True, config=config)


def test_layers_bind_the_registered_kernels(device):
    from pagedlm.backends.cuda.kernels import fused_moe_quant
    from pagedlm.core.layers import custom_ops
    from pagedlm.core.layers.quantization.moe_methods import CompressedTensorsWNA16MoEMethod, Fp8MoEMethod

    ops = custom_ops.registered_ops("cuda")
    with custom_ops.use_ops(ops):
        assert Fp8MoEMethod(online=True).op is fused_moe_quant.fused_experts_fp8
        assert CompressedTensorsWNA16MoEMethod(bits=4, group_size=128, symmetric=True).op is \
            fused_moe_quant.fused_experts_wna16


@pytest.mark.skipif(INTERPRET, reason="model-sized shapes: minutes in the interpreter")
@pytest.mark.parametrize("shape", LARGE, ids=str)
def test_model_sized_shapes(device, shape):
    _check_fp8(shape, torch.bfloat16, device)
    _check_wna16(shape, torch.bfloat16, device, bits=4, group=128, symmetric=True)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_capturable_in_a_cuda_graph(device):
    """No host synchronisation: both ops replay from a graph with new routing in place."""
    from pagedlm.backends.cuda.kernels.fused_moe_quant import fused_experts_fp8, fused_experts_wna16
    from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_fp8 as fp8_reference
    from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_wna16 as wna16_reference

    x, w13, w2, weights, ids = make_inputs(16, 256, 128, 16, 4, torch.bfloat16, device)
    q13, s13 = _fp8_experts(w13)
    q2, s2 = _fp8_experts(w2)
    p13, g13, _ = _packed_experts(w13, 4, 64, True)
    p2, g2, _ = _packed_experts(w2, 4, 64, True)

    def run():
        return (fused_experts_fp8(x, q13, q2, s13, s2, weights, ids),
                fused_experts_wna16(x, p13, p2, g13, g2, None, None, weights, ids, None, 4, 64))

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_out, int_out = run()
    x2, _, _, weights2, ids2 = make_inputs(16, 256, 128, 16, 4, torch.bfloat16, device, seed=9)
    for dst, src in ((x, x2), (weights, weights2), (ids, ids2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _close(fp8_out, fp8_reference(*_cpu(x, q13, q2, s13, s2, weights, ids)), torch.bfloat16, fp8=True)
    _close(int_out, wna16_reference(*_cpu(x, p13, p2, g13, g2, None, None, weights, ids, None), 4, 64),
           torch.bfloat16)
