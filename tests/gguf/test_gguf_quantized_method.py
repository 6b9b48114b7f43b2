"""The ``gguf`` method: chosen for a GGUF file on the CPU, layers kept quantized, bad requests refused."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from pagedlm.core import LLM  # noqa: E402
from pagedlm.core.config import DeviceConfig, ModelConfig, VllmConfig  # noqa: E402
from pagedlm.core.model_loader.gguf_export import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def llama_q8(tiny_checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_gguf(tiny_checkpoints["llama"], str(tmp_path_factory.mktemp("gguf") / "llama-Q8_0.gguf"), "Q8_0")


def test_cpu_keeps_linear_layers_and_embedding_quantized(llama_q8: str) -> None:
    # token identity with HF on this file: tests/gguf/test_gguf_tiny_models.py::[llama-Q8_0]
    llm = LLM(model=llama_q8, dtype="float32", device="cpu", num_gpu_blocks_override=32)
    config = llm.llm_engine.vllm_config.quant_config
    assert config is not None and config.get_name() == "gguf"
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj.quant_method).__name__ == "GGUFLinearMethod"
    assert [t for t, _, _ in layer.self_attn.qkv_proj.gguf_segments] == [8]  # q, k, v: one Q8_0 run
    assert layer.self_attn.qkv_proj.weight.dtype.is_floating_point is False
    assert type(model.model.embed_tokens.quant_method).__name__ == "GGUFEmbeddingMethod"
    assert "model.layers.0.mlp.gate_proj.weight" in config.quantized_tensors


@pytest.mark.parametrize("name", ["Q4_0", "Q5_0"])
def test_q4_0_and_q5_0_repack_as_q8_0_with_identical_values(name: str) -> None:
    import numpy as np
    import torch

    from pagedlm.core.layers.quantization.gguf import repack_as_q8_0
    from pagedlm.core.model_loader.gguf_dequant import dequantize

    qtype = gguf.GGMLQuantizationType[name]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(5 * 3, size), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(-1, 1, size=15).astype(np.float16).view(np.uint8).reshape(15, 2)
    blocks = torch.from_numpy(raw).view(5, 3 * size)
    repacked = repack_as_q8_0(blocks, int(qtype))
    assert repacked.shape == (5, 3 * 34)
    expected = dequantize(blocks.reshape(-1), int(qtype), (5, 96))
    assert torch.equal(dequantize(repacked.reshape(-1), 8, (5, 96)), expected)


def test_float_gguf_file_has_no_method(tiny_checkpoints: dict[str, str], tmp_path: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], str(tmp_path / "llama-F32.gguf"), "F32")
    vllm_config = VllmConfig(model_config=ModelConfig(model=path), device_config=DeviceConfig(device="cpu"))
    vllm_config.finalize()
    assert vllm_config.quant_config is None  # nothing quantized: loads as before


def test_other_methods_on_a_gguf_file_and_gguf_on_a_directory_are_refused(llama_q8: str,
                                                                         tiny_checkpoints: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' cannot read the GGUF file .*quantization=\"gguf\""):
        LLM(model=llama_q8, device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match=r'quantization="gguf" reads a GGUF file: pass model=FILE.gguf'):
        LLM(model=tiny_checkpoints["llama"], device="cpu", quantization="gguf")
