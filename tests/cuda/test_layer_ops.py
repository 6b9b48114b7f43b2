"""The fused Triton layer ops against core's torch layers (the HF-faithful reference).

float32 must agree to rounding; bf16/fp16 to the last bit almost everywhere (the ops repeat
torch's rounding steps; only a reduction order or an ``exp`` implementation may differ).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fused(device):
    """Register the kernels for ``device`` for one test, then restore the torch path."""
    from pagedlm.backends.cuda.kernels.layer_ops import register_cuda_layer_ops
    from pagedlm.core.layers.custom_ops import clear_op_impls

    register_cuda_layer_ops(device.type)
    yield
    clear_op_impls(device.type)


def reference(fn):
    """Run ``fn`` with no replacement registered (core's torch path)."""
    from pagedlm.core.layers import custom_ops

    saved = dict(custom_ops._IMPLS)
    custom_ops._IMPLS.clear()
    try:
        return fn()
    finally:
        custom_ops._IMPLS.update(saved)


def assert_nearly_equal(out, ref, dtype, max_mismatch=0.01):
    """Equal up to rounding; in bf16/fp16 at most ``max_mismatch`` of the elements may differ
    (by at most about one unit in the last place); ``None``: any number may."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    elif INTERPRET and dtype == torch.bfloat16:
        # Triton 3.6's interpreter truncates float32 -> bf16 instead of rounding to nearest, so
        # only closeness can be checked on the CPU; the bit-level check runs on the GPU.
        torch.testing.assert_close(out, ref, atol=4e-2, rtol=2e-2)
    else:
        eps = torch.finfo(dtype).eps
        # Fused multiply-adds round differently from torch's separate ops: allow about two units
        # in the last place at magnitude 1 (seen on an H200: 0.4% of bf16 elements one unit off).
        torch.testing.assert_close(out, ref, atol=2 * eps, rtol=eps)
        if max_mismatch is not None:
            assert (out != ref).float().mean() < max_mismatch


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hidden", [64, 1000, 1024])
def test_rms_norm_and_fused_residual(device, fused, dtype, hidden):
    from pagedlm.core.layers import RMSNorm

    norm = RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(37, hidden, device=device, dtype=dtype) * 3
    residual = torch.randn(37, hidden, device=device, dtype=dtype)
    assert_nearly_equal(norm(x), reference(lambda: norm(x)), dtype)
    out, summed = norm(x, residual)
    ref_out, ref_summed = reference(lambda: norm(x, residual))
    if INTERPRET and dtype == torch.bfloat16:
        torch.testing.assert_close(summed, ref_summed, atol=4e-2, rtol=2e-2)  # truncating interpreter
    else:
        assert torch.equal(summed, ref_summed)
    assert_nearly_equal(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rms_norm_on_a_strided_head_view(device, fused, dtype):
    """Qwen3's q_norm: ``[T, H, D]`` view of a slice of the fused qkv output, no copy."""
    from pagedlm.core.layers import RMSNorm

    norm = RMSNorm(32, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data.normal_(1.0, 0.1)
    qkv = torch.randn(9, 4 * 32 + 2 * 2 * 32, device=device, dtype=dtype)
    q = qkv[:, : 4 * 32].reshape(9, 4, 32)
    assert not q.is_contiguous()
    assert_nearly_equal(norm(q), reference(lambda: norm(q)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary(device, fused, dtype, neox, partial):
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    head, rot = 64, int(64 * partial)
    with torch.device(device):
        rope = RotaryEmbedding(head, rot, 512, _default_inv_freq(10000.0, rot), is_neox_style=neox)
    positions = torch.randint(0, 512, (13,), device=device)
    qkv = torch.randn(13, (4 + 2 + 2) * head, device=device, dtype=dtype)
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 6 * head]  # strided views, as models pass them
    out_q, out_k = rope(positions, q, k)
    ref_q, ref_k = reference(lambda: rope(positions, q, k))
    # NOTE: compiled for the GPU, ~23% of bf16/fp16 elements come out one unit in the last place
    # off torch's (measured on an H200; the interpreter matches bit for bit), so only the size of
    # the difference is checked here; fp32 must agree to rounding.
    assert_nearly_equal(out_q, ref_q, dtype, max_mismatch=None)
    assert_nearly_equal(out_k, ref_k, dtype, max_mismatch=None)
    only_q, none = rope(positions, q, None)
    assert none is None
    assert torch.equal(only_q, out_q)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("base", [10000.0, 1000000.0])
def test_rotary_gemma3_shape(device, fused, dtype, base):
    """Gemma 3 270M's rotary: head size 256 on 4 query heads and 1 kv head, both of its RoPE bases,
    positions far past the 512-token window."""
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    head = 256
    with torch.device(device):
        rope = RotaryEmbedding(head, head, 4096, _default_inv_freq(base, head), is_neox_style=True)
    positions = torch.randint(0, 4096, (11,), device=device)
    qkv = torch.randn(11, 6 * head, device=device, dtype=dtype)
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 5 * head]
    out_q, out_k = rope(positions, q, k)
    ref_q, ref_k = reference(lambda: rope(positions, q, k))
    assert_nearly_equal(out_q, ref_q, dtype, max_mismatch=None)
    assert_nearly_equal(out_k, ref_k, dtype, max_mismatch=None)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize(("head", "partial"), [(64, 1.0), (64, 0.5), (128, 1.0)])
def test_qk_norm_rotary(device, fused, dtype, neox, head, partial):
    """Qwen3's per-head q/k RMSNorm and rotary in one kernel against the two torch layers."""
    from pagedlm.core.layers import RMSNorm
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    rot = int(head * partial)
    with torch.device(device):
        rope = RotaryEmbedding(head, rot, 512, _default_inv_freq(10000.0, rot), is_neox_style=neox)
        q_norm, k_norm = RMSNorm(head, eps=1e-6).to(dtype), RMSNorm(head, eps=1e-6).to(dtype)
    q_norm.weight.data.normal_(1.0, 0.2)
    k_norm.weight.data.normal_(1.0, 0.2)
    positions = torch.randint(0, 512, (13,), device=device)
    qkv = torch.randn(13, (4 + 2 + 2) * head, device=device, dtype=dtype) * 3
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 6 * head]  # strided views, as models pass them
    out_q, out_k = rope.forward_qk_norm(positions, q, k, q_norm, k_norm)
    ref_q, ref_k = reference(lambda: rope.forward_qk_norm(positions, q, k, q_norm, k_norm))
    assert_nearly_equal(out_q, ref_q, dtype, max_mismatch=None)
    assert_nearly_equal(out_k, ref_k, dtype, max_mismatch=None)
    # Against the separate fused norm and rotary kernels: the same rounding steps.
    sep_q = rope(positions, q_norm(q.reshape(13, 4, head)).reshape(13, -1),
                 k_norm(k.reshape(13, 2, head)).reshape(13, -1))[0]
    assert_nearly_equal(out_q, sep_q, dtype, max_mismatch=None)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("inter", [128, 3072])
def test_silu_and_mul(device, fused, dtype, inter):
    from pagedlm.core.layers import SiluAndMul

    act = SiluAndMul()
    x = torch.randn(11, 2 * inter, device=device, dtype=dtype) * 4
    assert_nearly_equal(act(x), reference(lambda: act(x)), dtype)


def test_unregistered_device_keeps_the_torch_path(fused):
    """Registering for one device type leaves tensors on other devices on the torch path."""
    from pagedlm.core.layers.custom_ops import get_op_impl, register_op_impl

    assert get_op_impl("silu_and_mul", "meta") is None
    with pytest.raises(ValueError, match="unknown layer op"):
        register_op_impl("gelu", "cuda", lambda x: x)
