"""Pooling models on the CUDA runner: embeddings of a tiny sentence-transformers checkpoint equal
sentence-transformers' on the CPU (fp32), through CUDA graphs (one-token prompts replay the decode
graph) and chunked prefill."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.cuda]

TEXTS = ["Hello there", "a", "The quick brown fox jumps over the lazy dog " * 3]


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}], ids=["default", "chunked"])
def test_cuda_embeddings_equal_sentence_transformers(tiny_st_qwen3, engine_kwargs):
    from sentence_transformers import SentenceTransformer

    from pagedlm.core import LLM

    reference = SentenceTransformer(tiny_st_qwen3, device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(tiny_st_qwen3, runner="pooling", dtype="float32", device="cuda", **engine_kwargs)
    prompts = TEXTS + [{"prompt_token_ids": [1]}]  # a one-token prompt: the graph path
    outs = llm.embed(prompts, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs[: len(TEXTS)]])
    np.testing.assert_allclose(got, reference, atol=1e-4, rtol=0)
    assert abs(np.linalg.norm(outs[-1].outputs.embedding) - 1.0) < 1e-4
