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
def llava_client(start_server, tiny_llava, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    IMAGE.save(media / "cat.png")
    server = start_server(tiny_llava, "--max-model-len", "256", "--served-model-name", MODEL,
                          "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media))
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


def test_placeholder_in_text_without_images_is_400(llava_client):
    client, _ = llava_client
    with pytest.raises(openai.BadRequestError, match="image placeholder token"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "look: <image>"}],
                                       max_tokens=2)


def test_text_model_server_refuses_image_parts(client):
    with pytest.raises(openai.BadRequestError, match="image_url parts need a multimodal model"):
        client.chat.completions.create(model="tiny-llama", messages=_messages(data_url(IMAGE)), max_tokens=2)
