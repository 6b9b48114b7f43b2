"""GGUF files written from the tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints load and produce HF's tokens.

The expected tokens come from HF transformers running the original safetensors checkpoint with
its matrices rounded the way the GGUF stores them, rounded by the ``gguf`` package's own
quantizer and reference dequantizer (for F32 that is the original checkpoint). So the test covers
pagedlm's header reader, dequantizer, name mapping, llama's q/k un-permutation, config rebuilding
and tokenizer conversion, against code paths that share none of them.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from pagedlm.core import LLM  # noqa: E402
from pagedlm.core.model_loader.gguf_export import write_gguf  # noqa: E402
from pagedlm.core.testing import assert_greedy_matches_hf, hf_greedy  # noqa: E402

MAX_NEW = 16
CASES = [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("qwen2", "F16"), ("qwen2", "Q8_0"),
         ("qwen3", "F32"), ("qwen3", "Q8_0"), ("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0")]


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    base = [rng.randrange(4, 500) for _ in range(40)]
    return [base[:40], base[:20] + [7, 8, 9], [rng.randrange(4, 500) for _ in range(5)]]


def rounded_reference(src: str, out: Path, tensor_type: str) -> str:
    """``src`` with every matrix replaced by its ``tensor_type`` round trip (norms/biases stay f32);
    transformers keeps experts stacked (``[E, out, in]``), rounded row by row as the GGUF stacks are."""
    if tensor_type == "F32":
        return src
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() < 2:
                continue
            w = p.numpy()
            if tensor_type == "F16":
                rounded = w.astype("float16").astype("float32")
            else:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
            p.copy_(torch.from_numpy(rounded))
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, out / name)
    return str(out)


@pytest.mark.parametrize(("arch", "tensor_type"), CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_tiny_gguf_matches_hf(arch: str, tensor_type: str, tiny_checkpoints: dict[str, str], tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the exact float32 path (int8 activations, the default, differ from HF by their rounding)
    monkeypatch.setenv("PAGEDLM_CPU_GGUF_INT8_ACTIVATIONS", "0")
    src = tiny_checkpoints[arch]
    path = write_gguf(src, str(tmp_path / f"{arch}-{tensor_type}.gguf"), tensor_type)
    reference = hf_greedy(rounded_reference(src, tmp_path / "ref", tensor_type), prompts(), MAX_NEW)
    llm = LLM(model=path, dtype="float32", device="cpu", num_gpu_blocks_override=32)
    assert llm.llm_engine.vllm_config.load_config.load_format == "gguf"
    assert_greedy_matches_hf(path, prompts(), MAX_NEW, llm=llm, reference=reference)


def test_tokenizer_from_gguf_metadata_is_cached_and_equivalent(tiny_checkpoints: dict[str, str],
                                                               tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pagedlm.core.engine.tokenizer import get_tokenizer
    from pagedlm.core.model_loader.gguf_tokenizer import gguf_tokenizer_cache_dir

    src = tiny_checkpoints["qwen2"]
    path = write_gguf(src, str(tmp_path / "qwen2.gguf"), "F32")
    original = AutoTokenizer.from_pretrained(src)
    first = get_tokenizer(path)
    cache = Path(gguf_tokenizer_cache_dir(path))
    assert cache.parent == tmp_path and (cache / "tokenizer.json").exists()
    second = get_tokenizer(path)  # from the cache
    for text in ["hello world", "The quick brown fox, 42 times!", "  spaces\tand\nlines"]:
        ids = original(text, add_special_tokens=False).input_ids
        assert first(text, add_special_tokens=False).input_ids == ids
        assert second(text, add_special_tokens=False).input_ids == ids
        assert second.decode(ids) == original.decode(ids)
    # a changed file invalidates the cache
    Path(path).touch()
    stamp = (cache / "pagedlm-gguf-source.json").read_text()
    get_tokenizer(path)
    assert (cache / "pagedlm-gguf-source.json").read_text() != stamp


def test_qwen3moe_gguf_layout(tiny_checkpoint_factory, tmp_path: Path) -> None:
    """llama.cpp's conventions: experts stacked per projection (``ffn_gate_exps`` of dims
    ``[hidden, width, experts]``), the router as ``ffn_gate_inp``, the expert counts and width in the
    metadata; a layer without a router reads back as a dense one (``mlp_only_layers``)."""
    src = tiny_checkpoint_factory("qwen3_moe", mlp_only_layers=(1,), norm_topk_prob=False)
    path = write_gguf(src, str(tmp_path / "moe.gguf"), "F32")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"] == [64, 128, 8]
    assert tensors["blk.0.ffn_down_exps.weight"] == [128, 64, 8]
    assert tensors["blk.0.ffn_gate_inp.weight"] == [64, 8]
    assert "blk.1.ffn_gate.weight" in tensors and "blk.1.ffn_gate_inp.weight" not in tensors
    from pagedlm.core.model_loader.gguf_loader import load_gguf_model_config

    config, _ = load_gguf_model_config(path)
    assert type(config).__name__ == "Qwen3MoeConfig" and config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 128)
    assert config.mlp_only_layers == [1] and config.norm_topk_prob is False
    llm = LLM(model=path, dtype="float32", device="cpu", num_gpu_blocks_override=32)
    assert_greedy_matches_hf(path, prompts(), MAX_NEW, llm=llm, reference=hf_greedy(src, prompts(), MAX_NEW))
