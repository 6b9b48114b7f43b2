"""`pagedlm serve --stream-interval 3`: streamed responses carry several tokens per chunk and add
up to the non-streamed response (driven by the official `openai` client)."""

from __future__ import annotations

import openai
import pytest
from server_harness import API_KEY

MODEL = "tiny-llama"
NUM_TOKENS = 10
INTERVAL = 3


@pytest.fixture(scope="module")
def interval_client(start_server, tiny_llama):
    server = start_server(tiny_llama, "--max-model-len", "512", "--served-model-name", MODEL,
                          "--stream-interval", str(INTERVAL))
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


def test_completion_stream_with_interval(interval_client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=NUM_TOKENS, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True})
    full = interval_client.completions.create(**args).choices[0]
    chunks = list(interval_client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == full.text
    # every token (and its logprob) arrives once; the first at once, then at least 3 per chunk
    tokens = [t for c in choices for t in c.logprobs.tokens]
    assert tokens == full.logprobs.tokens and len(tokens) == NUM_TOKENS
    assert len(choices) <= 1 + -(-(NUM_TOKENS - 1) // INTERVAL) < NUM_TOKENS
    assert choices[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == NUM_TOKENS


def test_chat_stream_with_interval(interval_client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=NUM_TOKENS,
                temperature=0, extra_body={"ignore_eos": True})
    full = interval_client.chat.completions.create(**args).choices[0].message.content
    chunks = list(interval_client.chat.completions.create(**args, stream=True))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(contents) == full
    assert len(contents) <= 1 + -(-(NUM_TOKENS - 1) // INTERVAL)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
