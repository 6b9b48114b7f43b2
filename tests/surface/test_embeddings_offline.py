"""Pooling models offline: LLM(runner="pooling").embed / encode / score against sentence-transformers
and HF (fp32, CPU), through chunked prefill, preemption and batch mixes; refusals by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedlm.core import LLM, PoolingParams, SamplingParams
from pagedlm.core.layers.pooler import PoolerConfig

TEXTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "pagedlm pools prompts " * 6]


@pytest.fixture(scope="module")
def st_model(tiny_st_qwen3):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_st_qwen3, device="cpu")


@pytest.fixture(scope="module")
def reference(st_model):
    return st_model.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def embed_llm(tiny_st_qwen3):
    return LLM(tiny_st_qwen3, runner="pooling", dtype="float32", device="cpu")


def _hidden_states(st_model, text: str) -> torch.Tensor:
    """HF's last hidden states ``[T, hidden]`` of one prompt (no padding)."""
    transformer = st_model[0].auto_model
    ids = st_model.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return transformer(input_ids=ids).last_hidden_state[0]


def test_embeddings_equal_sentence_transformers(embed_llm, reference):
    outs = embed_llm.embed(TEXTS, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert outs[0].prompt_token_ids == embed_llm.get_tokenizer()(TEXTS[0]).input_ids
    # token-id prompts pool the same
    again = embed_llm.embed([{"prompt_token_ids": outs[1].prompt_token_ids}], use_tqdm=False)
    np.testing.assert_allclose(again[0].outputs.embedding, reference[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=5, enable_chunked_prefill=True),  # mean pooling over several chunks
    dict(max_num_seqs=1),  # one prompt per step instead of a batch of four
], ids=["chunked", "one-at-a-time"])
def test_mean_pooling_over_chunks_and_batch_mixes(tiny_st_qwen3, reference, engine_kwargs):
    llm = LLM(tiny_st_qwen3, runner="pooling", dtype="float32", device="cpu", **engine_kwargs)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_pooler_restarts_a_prompt_recomputed_after_preemption(pooling_type):
    from pagedlm.core.layers.pooler import Pooler

    hidden = torch.randn(7, 4)
    expected = {"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[pooling_type]
    pooler = Pooler(pooling_type)
    # chunks [0:3] then (preempted, recomputed from position 0) [0:4], [4:7]
    assert pooler.pool(["r"], [7], [0, 3], [0], [3], hidden[0:3]) == {}
    assert pooler.pool(["r"], [7], [0, 4], [0], [4], hidden[0:4]) == {}
    done = pooler.pool(["r"], [7], [0, 3], [4], [3], hidden[4:7])
    torch.testing.assert_close(torch.tensor(done["r"]), expected)
    assert not pooler._partial


@pytest.mark.parametrize("pooling_type", ["CLS", "LAST"])
def test_pooler_config_overrides_the_pooling_type(tiny_st_qwen3, st_model, pooling_type):
    llm = LLM(tiny_st_qwen3, runner="pooling", dtype="float32", device="cpu",
              pooler_config={"pooling_type": pooling_type, "normalize": False})
    outs = llm.encode(TEXTS[:2], use_tqdm=False)
    for text, out in zip(TEXTS[:2], outs):
        hidden = _hidden_states(st_model, text)
        expected = hidden[0] if pooling_type == "CLS" else hidden[-1]
        torch.testing.assert_close(out.outputs.data, expected, atol=1e-5, rtol=1e-5)  # raw: ~20 in size
    assert PoolerConfig.from_any({"pooling_type": "cls"}).pooling_type == "CLS"


def test_encode_raw_and_score_is_cosine(embed_llm, st_model, reference):
    raw = embed_llm.encode(TEXTS[:1], pooling_task="encode", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(raw, _hidden_states(st_model, TEXTS[0]).mean(dim=0), atol=1e-5, rtol=1e-5)
    scores = embed_llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    expected = [float(reference[0] @ reference[i]) for i in (1, 2)]
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-5)
    pairs = embed_llm.score(TEXTS[:2], TEXTS[2:4], use_tqdm=False)
    assert [s.outputs.score for s in pairs] == pytest.approx(
        [float(reference[0] @ reference[2]), float(reference[1] @ reference[3])], abs=1e-5)


def test_refusals_name_the_problem(embed_llm, tiny_llama):
    with pytest.raises(ValueError, match="dimensions=8 is not supported: model .* does not support matryoshka"):
        embed_llm.embed(["hi"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.generate needs a generative model"):
        embed_llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="data_1 has 2 entries and data_2 3"):
        embed_llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='nope' is not one of auto, generate, pooling"):
        LLM(tiny_llama, runner="nope", device="cpu")
    gen = LLM(tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="needs a pooling .*--runner pooling"):
        gen.embed(["hi"], use_tqdm=False)


def test_a_sentence_transformers_export_runs_as_is(st_model, reference, tmp_path):
    # SentenceTransformer.save writes the bare body: architectures ["Qwen3Model"], no "model."
    # prefix, no LM head; runner="auto" picks pooling for it
    st_model.save(str(tmp_path / "export"))
    llm = LLM(str(tmp_path / "export"), dtype="float32", device="cpu")
    assert llm.vllm_config.model_config.runner == "pooling"
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)


def test_task_embed_and_matryoshka_dimensions(tiny_st_qwen3, reference):
    llm = LLM(tiny_st_qwen3, task="embed", dtype="float32", device="cpu", hf_overrides={"is_matryoshka": True})
    assert llm.vllm_config.model_config.runner == "pooling"
    # mean pooling: the prefix cache is off (every prompt token's hidden state is needed)
    assert not llm.vllm_config.cache_config.enable_prefix_caching
    short = llm.embed(TEXTS[:1], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    full = llm.encode(TEXTS[:1], pooling_task="encode", use_tqdm=False)[0].outputs.data
    expected = torch.nn.functional.normalize(full[:16], dim=0)
    np.testing.assert_allclose(short, expected.numpy(), atol=1e-6)
