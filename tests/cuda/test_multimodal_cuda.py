"""Images on the CUDA backend: tiny Gemma 3 (bidirectional attention within an image, through the
Triton kernel's spans) and LLaVA-1.5 checkpoints give HF transformers' greedy tokens (fp32), with
prefix caching (the same prompts twice: the second round hits the cache), without it, and with
chunked prefill. Under ``TRITON_INTERPRET=1`` the same runs on the CPU with the Triton backend and
the CUDA model runner (graphs emulated: conftest's ``engine_kwargs``)."""

from __future__ import annotations

import os

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing.multimodal import hf_multimodal_greedy, load_hf_vlm, random_image

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGES = [random_image(0, (80, 60)), random_image(1, (40, 70)), random_image(2, (28, 28))]
PROMPTS = {
    "gemma3": [
        ("The quick <start_of_image> brown fox jumps over", [IMAGES[0]]),
        ("The quick <start_of_image> brown fox jumps over", [IMAGES[1]]),
        ("Once <start_of_image> upon a time <start_of_image> there lived", [IMAGES[1], IMAGES[2]]),
    ],
    "llava": [
        ("The quick <image> brown fox jumps over the lazy dog.", [IMAGES[0]]),
        ("The quick <image> brown fox jumps over the lazy dog.", [IMAGES[1]]),
        ("Once <image> upon a time <image> there lived", [IMAGES[1], IMAGES[2]]),
    ],
}
MODES = {"default": {}, "no-prefix-cache": {"enable_prefix_caching": False}, "chunked": {"max_num_batched_tokens": 24}}


@pytest.fixture(scope="module", params=["gemma3", "llava"])
def family(request, tiny_gemma3_vision, tiny_llava):
    model = tiny_gemma3_vision if request.param == "gemma3" else tiny_llava
    prompts = PROMPTS[request.param]
    return model, prompts, hf_multimodal_greedy(*load_hf_vlm(model), prompts, MAX_NEW)


@pytest.mark.parametrize("mode", list(MODES))
def test_images_match_hf_greedy_twice(family, mode, engine_kwargs):
    model, prompts, reference = family
    options = {**engine_kwargs, "max_model_len": 256, "block_size": 16, **MODES[mode]}
    llm = LLM(model=model, dtype="float32", **options)
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]
    try:
        for _ in range(2):
            outs = llm.generate(requests, GREEDY, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == reference
        if mode != "no-prefix-cache":
            assert all(o.num_cached_tokens >= len(o.prompt_token_ids) - 16 for o in outs)
    finally:
        llm.shutdown()
    assert reference[0] != reference[1]  # two images, two answers
