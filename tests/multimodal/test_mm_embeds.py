"""Precomputed image embeddings in ``multi_modal_data`` (vLLM's ``enable_mm_embeds``): a tensor
``[num_items, feature_size, hidden_size]`` in place of the images gives the images' tokens (and
so HF's), text and token-id prompts, for LLaVA and for Gemma 3 (whose items attend to each other
both ways); equal embeddings share prefix-cache blocks; bad tensors are ValueErrors that name
the shape allowed, and the engine goes on."""

from __future__ import annotations

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing.multimodal import random_image

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IMAGES = [random_image(0, (80, 60)), random_image(1, (40, 70))]
PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>"}


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def family(request, tiny_llava, tiny_gemma3_vision):
    model = tiny_llava if request.param == "llava" else tiny_gemma3_vision
    llm = LLM(model=model, dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20, block_size=4,
              enable_mm_embeds=True)
    yield request.param, llm
    llm.shutdown()


def _embeddings(llm, images) -> torch.Tensor:
    """The model's own encoder output for ``images``: ``[len(images), feature_size, hidden]``."""
    runner = llm.llm_engine.core.executor.worker.model_runner
    processor = llm.llm_engine.processor.mm_processor
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        return torch.stack(runner.model.embed_multimodal("image", pixel_values=pixel_values.to(torch.float32)))


def _tokens(llm, prompt, items):
    out = llm.generate([{**prompt, "multi_modal_data": {"image": items}}], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out


def test_embeddings_give_the_images_tokens(family):
    name, llm = family
    text = f"Once {PLACEHOLDER[name]} upon a time {PLACEHOLDER[name]} there lived"
    embeds = _embeddings(llm, IMAGES)
    with_images, image_out = _tokens(llm, {"prompt": text}, IMAGES)
    with_embeds, embed_out = _tokens(llm, {"prompt": text}, embeds)
    assert with_embeds == with_images
    assert embed_out.prompt_token_ids == image_out.prompt_token_ids
    # token-id prompts: one placeholder per item, expanded as for images
    ids = llm.get_tokenizer()(text).input_ids
    assert _tokens(llm, {"prompt_token_ids": ids}, embeds)[0] == with_images
    # the same embeddings again hit the prefix cache through the items; other embeddings do not
    again, out = _tokens(llm, {"prompt": text}, embeds.clone())
    assert again == with_images and out.num_cached_tokens >= len(out.prompt_token_ids) - 4
    other, out = _tokens(llm, {"prompt": text}, embeds.flip(0))
    first_item = out.prompt_token_ids.index(llm.llm_engine.processor.mm_processor.image_token_id)
    assert out.num_cached_tokens <= first_item and other != with_images


def test_bad_embeddings_are_refused_by_name(family, tiny_llava):
    name, llm = family
    text = f"A {PLACEHOLDER[name]} b"
    embeds = _embeddings(llm, IMAGES[:1])
    length, hidden = embeds.shape[1:]
    cases = [
        (embeds[:, :-1], rf"must be a floating-point tensor \[num_items, {length}, {hidden}\]"),
        (embeds[..., :-1], rf"\[num_items, {length}, {hidden}\]"),
        (embeds.to(torch.int64), "floating-point"),
        (torch.full_like(embeds, float("nan")), "NaN or infinite"),
        (torch.cat([embeds, embeds]), r"2 image\(s\)"),
        ([embeds[0], IMAGES[0]], "not mixed with images"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([{"prompt": text, "multi_modal_data": {"image": value}}], GREEDY, use_tqdm=False)
    # the engine goes on
    assert len(_tokens(llm, {"prompt": text}, embeds)[0]) == GREEDY.max_tokens


def test_embeddings_need_enable_mm_embeds(tiny_llava):
    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    try:
        embeds = _embeddings(llm, IMAGES[:1])
        with pytest.raises(ValueError, match=r"needs enable_mm_embeds=True \(--enable-mm-embeds\)"):
            llm.generate([{"prompt": "A <image> b", "multi_modal_data": {"image": embeds}}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
