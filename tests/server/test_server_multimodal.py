"""Images on /v1/chat/completions of a LLaVA server through the openai client: HF's greedy tokens,
streamed and not; bad image parts get a 400 naming them and the server keeps serving."""

from __future__ import annotations

import openai
import pytest
from server_harness import API_KEY

from pagedlm.core.testing.multimodal import data_url, hf_multimodal_greedy, random_image

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llava"
IMAGE = random_image(3, (64, 48))


@pytest.fixture(scope="module")
def llava_server(start_server, tiny_llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    IMAGE.save(media / "cat.png")
    server = start_server(tiny_llava, "--max-model-len", "256", "--served-model-name", MODEL,
                          "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media))
    return server, media


@pytest.fixture(scope="module")
def llava_client(llava_server):
    server, media = llava_server
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client, media


def _messages(*urls, text="What is this?"):
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


def test_images_give_hf_tokens(llava_client, hf_llava, tiny_llava):
    client, media = llava_client
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava)
    second = random_image(4, (30, 90))
    for urls, images in (([data_url(IMAGE)], [IMAGE]), ([data_url(IMAGE), f"file://{media / 'cat.png'}"],
                                                         [IMAGE, IMAGE]), ([data_url(second)], [second])):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "\n".join(["<image>"] * len(images) + ["What is this?"])}],
            tokenize=False, add_generation_prompt=True)
        expected = hf_multimodal_greedy(*hf_llava, [(text, images)], 6, add_special_tokens=False)[0]
        reply = client.chat.completions.create(model=MODEL, messages=_messages(*urls), max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.choices[0].token_ids == expected
        assert reply.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids) + 15 * len(images)
        stream = client.chat.completions.create(model=MODEL, messages=_messages(*urls), max_tokens=6, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == reply.choices[0].message.content


@pytest.mark.parametrize(("urls", "words"), [
    (["data:image/png;base64,aGVsbG8="], ["messages[0].content[0]", "cannot decode the image"]),
    ([data_url(IMAGE)] * 3, ["3 items", "limit_mm_per_prompt allows at most 2"]),
    (["file:///etc/hostname"], ["outside allowed_local_media_path"]),
    (["https://example.com/a.png"], ["not allowed", "--allowed-media-domains"]),
    (["gopher://x/y"], ["scheme 'gopher' is not supported"]),
])
def test_bad_images_are_400_and_the_server_keeps_serving(llava_client, urls, words):
    client, _ = llava_client
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_messages(*urls), max_tokens=2)
    assert all(w in e.value.message for w in words), e.value.message
    ok = client.chat.completions.create(model=MODEL, messages=_messages(data_url(IMAGE)), max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_tokenize_expands_the_images_as_the_engine_does(llava_server, llava_client):
    """/tokenize of a conversation with images: the ids a chat completion of it runs (each image's
    placeholder expanded, to 16 tokens each here); a bad image part is a 400 naming it."""
    import httpx

    server, _ = llava_server
    client, _ = llava_client
    messages = _messages(data_url(IMAGE), data_url(random_image(5, (20, 20))))
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=server.headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"return_token_ids": True})
    assert tokens == reply.prompt_token_ids and tokens.count(511) == 32
    bad = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": _messages("gopher://x/y")},
                     headers=server.headers, timeout=60)
    assert bad.status_code == 400 and "messages[0].content[0]" in bad.text


def test_batch_endpoint_takes_images(llava_server, llava_client):
    """/v1/chat/completions/batch: conversations with and without images, each answered as its
    own chat completion would be; a bad image part is a 400 naming its conversation."""
    import httpx

    server, _ = llava_server
    client, _ = llava_client
    conversations = [_messages(data_url(IMAGE)), [{"role": "user", "content": "Hello there"}],
                     _messages(data_url(random_image(6, (33, 44))), data_url(IMAGE))]
    extra = {"ignore_eos": True, "return_token_ids": True}
    expected = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=5, temperature=0,
                                               extra_body=extra).choices[0].token_ids for m in conversations]
    r = httpx.post(server.url + "/v1/chat/completions/batch", headers=server.headers, timeout=60,
                   json={"model": MODEL, "messages": conversations, "max_tokens": 5, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == expected
    bad = httpx.post(server.url + "/v1/chat/completions/batch", headers=server.headers, timeout=60,
                     json={"model": MODEL, "messages": [conversations[1], _messages("gopher://x/y")], "max_tokens": 2})
    assert bad.status_code == 400 and "messages[1][0].content[0]" in bad.text, bad.text


def test_placeholder_in_text_without_images_is_400(llava_client):
    client, _ = llava_client
    with pytest.raises(openai.BadRequestError, match="image placeholder token"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "look: <image>"}],
                                       max_tokens=2)


def test_text_model_server_refuses_image_parts(client):
    with pytest.raises(openai.BadRequestError, match="image_url parts need a multimodal model"):
        client.chat.completions.create(model="tiny-llama", messages=_messages(data_url(IMAGE)), max_tokens=2)


def _embeds_part(tensor) -> dict:
    import base64
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return {"type": "image_embeds", "image_embeds": base64.b64encode(buffer.getvalue()).decode()}


@pytest.fixture(scope="module")
def image_embeddings(tiny_llava):
    """The model's own encoder output for IMAGE, ``[feature_size, hidden]``."""
    import torch

    from pagedlm.core import LLM

    llm = LLM(model=tiny_llava, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    try:
        processor = llm.llm_engine.processor.mm_processor
        pixel_values = processor.image_processor([IMAGE], return_tensors="pt")["pixel_values"]
        model = llm.llm_engine.core.executor.worker.model_runner.model
        with torch.inference_mode():
            return model.embed_multimodal("image", pixel_values=pixel_values)[0].clone()
    finally:
        llm.shutdown()


def test_image_embeds_parts_give_the_images_tokens(start_server, tiny_llava, llava_client, image_embeddings):
    """vLLM's ``image_embeds`` parts (with --enable-mm-embeds): the image's own embeddings give its
    tokens; the server without the option answers 400 naming it."""
    client, _ = llava_client
    extra = {"ignore_eos": True, "return_token_ids": True}
    messages = [{"role": "user", "content": [_embeds_part(image_embeddings), {"type": "text", "text": "What?"}]}]
    with pytest.raises(openai.BadRequestError, match="--enable-mm-embeds"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    expected = client.chat.completions.create(model=MODEL, messages=_messages(data_url(IMAGE), text="What?"),
                                              max_tokens=6, temperature=0, extra_body=extra).choices[0].token_ids
    server = start_server(tiny_llava, "--max-model-len", "256", "--served-model-name", MODEL, "--enable-mm-embeds")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as embeds_client:
        reply = embeds_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                      extra_body=extra)
        assert reply.choices[0].token_ids == expected
        mixed = [{"role": "user", "content": [_embeds_part(image_embeddings),
                                              {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]
        for bad, words in ((mixed, "cannot be mixed"),
                           ([{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "bm9wZQ=="}]}],
                            "not a base64 torch.save()d tensor"),
                           ([{"role": "user", "content": [_embeds_part(image_embeddings[:-1])]}],
                            "embeddings must be a floating-point tensor")):
            with pytest.raises(openai.BadRequestError) as e:
                embeds_client.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)
            assert words in e.value.message, e.value.message
