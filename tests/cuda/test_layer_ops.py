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
    """Layers built in the test bind the CUDA platform's registered kernels (the
    ``pagedlm_register_ops`` path a model runner takes); on the CPU they run in the interpreter."""
    from pagedlm.core.layers import custom_ops

    ops = custom_ops.registered_ops("cuda")
    assert set(ops) == {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "qk_norm_rotary_embedding",
                        "silu_and_mul", "gumbel_sample", "fused_experts", "wna16_gemm", "fp8_scaled_mm",
                        "int8_scaled_mm", "wna16_repack", "lora_shrink", "lora_expand", "apply_token_bitmask",
                        "fused_experts_fp8",
                        "fused_experts_wna16", "unquantized_gemm", "fp8_block_scaled_mm", "fp8_quantized_mm",
                        "rms_norm_fp8_quant", "fused_add_rms_norm_fp8_quant", "silu_and_mul_fp8_quant"}
    with custom_ops.use_ops(ops):
        yield ops


def reference(build, like=None):
    """``build()`` on core's torch path (no ops bound), with the weights of ``like`` if given."""
    from pagedlm.core.layers import custom_ops

    with custom_ops.use_ops({}):
        module = build()
    if like is not None:
        module.load_state_dict(like.state_dict())
    return module


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

    def build():
        return RMSNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)

    norm = build()
    norm.weight.data.normal_(1.0, 0.1)
    ref = reference(build, norm)
    x = torch.randn(37, hidden, device=device, dtype=dtype) * 3
    residual = torch.randn(37, hidden, device=device, dtype=dtype)
    assert_nearly_equal(norm(x), ref(x), dtype)
    out, summed = norm(x, residual)
    ref_out, ref_summed = ref(x, residual)
    if INTERPRET and dtype == torch.bfloat16:
        torch.testing.assert_close(summed, ref_summed, atol=4e-2, rtol=2e-2)  # truncating interpreter
    else:
        assert torch.equal(summed, ref_summed)
    assert_nearly_equal(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rms_norm_on_a_strided_head_view(device, fused, dtype):
    """Qwen3's q_norm: ``[T, H, D]`` view of a slice of the fused qkv output, no copy."""
    from pagedlm.core.layers import RMSNorm

    def build():
        return RMSNorm(32, eps=1e-6).to(device=device, dtype=dtype)

    norm = build()
    norm.weight.data.normal_(1.0, 0.1)
    ref = reference(build, norm)
    qkv = torch.randn(9, 4 * 32 + 2 * 2 * 32, device=device, dtype=dtype)
    q = qkv[:, : 4 * 32].reshape(9, 4, 32)
    assert not q.is_contiguous()
    assert_nearly_equal(norm(q), ref(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary(device, fused, dtype, neox, partial):
    from pagedlm.core.layers.rotary import RotaryEmbedding, _default_inv_freq

    head, rot = 64, int(64 * partial)

    def build():
        with torch.device(device):
            return RotaryEmbedding(head, rot, 512, _default_inv_freq(10000.0, rot), is_neox_style=neox)

    rope, ref = build(), reference(build)
    positions = torch.randint(0, 512, (13,), device=device)
    qkv = torch.randn(13, (4 + 2 + 2) * head, device=device, dtype=dtype)
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 6 * head]  # strided views, as models pass them
    out_q, out_k = rope(positions, q, k)
    ref_q, ref_k = ref(positions, q, k)
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

    def build():
        with torch.device(device):
            return RotaryEmbedding(head, head, 4096, _default_inv_freq(base, head), is_neox_style=True)

    rope, ref = build(), reference(build)
    positions = torch.randint(0, 4096, (11,), device=device)
    qkv = torch.randn(11, 6 * head, device=device, dtype=dtype)
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 5 * head]
    out_q, out_k = rope(positions, q, k)
    ref_q, ref_k = ref(positions, q, k)
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

    def build_rope():
        with torch.device(device):
            return RotaryEmbedding(head, rot, 512, _default_inv_freq(10000.0, rot), is_neox_style=neox)

    def build_norm():
        with torch.device(device):
            return RMSNorm(head, eps=1e-6).to(dtype)

    rope, q_norm, k_norm = build_rope(), build_norm(), build_norm()
    q_norm.weight.data.normal_(1.0, 0.2)
    k_norm.weight.data.normal_(1.0, 0.2)
    ref_rope = reference(build_rope)
    ref_q_norm, ref_k_norm = reference(build_norm, q_norm), reference(build_norm, k_norm)
    positions = torch.randint(0, 512, (13,), device=device)
    qkv = torch.randn(13, (4 + 2 + 2) * head, device=device, dtype=dtype) * 3
    q, k = qkv[:, : 4 * head], qkv[:, 4 * head : 6 * head]  # strided views, as models pass them
    out_q, out_k = rope.forward_qk_norm(positions, q, k, q_norm, k_norm)
    ref_q, ref_k = ref_rope.forward_qk_norm(positions, q, k, ref_q_norm, ref_k_norm)
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
    assert_nearly_equal(act(x), reference(SiluAndMul)(x), dtype)


def test_other_platforms_keep_the_torch_path(fused):
    """Kernels registered for ``cuda`` are not bound for another platform; unknown names fail."""
    from pagedlm.core.layers import SiluAndMul, custom_ops

    assert "silu_and_mul" not in custom_ops.registered_ops("cpu")
    with custom_ops.use_ops(custom_ops.registered_ops("cpu")):
        assert SiluAndMul()._silu_and_mul_op is None
    assert SiluAndMul()._silu_and_mul_op is fused["silu_and_mul"]
    with pytest.raises(ValueError, match="unknown layer op 'gelu'"), custom_ops.use_ops({"gelu": lambda x: x}):
        pass
