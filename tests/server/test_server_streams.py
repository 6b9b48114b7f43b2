"""The shape of streams, as OpenAI and vLLM send them.

One choice per chunk (so that a client reading ``chunk.choices[0]`` sees every choice's text and
finish reason), the chat role chunk per choice, and ``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from server_harness import COMPLETION_CHUNK

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"


def sse_events(server, path: str, body: dict) -> list[dict]:
    import httpx

    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_sends_one_choice_per_chunk(server, client, openai_schemas):
    args = dict(model=MODEL, prompt=["one", "two"], n=3, max_tokens=6, temperature=1.0, seed=3,
                extra_body={"ignore_eos": True})
    full = {c.index: c.text for c in client.completions.create(**args).choices}
    events = sse_events(server, "/v1/completions", {**{k: v for k, v in args.items() if k != "extra_body"},
                                                     "ignore_eos": True, "stream": True})
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    for event in events:
        openai_schemas.validate(COMPLETION_CHUNK, event)
        assert len(event["choices"]) == 1, event
        choice = event["choices"][0]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert dict(texts) == full
    assert finishes == dict.fromkeys(range(6), "length")
    # what a client that reads choices[0] only sees: every choice's whole text
    seen: dict[int, str] = defaultdict(str)
    for chunk in client.completions.create(**args, stream=True):
        seen[chunk.choices[0].index] += chunk.choices[0].text
    assert dict(seen) == full


def test_chat_stream_sends_one_choice_per_chunk_and_a_role_chunk_per_choice(server, openai_schemas):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 5,
            "seed": 11, "ignore_eos": True, "stream": True}
    events = sse_events(server, "/v1/chat/completions", body)
    for event in events:
        openai_schemas.validate("CreateChatCompletionStreamResponse", event)
        assert len(event["choices"]) == 1, event
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role") == "assistant"]
    assert roles == [0, 1, 2]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:3])
    finished = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]
