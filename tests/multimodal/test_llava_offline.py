"""LLaVA through ``LLM``: HF's greedy tokens for prompts with one and two images (of different
sizes), with and without prefix caching, with chunked prefill splitting an image's placeholders,
through ``llm.chat`` with data URLs; bad inputs are ValueErrors that leave the engine running."""

from __future__ import annotations

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing.multimodal import data_url, hf_multimodal_greedy, random_image

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGES = [random_image(0, (80, 60)), random_image(1, (40, 70)), random_image(2, (56, 56))]
# one image, the same text with another image, two images of different sizes, text first
PROMPTS = [
    ("The quick <image> brown fox jumps over the lazy dog.", [IMAGES[0]]),
    ("The quick <image> brown fox jumps over the lazy dog.", [IMAGES[1]]),
    ("Once <image> upon a time <image> there lived", [IMAGES[1], IMAGES[2]]),
    ("<image>\nWhat is in this picture?", [IMAGES[0]]),
]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _requests(prompts):
    return [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts]


@pytest.fixture(scope="module")
def reference(hf_llava):
    return hf_multimodal_greedy(*hf_llava, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def llm(tiny_llava):
    return LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, block_size=4,
               limit_mm_per_prompt={"image": 2})


def test_matches_hf_and_prefix_cache_hits_only_the_same_image(llm, reference):
    first = llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)
    assert _tokens(first) == reference
    assert reference[0] != reference[1]  # the image changes the continuation
    # The second round hits the prefix cache, through the images, and still matches.
    second = llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)
    assert _tokens(second) == reference
    num_prompt = [len(o.prompt_token_ids) for o in second]
    assert all(o.num_cached_tokens >= n - 4 for o, n in zip(second, num_prompt))
    # Same text, an image never seen: only the blocks before the image are shared.
    other = llm.generate(_requests([(PROMPTS[0][0], [random_image(9, (80, 60))])]), GREEDY, use_tqdm=False)[0]
    image_offset = other.prompt_token_ids.index(511)
    assert other.num_cached_tokens <= image_offset
    assert list(other.outputs[0].token_ids) not in (reference[0], reference[1])


def test_token_id_prompts_take_one_placeholder_per_image(llm, reference, tiny_llava):
    tokenizer = llm.get_tokenizer()
    text, images = PROMPTS[2]
    ids = tokenizer(text).input_ids
    assert ids.count(511) == 2
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
    assert _tokens(out) == [reference[2]]


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    # 16 placeholder tokens per image: 5-token steps split every image across three steps
    dict(max_num_batched_tokens=5, enable_prefix_caching=True),
])
def test_no_prefix_caching_and_chunked_prefill_through_images(tiny_llava, reference, options):
    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20, block_size=4,
              max_model_len=128, **options)
    assert _tokens(llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)) == reference
    assert _tokens(llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)) == reference


def test_chat_with_data_urls_string_and_openai_templates(llm, hf_llava):
    message = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
        {"type": "text", "text": "Describe the picture."},
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[1], "JPEG")}},
    ]}]
    tokenizer = llm.get_tokenizer()
    # the test tokenizer's template prints content: the placeholders go before the text
    out = llm.chat(message, GREEDY, use_tqdm=False)[0]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<image>\n<image>\nDescribe the picture."}],
                                         tokenize=False, add_generation_prompt=True)
    assert out.prompt == text
    from PIL import Image

    jpeg = Image.open(__import__("io").BytesIO(__import__("base64").b64decode(
        data_url(IMAGES[1], "JPEG").split(",", 1)[1]))).convert("RGB")
    expected = hf_multimodal_greedy(*hf_llava, [(text, [IMAGES[0], jpeg])], MAX_NEW, add_special_tokens=False)
    assert list(out.outputs[0].token_ids) == expected[0]
    # a template that iterates over content parts gets them, an image part where each image was
    parts_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{% for p in m['content'] %}"
                      "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}<|end|>\n"
                      "{% endfor %}<|assistant|>\n")
    out = llm.chat(message, GREEDY, use_tqdm=False, chat_template=parts_template)[0]
    assert out.prompt == "<s><|user|>\n<image>Describe the picture.<image><|end|>\n<|assistant|>"
    expected = hf_multimodal_greedy(*hf_llava, [(out.prompt, [IMAGES[0], jpeg])], MAX_NEW, add_special_tokens=False)
    assert list(out.outputs[0].token_ids) == expected[0]


