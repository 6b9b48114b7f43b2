"""The Triton ``fused_experts`` op against core's torch reference (the op contract).

On a GPU (marked ``cuda``) and, at small sizes, on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1 pytest tests/cuda/test_fused_moe_kernel.py``). float32 must agree to
summation order (IEEE float32 dots, no TF32); bf16/fp16 up to an occasional one-ulp rounding flip of
an intermediate (the interpreter also truncates float32 -> bf16, so there only closeness is checked).
The full grid (1..4096 tokens, 8..128 experts, top-1..8, three dtypes) and the decode bandwidth
are packages/backend-cuda/benchmarks/bench_fused_moe.py's.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (tokens, hidden, intermediate, experts, top_k): one token (decode), widths that are not
# multiples of the blocks, more experts than tokens, top-8 of 16
SMALL = [(1, 64, 32, 4, 2), (13, 64, 48, 8, 3), (40, 32, 32, 16, 8), (70, 48, 24, 4, 1)]
# GPU only: Qwen3-30B-A3B's and Mixtral's expert shapes at decode and prefill token counts
LARGE = [(64, 2048, 768, 128, 8), (512, 2048, 768, 128, 8), (7, 4096, 14336, 8, 2), (1000, 1024, 512, 64, 6)]


def make_inputs(tokens, hidden, inter, experts, top_k, dtype, device, seed=0):
    from pagedlm.core.layers.fused_moe import fused_topk

    gen = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = fused_topk(x, torch.randn(tokens, experts, generator=gen), top_k, True)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


def reference(x, w13, w2, weights, ids, expert_map=None):
    from pagedlm.core.layers.fused_moe import fused_experts

    args = [t.cpu() for t in (x, w13, w2, weights, ids)]
    return fused_experts(*args, None if expert_map is None else expert_map.cpu())


def assert_matches(out, want, dtype, reduction_len=1024):
    """Close to the reference; bounds grow with the sqrt of the longest dot product (a different
    summation order differs by more, and flips more bf16 roundings, over longer sums)."""
    out = out.cpu()
    assert out.shape == want.shape and out.dtype == want.dtype
    grow = max(1.0, (reduction_len / 1024) ** 0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=2e-5 * grow, rtol=2e-5 * grow)
    elif INTERPRET and dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), want.float(), atol=0.2, rtol=0.05)  # truncating interpreter
    else:
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), want.float(), atol=16 * eps * grow, rtol=8 * eps * grow)
        assert (out != want).float().mean() < 0.05 * grow


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "T{}-H{}-I{}-E{}-top{}".format(*s))
def test_matches_reference(device, shape, dtype):
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts

    args = make_inputs(*shape, dtype, device)
    assert_matches(fused_experts(*args), reference(*args), dtype)


@pytest.mark.skipif(INTERPRET, reason="model-sized shapes: minutes in the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "T{}-H{}-I{}-E{}-top{}".format(*s))
def test_matches_reference_at_model_sizes(device, shape, dtype):
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts

    args = make_inputs(*shape, dtype, device)
    assert_matches(fused_experts(*args), reference(*args), dtype, reduction_len=max(shape[1], shape[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_expert_map_leaves_other_ranks_experts_out(device, dtype):
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts
    from pagedlm.core.layers.fused_moe import determine_expert_map

    x, w13, w2, weights, ids = make_inputs(29, 64, 32, 8, 2, dtype, device, seed=3)
    total = None
    for rank in range(2):
        local, expert_map = determine_expert_map(2, rank, 8)
        part = (w13[rank * local : (rank + 1) * local].contiguous(), w2[rank * local : (rank + 1) * local].contiguous())
        out = fused_experts(x, *part, weights, ids, expert_map.to(device))
        assert_matches(out, reference(x, *part, weights, ids, expert_map), dtype)
        total = out.float() if total is None else total + out.float()
    fp32 = dtype == torch.float32
    torch.testing.assert_close(total.cpu(), reference(x, w13, w2, weights, ids).float(),
                               atol=2e-5 if fp32 else 0.1, rtol=2e-5 if fp32 else 0.05)


@pytest.mark.parametrize("block", [(16, 32, 32, 1), (32, 64, 16, 4), (64, 16, 64, 8)])
def test_any_block_configuration_gives_the_same_result(device, block):
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts

    bm, bn, bk, group = block
    args = make_inputs(37, 48, 40, 8, 2, torch.float32, device, seed=5)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": 4, "num_stages": 2}
    assert_matches(fused_experts(*args, config=config), reference(*args), torch.float32)


def test_no_tokens(device):
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts

    x, w13, w2, weights, ids = make_inputs(1, 32, 16, 4, 2, torch.float32, device)
    out = fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)


def test_fused_moe_layer_binds_the_registered_kernel(device):
    """What a model built on the CUDA platform runs: the registered op inside ``FusedMoE``."""
    from pagedlm.backends.cuda.kernels import fused_moe
    from pagedlm.core.layers import custom_ops
    from pagedlm.core.layers.fused_moe import FusedMoE

    ops = custom_ops.registered_ops("cuda")
    assert ops["fused_experts"] is fused_moe.fused_experts
    with custom_ops.use_ops(ops), torch.device(device):
        layer = FusedMoE(8, 2, 64, 32, renormalize=False)
    with custom_ops.use_ops({}), torch.device(device):
        plain = FusedMoE(8, 2, 64, 32, renormalize=False)
    x, w13, w2, _, _ = make_inputs(9, 64, 32, 8, 2, torch.float32, device)
    for moe in (layer, plain):
        moe.w13_weight.data.copy_(w13)
        moe.w2_weight.data.copy_(w2)
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)).to(device)  # global RNG untouched
    assert layer._fused_experts_op is fused_moe.fused_experts and plain._fused_experts_op is None
    torch.testing.assert_close(layer(x, logits).cpu(), plain(x, logits).cpu(), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_capturable_in_a_cuda_graph(device):
    """No host synchronisation: the op replays from a graph with new routing in place."""
    from pagedlm.backends.cuda.kernels.fused_moe import fused_experts

    x, w13, w2, weights, ids = make_inputs(16, 256, 128, 16, 4, torch.bfloat16, device)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = make_inputs(16, 256, 128, 16, 4, torch.bfloat16, device, seed=9)
    for dst, src in ((x, x2), (weights, weights2), (ids, ids2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, reference(x, w13, w2, weights, ids), torch.bfloat16)
