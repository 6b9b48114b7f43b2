"""/v1/embeddings and /pooling of a pooling model's server, with the openai client; a generative
model's server refuses them by name (and a pooling model's server refuses completions and chat)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from server_harness import API_KEY

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Hello there", "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def embed_server(start_server, tiny_st_qwen3):
    return start_server(tiny_st_qwen3, "--runner", "pooling", "--served-model-name", "tiny-embed",
                        "--max-model-len", "256")


@pytest.fixture(scope="module")
def embed_client(embed_server):
    with openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_st_qwen3):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(tiny_st_qwen3, device="cpu").encode(TEXTS, convert_to_numpy=True)


def test_openai_client_embeddings_equal_sentence_transformers(embed_client, embed_server, reference, openai_schemas):
    result = embed_client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    assert [d.index for d in result.data] == [0, 1] and result.usage.prompt_tokens == result.usage.total_tokens > 0
    # the openai client asks for base64 by default and decodes it
    default = embed_client.embeddings.create(model="tiny-embed", input=TEXTS[0])
    np.testing.assert_allclose(default.data[0].embedding, reference[0], atol=1e-5, rtol=0)
    raw = httpx.post(embed_server.url + "/v1/embeddings", headers=embed_server.headers, timeout=60,
                     json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, reference[1], atol=1e-5, rtol=0)
    openai_schemas.validate("CreateEmbeddingResponse", result.model_dump())


def test_token_id_inputs_and_pooling_route(embed_server, reference):
    tokens = httpx.post(embed_server.url + "/tokenize", headers=embed_server.headers,
                        json={"prompt": TEXTS[0]}).json()["tokens"]
    for body in ({"input": tokens}, {"input": [tokens, tokens]}):
        r = httpx.post(embed_server.url + "/v1/embeddings", headers=embed_server.headers, json=body, timeout=60)
        assert r.status_code == 200, r.text
        for item in r.json()["data"]:
            np.testing.assert_allclose(item["embedding"], reference[0], atol=1e-5, rtol=0)
    r = httpx.post(embed_server.url + "/pooling", headers=embed_server.headers, json={"input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["data"] for d in r.json()["data"]], reference, atol=1e-5, rtol=0)
    assert httpx.post(embed_server.url + "/pooling", json={"input": "x"}).status_code == 401  # the API key


def test_refusals(embed_client, embed_server, client):
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka") as e:
        embed_client.embeddings.create(model="tiny-embed", input="hi", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match="is a pooling .* does not support the Completions API"):
        embed_client.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not support the Chat Completions API"):
        embed_client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="input=\\[\\] is invalid"):
        embed_client.embeddings.create(model="tiny-embed", input=[])
    # the shared server runs a generative model
    with pytest.raises(openai.BadRequestError, match="is a generative model and does not support the Embeddings"):
        client.embeddings.create(model="tiny-llama", input="hi")
