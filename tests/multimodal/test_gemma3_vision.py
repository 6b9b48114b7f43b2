"""Gemma 3 with images through ``LLM``: HF's greedy tokens and prompt logprobs (which see the
bidirectional attention within an image), with prefix caching, with chunked prefill (never inside
an image), token-id prompts, chat with data URLs."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing.multimodal import data_url, hf_multimodal_greedy, load_hf_vlm, random_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGES = [random_image(0, (80, 60)), random_image(1, (40, 70)), random_image(2, (28, 28))]
PROMPTS = [
    ("The quick <start_of_image> brown fox jumps over", [IMAGES[0]]),
    ("The quick <start_of_image> brown fox jumps over", [IMAGES[1]]),
    ("Once <start_of_image> upon a time <start_of_image> there lived", [IMAGES[1], IMAGES[2]]),
]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _requests(prompts):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]


@pytest.fixture(scope="module")
def hf(tiny_gemma3_vision):
    return load_hf_vlm(tiny_gemma3_vision)


@pytest.fixture(scope="module")
def reference(hf):
    return hf_multimodal_greedy(*hf, PROMPTS, MAX_NEW)


def _llm(model, **options):
    return LLM(model=model, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, block_size=4,
               max_model_len=128, **options)


@pytest.mark.parametrize("options", [dict(), dict(enable_prefix_caching=False), dict(max_num_batched_tokens=6)])
def test_matches_hf_greedy_twice(tiny_gemma3_vision, reference, options):
    llm = _llm(tiny_gemma3_vision, **options)
    assert _tokens(llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)) == reference
    second = llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)
    assert _tokens(second) == reference
    if options.get("enable_prefix_caching", True):
        assert all(o.num_cached_tokens >= len(o.prompt_token_ids) - 4 for o in second)
    assert reference[0] != reference[1]


def test_prompt_logprobs_match_hf_bidirectional_image_attention(tiny_gemma3_vision, hf):
    """Every prompt position's logprob equals HF's, whose image tokens attend to each other both
    ways: a causal-only image would be off by about 1 here."""
    model, processor = hf
    text, images = PROMPTS[2]
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        ref = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0].tolist()
    llm = _llm(tiny_gemma3_vision, max_num_batched_tokens=8)  # chunks end before and after images
    out = llm.generate(_requests([PROMPTS[2]]), SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    ours = [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i > 0]
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert ours == pytest.approx(expected, abs=1e-4)


def test_token_ids_and_chat(tiny_gemma3_vision, hf, reference):
    llm = _llm(tiny_gemma3_vision)
    tokenizer = llm.get_tokenizer()
    text, images = PROMPTS[2]
    ids = tokenizer(text).input_ids  # one <start_of_image> per image: expanded as HF's processor does
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
    assert _tokens(out) == [reference[2]]
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                                            {"type": "text", "text": "Describe it."}]}]
    reply = llm.chat(message, GREEDY, use_tqdm=False)[0]
    assert reply.prompt.count("<start_of_image>\nDescribe it.") == 1
    expected = hf_multimodal_greedy(*hf, [(reply.prompt, [IMAGES[0]])], MAX_NEW, add_special_tokens=False)
    assert _tokens([reply]) == expected


def test_a_step_budget_smaller_than_an_image_is_refused(tiny_gemma3_vision):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3 is smaller than one image \(4 tokens\)"):
        _llm(tiny_gemma3_vision, max_num_batched_tokens=3)