@pytest.mark.parametrize(("prompt", "match"), [
    ({"prompt": "a <image> b <image>", "multi_modal_data": {"image": [IMAGES[0]]}},
     r"2 image placeholder\(s\).*has 1 image"),
    ({"prompt": "a <image> b <image> <image>", "multi_modal_data": {"image": IMAGES}},
     r"multi_modal_data\['image'\] has 3 items but limit_mm_per_prompt allows at most 2"),
    ({"prompt": "a <image>", "multi_modal_data": {"image": ["not an image"]}}, r"must be a PIL.Image.Image"),
    ({"prompt": "a <image>", "multi_modal_data": {"video": [IMAGES[0]]}}, r"multi_modal_data\['video'\]"),
    ({"prompt": "no data <image>"}, r"image placeholder token\(s\).*but no multi_modal_data"),
])
def test_bad_prompts_are_value_errors(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(("url", "match"), [
    ("data:image/png;base64,aGVsbG8gd29ybGQ=", r"content\[0\]: image_url .*cannot decode the image"),
    ("data:image/png;base64,@@@", r"invalid base64"),
    ("file:///etc/passwd", r"local files are not allowed.*--allowed-local-media-path"),
    ("http://example.com/cat.png", r"fetching from 'example.com' is not allowed.*--allowed-media-domains"),
    ("ftp://example.com/cat.png", r"scheme 'ftp' is not supported"),
])
def test_bad_image_urls_are_value_errors_and_the_engine_keeps_running(llm, reference, url, match):
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match=match):
        llm.chat(message, GREEDY, use_tqdm=False)
    assert _tokens(llm.generate(_requests(PROMPTS[:1]), GREEDY, use_tqdm=False)) == reference[:1]


def test_local_files_under_the_allowed_directory(tiny_llava, tmp_path, hf_llava):
    allowed = tmp_path / "media"
    allowed.mkdir()
    IMAGES[0].save(allowed / "cat.png")
    (tmp_path / "outside.png").write_bytes((allowed / "cat.png").read_bytes())
    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, block_size=4,
              allowed_local_media_path=str(allowed))

    def chat(path):
        return llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}},
                                                      {"type": "text", "text": "hi"}]}], GREEDY, use_tqdm=False)[0]

    out = chat(allowed / "cat.png")
    assert list(out.outputs[0].token_ids) == hf_multimodal_greedy(*hf_llava, [(out.prompt, [IMAGES[0]])], MAX_NEW,
                                                                  add_special_tokens=False)[0]
    for path in (tmp_path / "outside.png", allowed / ".." / "outside.png"):
        with pytest.raises(ValueError, match="outside allowed_local_media_path"):
            chat(path)


def test_text_models_refuse_images(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20)
    with pytest.raises(ValueError, match="is not a multimodal model"):
        llm.generate([{"prompt": "a <image>", "multi_modal_data": {"image": IMAGES[0]}}], GREEDY, use_tqdm=False)


def test_chat_falls_back_to_the_processors_template(tiny_llava, tmp_path):
    """As llava-hf's checkpoints: the chat template ships with the processor, not the tokenizer."""
    import json
    import shutil

    model = tmp_path / "llava"
    shutil.copytree(tiny_llava, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    processor_config = json.loads((model / "processor_config.json").read_text())
    processor_config["chat_template"] = (
        "{% for m in messages %}USER: {% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
        "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %} ASSISTANT:")
    (model / "processor_config.json").write_text(json.dumps(processor_config))
    llm = LLM(model=str(model), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    assert not llm.get_tokenizer().chat_template
    message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                                            {"type": "text", "text": "hi"}]}]
    assert llm.chat(message, GREEDY, use_tqdm=False)[0].prompt == "USER: <image>\nhi ASSISTANT:"


def test_preemption_recomputes_images(tiny_llava, reference):
    # 16 blocks of 4 tokens hold one or two of these requests at a time: the others are preempted
    # (their encoder references dropped) and recomputed from their images when they resume.
    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=16,
              max_model_len=64, max_num_batched_tokens=16)
    assert _tokens(llm.generate(_requests(PROMPTS), GREEDY, use_tqdm=False)) == reference
    assert llm.llm_engine.core.scheduler.num_preemptions_total > 0


def test_processor_cache_serves_repeated_images(tiny_llava, reference):
    """vLLM's processor cache (``mm_processor_cache_gb``): an image seen before is not
    preprocessed again for token-id and chat prompts, and gives the same tokens; 0 turns it off;
    a negative size is refused by name."""
    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              limit_mm_per_prompt={"image": 2})
    try:
        processor = llm.llm_engine.processor.mm_processor
        calls = []
        original = type(processor).image_processor.fget

        def counting(self):
            inner = original(self)

            def call(images, **kw):
                calls.append(len(images))
                return inner(images, **kw)
            return call

        type(processor).image_processor = property(counting)
        try:
            ids = llm.get_tokenizer()(PROMPTS[2][0]).input_ids
            for _ in range(2):
                out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": PROMPTS[2][1]}}], GREEDY,
                                   use_tqdm=False)
                assert _tokens(out) == [reference[2]]
            # one image new, one seen: only the new one is preprocessed
            llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [IMAGES[1], IMAGES[0]]}}],
                         GREEDY, use_tqdm=False)
        finally:
            type(processor).image_processor = property(original)
        assert calls == [2, 1]
        assert (processor.cache_queries, processor.cache_hits) == (6, 3)
    finally:
        llm.shutdown()
    off = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              mm_processor_cache_gb=0)
    try:
        text, images = PROMPTS[0]
        ids = off.get_tokenizer()(text).input_ids
        for _ in range(2):
            out = off.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], GREEDY,
                               use_tqdm=False)
            assert _tokens(out) == [reference[0]]
        assert off.llm_engine.processor.mm_processor.cache_hits == 0
    finally:
        off.shutdown()
    with pytest.raises(ValueError, match=r"mm_processor_cache_gb=-1 must be a number >= 0"):
        LLM(model=tiny_llava, dtype="float32", device="cpu", mm_processor_cache_gb=-1)
