"""GGUF dequantization: bit-identical to the ``gguf`` package's reference decoders, for every type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedlm.core.model_loader.gguf_dequant import SUPPORTED_TYPES, dequantize  # noqa: E402

# byte offsets of the float16 scale fields in one block, which must hold finite values
_HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def random_blocks(name: str, num_blocks: int, seed: int = 0) -> np.ndarray:
    """``[num_blocks * type_size]`` random bytes of type ``name`` with finite scales."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for start in _HALF_FIELDS[name]:
        scales = rng.uniform(-2, 2, size=num_blocks).astype(np.float16)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", sorted(_HALF_FIELDS))
def test_quantized_types_match_gguf_reference(name: str) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows = 3
    raw = random_blocks(name, rows * 4)
    expected = gguf.quants.dequantize(raw, qtype).reshape(rows, 4 * block)
    ours = dequantize(raw.copy(), int(qtype), (rows, 4 * block))
    assert ours.dtype == torch.float32 and ours.shape == (rows, 4 * block)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_chunked_decoding_matches_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedlm.core.model_loader.gguf_dequant as dq

    raw = random_blocks("Q4_K", 40)
    whole = dequantize(raw.copy(), int(gguf.GGMLQuantizationType.Q4_K), (10, 1024))
    monkeypatch.setattr(dq, "_CHUNK_VALUES", 512)  # 2 blocks per chunk
    chunked = dequantize(raw.copy(), int(gguf.GGMLQuantizationType.Q4_K), (10, 1024))
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize(("name", "np_dtype"), [("F32", np.float32), ("F16", np.float16)])
def test_float_types_and_output_dtype(name: str, np_dtype: type) -> None:
    values = np.random.default_rng(1).standard_normal((4, 8)).astype(np_dtype)
    qtype = int(gguf.GGMLQuantizationType[name])
    out = dequantize(values.reshape(-1).view(np.uint8).copy(), qtype, (4, 8), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16))


def test_bf16() -> None:
    values = torch.randn(2, 32).to(torch.bfloat16)
    raw = values.view(torch.uint8).reshape(-1).numpy().copy()
    assert torch.equal(dequantize(raw, int(gguf.GGMLQuantizationType.BF16), (2, 32)), values.float())


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"ggml type 16 is not supported; supported: F32, F16, BF16"):
        dequantize(np.zeros(66, dtype=np.uint8), 16, (256,))  # IQ2_XXS
    with pytest.raises(ValueError, match="do not hold 64 values"):
        dequantize(np.zeros(30, dtype=np.uint8), int(gguf.GGMLQuantizationType.Q8_0), (64,))
    assert "Q4_K" in SUPPORTED_TYPES and "Q6_K" in SUPPORTED_TYPES
