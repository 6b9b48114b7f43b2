"""The ``unquantized_gemm`` op (``kernels/dense_gemv.py``): the decode GEMV against ``x.float() @
w.float().T (+ bias)`` for 1 to 4 rows, widths and depths that end inside a block, with and
without bias, bf16 and fp16, with and without split-K; the inputs it leaves to ``F.linear``; the
config table; a full-precision linear layer built with the op bound; and (GPU only) a CUDA-graph
replay. Runs under ``TRITON_INTERPRET=1`` too, on small shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.bfloat16, torch.float16]


def gemv():
    from pagedlm.backends.cuda.kernels import dense_gemv

    return dense_gemv


def inputs(device, t, n, k, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x.to(device), w.to(device), None if b is None else b.to(device)


def reference(x, w, b):
    out = x.float() @ w.float().T
    return out if b is None else out + b.float()


def assert_close_to_float32(out, x, w, b):
    """The float32 result rounded once to the dtype: within half a unit in the last place (a
    whole one in the interpreter, whose float32 -> bf16 cast truncates), plus float32 noise."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(out.float().cpu(), reference(x, w, b).cpu(), rtol=1.1 * eps, atol=1e-3)


def config(block_n, block_k, split_k, num_warps=4, num_stages=1):
    return gemv().GemvConfig(block_n, block_k, split_k, num_warps, num_stages)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [(16, 128, 1), (8, 128, 2), (32, 64, 4, 2, 2)], ids=["nosplit", "split2", "split4"])
def test_odd_shapes_against_float32(device, dtype, bias, t, cfg):
    """N = 77 (the last block of rows partly past N), K = 200 (the last step partly past K, and
    with splits a last split shorter than the others)."""
    x, w, b = inputs(device, t, 77, 200, dtype, bias, seed=t)
    out = gemv().unquantized_gemm(x, w, b, _config=config(*cfg))
    assert_close_to_float32(out, x, w, b)


@pytest.mark.parametrize("t", [1, 3] if INTERPRET else [1, 2, 3, 4])
@pytest.mark.parametrize("split_k", [1, 4])
def test_model_sized_rows(device, t, split_k):
    """N = 4096 + 8 (a last block of 8 rows), K = 4096 (whole steps: the unmasked loads)."""
    dtype = torch.bfloat16
    x, w, b = inputs(device, t, 4096 + 8, 4096, dtype, bias=t == 1, seed=10 + t)
    out = gemv().unquantized_gemm(x, w, b, _config=config(64, 1024, split_k, 8))
    assert_close_to_float32(out, x, w, b)


def test_split_k_is_deterministic_and_leaves_counters_zero(device):
    from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters

    x, w, b = inputs(device, 2, 300, 1024, torch.bfloat16, bias=True, seed=3)
    cfg = config(16, 128, 8)
    first = gemv().unquantized_gemm(x, w, b, _config=cfg)
    again = gemv().unquantized_gemm(x, w, b, _config=cfg)
    assert torch.equal(first, again)
    assert int(split_k_counters(x.device, 1).abs().sum()) == 0  # every launch resets its counters
    assert_close_to_float32(first, x, w, b)


@pytest.mark.parametrize("case", ["five_rows", "no_rows", "float32", "strided_weight", "mixed_dtypes", "strided_x",
                                  "short_bias", "not_in_table"])
def test_fallbacks_are_f_linear(device, case):
    t = {"five_rows": 5, "no_rows": 0}.get(case, 2)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x, w, b = inputs(device, t, 40, 64, dtype, bias=True, seed=4)
    if case == "strided_weight":
        w = w.t().contiguous().t()  # [N, K] with strides (1, N)
    if case == "mixed_dtypes":
        w = w.to(torch.float16)
    if case == "short_bias":
        b = b[:-1]  # F.linear raises; the kernel must not read past it
    if case == "strided_x":
        x = torch.cat([x, x], dim=1)[:, ::2]
    # every case but the last forces a config: the kernel must still refuse the inputs
    cfg = None if case == "not_in_table" else config(16, 64, 1)
    assert gemv().gemv_config(t, 40, 64) is None
    try:
        want = F.linear(x, w, b)
    except RuntimeError:  # mixed dtypes, a short bias: F.linear refuses them, so must the op
        with pytest.raises(RuntimeError):
            gemv().unquantized_gemm(x, w, b, _config=cfg)
        return
    assert torch.equal(gemv().unquantized_gemm(x, w, b, _config=cfg), want)


