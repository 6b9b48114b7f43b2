"""The CPU GGUF kernels (AVX-512, AVX2 and scalar builds) against core's dequantize-then-matmul, per type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedlm.backends.cpu.kernels import gguf_ops  # noqa: E402
from pagedlm.core.layers.quantization.gguf import gguf_mul_mat_reference  # noqa: E402
from pagedlm.core.model_loader.gguf_dequant import dequantize  # noqa: E402

# byte offsets of the float16 scale fields of one block, which must hold finite values
_HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
_BUILDS = list(gguf_ops.BUILDS)


def _random_weight(name: str, n: int, blocks_per_row: int, seed: int = 0) -> tuple[torch.Tensor, int, int]:
    """``(qweight [n, row_bytes] uint8, ggml type id, K)``: random bits (every code point) with finite scales."""
    qtype = gguf.GGMLQuantizationType[name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * blocks_per_row, type_size), dtype=np.uint8)
    for start in _HALF_FIELDS[name]:
        scales = rng.uniform(-0.05, 0.05, size=n * blocks_per_row).astype(np.float16)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, blocks_per_row * type_size)), int(qtype), blocks_per_row * block


@pytest.fixture(scope="module", params=_BUILDS)
def library(request):
    if request.param not in gguf_ops.available_builds():
        pytest.skip(f"this CPU cannot run the {request.param} build")
    return gguf_ops._library(request.param)


@pytest.fixture
def use_library(library, monkeypatch):
    monkeypatch.setattr(gguf_ops, "kernel_library", lambda: library)


@pytest.mark.parametrize("name", sorted(_HALF_FIELDS))
def test_decoded_rows_equal_the_torch_dequantizer(name, use_library):
    qweight, qtype, k = _random_weight(name, 11, 3)
    expected = dequantize(qweight.reshape(-1), qtype, (11, k))
    ids = torch.tensor([[10, 0, 3], [3, 7, 1]])
    rows = gguf_ops.gguf_get_rows(qweight, qtype, ids, k)
    assert rows.shape == (2, 3, k)
    torch.testing.assert_close(rows, expected[ids], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(_HALF_FIELDS))
@pytest.mark.parametrize(("m", "n"), [(1, 13), (3, 13), (33, 13), (33, 37)])
def test_mul_mat_matches_dequantize_then_matmul(name, m, n, use_library):
    # n: not a multiple of the 4-row groups (decode) nor of the 16-row tiles (batches, from M = 6)
    qweight, qtype, k = _random_weight(name, n, 2, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = gguf_ops.gguf_mul_mat(x, qweight, qtype, n, int8_activations=False)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # float32 sums in another order than the reference's: bounded by eps * sum |x * w| per output
    w = dequantize(qweight.reshape(-1), qtype, (n, k)).double()
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    assert ((out.double() - exact).abs() <= 4e-6 * scale + 1e-30).all()
    reference = gguf_mul_mat_reference(x, qweight, qtype, n).double()
    assert ((reference - exact).abs() <= 4e-6 * scale + 1e-30).all()
    # bfloat16 activations: converted to float32 in, result rounded to bfloat16
    out16 = gguf_ops.gguf_mul_mat(x.bfloat16(), qweight, qtype, n, int8_activations=False)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, gguf_mul_mat_reference(x.bfloat16().float(), qweight, qtype, n).bfloat16())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize(("m", "n", "blocks"), [(6, 13, 2), (17, 37, 2), (40, 9, 3), (70, 13, 32)])
def test_batch_tiles_match_dequantize_then_matmul(name, m, n, blocks, use_library):
    """The batch path (from 6 rows): panels of 16/32 rows cut at odd M, groups of 6/8 weight rows
    cut at odd N, and (blocks=32: K = 1024 or 8192) x taken in several L2-sized chunks."""
    qweight, qtype, k = _random_weight(name, n, blocks, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = gguf_ops.gguf_mul_mat(x, qweight, qtype, n)
    w = dequantize(qweight.reshape(-1), qtype, (n, k)).double()
    exact, scale = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    assert ((out.double() - exact).abs() <= 4e-6 * scale + 1e-30).all()
    # each output is one chain over k in order: a row's result does not depend on the batch it is in
    assert torch.equal(gguf_ops.gguf_mul_mat(x[-6:].clone(), qweight, qtype, n), out[-6:])


def test_vector_builds_agree_bit_for_bit_on_batches():
    """AVX-512 and AVX2 add the same FMA chains (only the vector width differs)."""
    builds = [b for b in gguf_ops.available_builds() if b != "scalar"]
    if len(builds) < 2:
        pytest.skip("this CPU runs fewer than two vector builds")
    qweight, qtype, k = _random_weight("Q8_0", 29, 5, seed=1)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2))
    outs = []
    for build in builds:
        out = torch.empty(37, 29)
        assert gguf_ops._library(build).pagedlm_gguf_mul_mat(qtype, qweight.data_ptr(), 29, k, x.data_ptr(), 37,
                                                             out.data_ptr(), 29, 2) == 0
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_bad_inputs_are_rejected(use_library):
    qweight, qtype, k = _random_weight("Q8_0", 4, 1)
    with pytest.raises(ValueError, match="outside"):
        gguf_ops.gguf_get_rows(qweight, qtype, torch.tensor([4]), k)
    with pytest.raises(ValueError, match="not supported"):
        gguf_ops.gguf_mul_mat(torch.randn(1, k), qweight, 11, 4)  # Q3_K: dequantized at load instead


def _int8_act_reference(x: torch.Tensor, qweight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``gguf_q8_act.c``'s arithmetic in float64: x rounded to int8 per 32 values (nearest even,
    scale amax / 127), times the exactly decoded weights."""
    w = dequantize(qweight.reshape(-1), qtype, (qweight.shape[0], k)).double()
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], k // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q_x = np.rint((xb * inv[..., None]).astype(np.float32))
    d_x = (amax / np.float32(127.0)).astype(np.float32)
    x_q = torch.from_numpy((q_x.astype(np.float64) * d_x[..., None]).reshape(x.shape[0], k))
    return x_q @ w.T


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("m", "n", "k_values"), [(1, 37, 1280), (2, 5, 256), (3, 130, 512), (4, 64, 2048)])
def test_int8_activation_path_is_its_quantized_arithmetic(name, m, n, k_values, use_library):
    """Weights of every code point (Q8_0's -128 included) times x rounded to int8 per 32 values:
    the kernel equals that arithmetic up to float32 rounding, in both builds; and it stays close
    to the exact product (8-bit activations: about 0.5 % of the output's size)."""
    block = 32 if name == "Q8_0" else 256
    qweight, qtype, k = _random_weight(name, n, k_values // block, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    got = gguf_ops.gguf_mul_mat(x, qweight, qtype, n, int8_activations=True)
    want = _int8_act_reference(x, qweight, qtype, k)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * scale)
    exact = gguf_ops.gguf_mul_mat(x, qweight, qtype, n, int8_activations=False)
    assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_int8_activation_builds_agree_bit_for_bit(name):
    builds = gguf_ops.available_builds()
    if len(builds) < 2:
        pytest.skip("this CPU runs only the scalar build")
    qweight, qtype, k = _random_weight(name, 29, 3 if name != "Q8_0" else 20, seed=3)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    outs = []
    for build in builds:
        out = torch.empty(4, 29)
        rc = gguf_ops._library(build).pagedlm_gguf_mul_mat_q8_act(qtype, qweight.data_ptr(), 29, k, x.data_ptr(), 4,
                                                                 out.data_ptr(), 29, 2)
        assert rc == 0
        outs.append(out)
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.fixture
def vnni():
    if not gguf_ops.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI (decode rows take gguf_q8_act.c)")


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_vnni_rows_are_the_quantized_arithmetic(name, m, vnni):
    """gguf_vnni.c: odd block counts (Q8_0's last block alone; three super-blocks), every code
    point, an all-zero x block; the int8-activation arithmetic up to float32 rounding, and what
    gguf_mul_mat runs for decode rows on this CPU."""
    blocks = 3 if name != "Q8_0" else 21
    qweight, qtype, k = _random_weight(name, 45, blocks, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10 + m)) * 3
    x[m - 1, 32:64] = 0.0
    got = torch.empty(m, 45)
    rc = gguf_ops.kernel_library().pagedlm_gguf_mul_mat_vnni(qtype, qweight.data_ptr(), 45, k, x.data_ptr(), m,
                                                             got.data_ptr(), 45, 2)
    assert rc == 0
    want = _int8_act_reference(x, qweight, qtype, k)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert torch.equal(gguf_ops.gguf_mul_mat(x, qweight, qtype, 45, int8_activations=True), got)


