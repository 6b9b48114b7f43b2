"""The GGUF header reader, and one clear error for each kind of bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pagedlm.core.config import LoadConfig, ModelConfig, VllmConfig  # noqa: E402
from pagedlm.core.model_loader.gguf_export import write_gguf  # noqa: E402
from pagedlm.core.model_loader.gguf_loader import find_gguf_file, load_gguf_model_config  # noqa: E402
from pagedlm.core.model_loader.gguf_reader import read_gguf  # noqa: E402


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_gguf(tiny_llama, str(tmp_path_factory.mktemp("gguf") / "tiny-llama-q8.gguf"), "Q8_0")


def test_reader_agrees_with_gguf_package(llama_gguf: str) -> None:
    ref = gguf.GGUFReader(llama_gguf)
    with read_gguf(llama_gguf) as ours:
        assert ours.version == 3 and ours.architecture == "llama"
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert sorted(keys) == sorted(ours.metadata)
        for key in keys:
            expected, got = ref.fields[key].contents(), ours.metadata[key]
            if isinstance(got, np.ndarray):
                got = got.tolist()
            assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, key
        assert [t.name for t in ref.tensors] == [t.name for t in ours.tensors]
        for r, o in zip(ref.tensors, ours.tensors):
            assert (int(r.tensor_type), int(r.data_offset), int(r.n_bytes)) == (o.ggml_type, o.offset, o.nbytes)
            assert tuple(int(d) for d in reversed(r.shape)) == o.shape
            assert np.array_equal(np.asarray(r.data).reshape(-1).view(np.uint8), ours.tensor_bytes(o))


def test_config_from_metadata_matches_the_checkpoint(tiny_llama: str, llama_gguf: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_llama)
    ours, generation = load_gguf_model_config(llama_gguf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(hf, key), key
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert ours.architectures == ["LlamaForCausalLM"] and generation["eos_token_id"] == [hf.eos_token_id]


def test_gguf_model_path_selects_the_gguf_load_format(llama_gguf: str) -> None:
    config = VllmConfig(model_config=ModelConfig(model=llama_gguf))
    config.finalize()
    assert config.load_config.load_format == "gguf"
    assert config.model_config.tokenizer == llama_gguf
    # a directory holding one .gguf file (and no config.json) means that file
    assert find_gguf_file(str(Path(llama_gguf).parent)) == llama_gguf
    bad = VllmConfig(model_config=ModelConfig(model=llama_gguf), load_config=LoadConfig(load_format="safetensors"))
    with pytest.raises(ValueError, match="cannot read the GGUF file"):
        bad.finalize()


def _expect(path: Path, *patterns: str) -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig(model=str(path))
    message = str(info.value)
    assert str(path) in message, message
    for pattern in patterns:
        assert pattern in message, message


def test_not_gguf_and_truncated_files(llama_gguf: str, tmp_path: Path) -> None:
    data = Path(llama_gguf).read_bytes()
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + data[4:200])
    _expect(not_gguf, "is not a GGUF file")

    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:300])
    _expect(header_cut, "truncated or corrupt")

    data_cut = tmp_path / "data-cut.gguf"
    data_cut.write_bytes(data[: len(data) - 1000])
    _expect(data_cut, "is truncated: tensor", "but the file ends at")

    version = tmp_path / "version.gguf"
    version.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    _expect(version, "GGUF version 7; supported versions: 2, 3")


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", 64), ("embedding_length", 32), ("block_count", 1),
                       ("feed_forward_length", 64), ("attention.head_count", 2), ("attention.head_count_kv", 2)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_type_and_tensor(tmp_path: Path) -> None:
    embd = (np.zeros((64, 32), np.float32), None)
    _expect(_write(tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": embd}),
            "architecture 'mamba' is not supported; supported: llama, qwen2, qwen3, gemma3")
    # IQ4_NL: 18-byte blocks of 32 values, a type the gguf package knows and pagedlm does not decode
    iq4 = (np.zeros((64, 18), np.uint8), gguf.GGMLQuantizationType.IQ4_NL)
    _expect(_write(tmp_path / "iq4.gguf", "llama", {"token_embd.weight": iq4}),
            "token_embd.weight (IQ4_NL)", "supported types: F32, F16, BF16, Q4_0")
    _expect(_write(tmp_path / "extra.gguf", "llama", {"token_embd.weight": embd, "blk.0.ssm_a.weight": embd}),
            "blk.0.ssm_a.weight", "no counterpart")


def test_unknown_tensor_type_id(llama_gguf: str, tmp_path: Path) -> None:
    """A type id the gguf package has never heard of (corruption, or a file from the future)."""
    data = bytearray(Path(llama_gguf).read_bytes())
    with read_gguf(llama_gguf) as g:
        first = g.tensors[0]
    # the type field of the first tensor info sits right after its name, rank and dims
    name = first.name.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4 + 8 * len(first.shape)
    assert int.from_bytes(data[at : at + 4], "little") == first.ggml_type
    data[at : at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type99.gguf"
    bad.write_bytes(bytes(data))
    _expect(bad, f"tensor {first.name!r} has ggml type 99")


def test_directory_with_two_gguf_files_is_ambiguous(llama_gguf: str, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(llama_gguf, tmp_path / name)
    with pytest.raises(ValueError, match="several GGUF files"):
        ModelConfig(model=str(tmp_path))