def test_config_table():
    g = gemv()
    qkv = g.gemv_config(1, 6144, 4096)
    assert qkv is not None and qkv == g.DEFAULT_CONFIGS[(6144, 4096)][1]
    assert g.gemv_config(3, 6144, 4096) == g.DEFAULT_CONFIGS[(6144, 4096)].get(4)  # 3 rows: the 4-row entry
    assert g.gemv_config(5, 6144, 4096) is None and g.gemv_config(0, 6144, 4096) is None
    assert g.gemv_config(1, 77, 200) is None
    # gate_up takes the kernel only with PDL; the other shapes the same either way
    assert g.gemv_config(1, 28672, 4096) is None
    assert g.gemv_config(1, 28672, 4096, pdl=True) == g.PDL_CONFIGS[(28672, 4096)][1]
    assert g.gemv_config(1, 6144, 4096, pdl=True) == qkv
    for entry in [*g.DEFAULT_CONFIGS.values(), *g.PDL_CONFIGS.values()]:
        assert set(entry) <= {1, 2, 4}
        for cfg in entry.values():
            assert cfg is None or (isinstance(cfg, g.GemvConfig) and cfg.block_k % 64 == 0)


def test_registered_for_cuda():
    from pagedlm.core.layers import custom_ops

    assert custom_ops.registered_ops("cuda")["unquantized_gemm"] is gemv().unquantized_gemm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_built_with_the_op(device, dtype, monkeypatch):
    """A QKV and a row-parallel linear built with the CUDA platform's op bound (the table holding
    their shapes) against the same layers on F.linear; a [2, 2, K] input is 4 rows of the GEMV."""
    from pagedlm.core.layers import QKVParallelLinear, RowParallelLinear, custom_ops

    g = gemv()
    calls = []
    original = g.dense_gemv
    monkeypatch.setattr(g, "dense_gemv", lambda *args: calls.append(args[3]) or original(*args))
    # hidden 96, 2 q heads and 1 kv head of 32: qkv [128, 96]; o [96, 64]
    monkeypatch.setitem(g.DEFAULT_CONFIGS, (128, 96), {4: config(16, 64, 2)})
    monkeypatch.setitem(g.DEFAULT_CONFIGS, (96, 64), {4: config(32, 64, 1)})
    ops = custom_ops.registered_ops("cuda")

    def build():
        return (QKVParallelLinear(96, 32, 2, 1, bias=True, params_dtype=dtype),
                RowParallelLinear(64, 96, bias=True, params_dtype=dtype))

    with custom_ops.use_ops(ops):
        fast = [layer.to(device) for layer in build()]
    plain = [layer.to(device) for layer in build()]
    gen = torch.Generator().manual_seed(5)
    for a, b in zip(fast, plain):
        for pa, pb in zip(a.parameters(), b.parameters()):
            pa.data.copy_((torch.randn(pa.shape, generator=gen) * 0.1).to(dtype))
            pb.data.copy_(pa.data)
    x = torch.randn(2, 2, 96, generator=gen).to(dtype).to(device)
    qkv = fast[0](x)
    want = plain[0](x)
    assert qkv.shape == want.shape == (2, 2, 128)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(qkv.float(), want.float(), rtol=2.2 * eps, atol=2e-3)
    h = qkv[..., :64].contiguous()
    torch.testing.assert_close(fast[1](h).float(), plain[1](h).float(), rtol=2.2 * eps, atol=2e-3)
    assert len(calls) == 2  # both layers took the kernel
    x5 = torch.randn(5, 96, generator=gen).to(dtype).to(device)  # 5 rows: F.linear
    torch.testing.assert_close(fast[0](x5), plain[0](x5), rtol=0, atol=0)
    assert len(calls) == 2


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_split_k(device):
    """Captured (split-K, the counters created before the capture as the engine's eager warm-up
    does), then replayed with new rows in the same input buffer."""
    x, w, b = inputs(device, 2, 4096, 4096, torch.bfloat16, bias=True, seed=6)
    cfg = config(16, 512, 4)
    gemv().unquantized_gemm(x, w, b, _config=cfg)  # eager first call: creates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv().unquantized_gemm(x, w, b, _config=cfg)
    for seed in (7, 8):
        x.copy_(inputs(device, 2, 4096, 4096, torch.bfloat16, bias=False, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_float32(out, x, w, b)