def test_int8_activations_only_for_decode_rows_of_their_types(use_library, monkeypatch):
    """Batches (more than 4 rows) take the exact path whatever the setting unless the CPU has AMX
    (then gguf_amx.c), other types always; the environment variable (default 1) switches the path."""
    qweight, qtype, k = _random_weight("Q8_0", 9, 2)
    x = torch.randn(5, k)
    exact = gguf_ops.gguf_mul_mat(x, qweight, qtype, 9, int8_activations=False)
    batch = gguf_ops.gguf_mul_mat(x, qweight, qtype, 9, int8_activations=True)
    assert torch.equal(batch, exact) != gguf_ops.amx_available()
    q5k, q5k_type, k5 = _random_weight("Q5_K", 9, 1)
    x5 = torch.randn(1, k5)
    assert torch.equal(gguf_ops.gguf_mul_mat(x5, q5k, q5k_type, 9, int8_activations=True),
                       gguf_ops.gguf_mul_mat(x5, q5k, q5k_type, 9, int8_activations=False))
    one = x[:1]
    monkeypatch.delenv("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", raising=False)
    fast = gguf_ops.gguf_mul_mat(one, qweight, qtype, 9)  # the default: int8 activations
    monkeypatch.setenv("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", "1")
    assert torch.equal(fast, gguf_ops.gguf_mul_mat(one, qweight, qtype, 9))
    monkeypatch.setenv("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", "0")
    assert torch.equal(fast, gguf_ops.gguf_mul_mat(one, qweight, qtype, 9, int8_activations=True))
    assert not torch.equal(fast, gguf_ops.gguf_mul_mat(one, qweight, qtype, 9))
    monkeypatch.setenv("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", "fast")
    with pytest.raises(ValueError, match="PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS='fast' must be 1 .* or 0"):
        gguf_ops.gguf_mul_mat(one, qweight, qtype, 9)


@pytest.fixture
def amx():
    if not gguf_ops.amx_available():
        pytest.skip("this CPU has no AMX-INT8 (the batched int8-activation path runs only there; elsewhere "
                    "batches take the exact path)")


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("m", "n", "k_values"), [(5, 13, 256), (17, 130, 512), (40, 37, 2048), (300, 33, 512)])
def test_amx_batches_are_the_quantized_arithmetic(name, m, n, k_values, amx):
    """gguf_amx.c: tiles of 16 weight rows x 16 x rows (partial tiles at both ends, more than one
    256-row chunk of x at m = 300) equal the int8-activation arithmetic up to float32 rounding."""
    block = 32 if name == "Q8_0" else 256
    qweight, qtype, k = _random_weight(name, n, k_values // block, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[1, 32:64] = 0.0
    got = gguf_ops.gguf_mul_mat(x, qweight, qtype, n, int8_activations=True)
    want = _int8_act_reference(x, qweight, qtype, k)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_amx_row_results_do_not_depend_on_the_batch(name, amx):
    block = 32 if name == "Q8_0" else 256
    qweight, qtype, k = _random_weight(name, 21, 512 // block, seed=7)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(8))
    whole = gguf_ops.gguf_mul_mat(x, qweight, qtype, 21, int8_activations=True)
    part = gguf_ops.gguf_mul_mat(x[33:40].contiguous(), qweight, qtype, 21, int8_activations=True)
    assert torch.equal(whole[33:40], part)
