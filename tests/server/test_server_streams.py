"""The shape of streams, as OpenAI and vLLM send them.

One choice per chunk (so that a client reading ``chunk.choices[0]`` sees every choice's text and
finish reason), the chat role chunk per choice, and ``stream_options.continuous_usage_stats``.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from server_harness import COMPLETION_CHUNK
from test_engine_client import FakeEngine

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


class CachedEngine(FakeEngine):
    """Reports a prefix-cache hit of ``cached`` tokens on every request."""

    cached = 0

    async def generate(self, prompt, sampling_params, request_id, *, add_special_tokens: bool = True,
                       lora_request=None, priority: int = 0):
        async for out in super().generate(prompt, sampling_params, request_id):
            out.num_cached_tokens = self.cached
            yield out


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("cached", [0, 16])
def test_prompt_tokens_details_only_with_the_option_and_then_always(enabled, cached):
    from fastapi.testclient import TestClient

    from pagedlm.server.app import build_app
    from pagedlm.server.serving_common import ServerState

    engine = CachedEngine()
    engine.cached = cached
    client = TestClient(build_app(ServerState(engine=engine, served_model_names=["fake"],
                                              enable_prompt_tokens_details=enabled)))
    body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 1}
    usages = [client.post("/v1/completions", json=body).json()["usage"]]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(e[len("data: "):]) for e in r.read().decode().split("\n\n")[:-1] if e != "data: [DONE]"]
    usages.append(events[-1]["usage"])
    for u in usages:
        if enabled:
            assert u["prompt_tokens_details"] == {"cached_tokens": cached}, u
        else:
            assert "prompt_tokens_details" not in u, u


def test_prompt_tokens_details_and_forced_usage_options(flagged_server):
    import httpx

    prompt = "The same long prompt, repeated so that its blocks are cached: " * 4
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    first = httpx.post(flagged_server.url + "/v1/completions", json=body, headers=flagged_server.headers,
                       timeout=60).json()
    assert "prompt_tokens_details" in first["usage"], first
    again = httpx.post(flagged_server.url + "/v1/completions", json=body, headers=flagged_server.headers,
                       timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16, again["usage"]
    # --enable-force-include-usage: usage on every chunk and a usage chunk last, unasked
    events = sse_events(flagged_server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True,
        "stream": True})
    assert all(e["usage"] is not None for e in events), events
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, openai_schemas, path):
    chat = path.endswith("chat/completions")
    body: dict = {"model": MODEL, "max_tokens": 4, "n": 2, "seed": 1, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"})
    events = sse_events(server, path, body)
    schema = "CreateChatCompletionStreamResponse" if chat else COMPLETION_CHUNK
    so_far: dict[int, int] = defaultdict(int)
    for event in events[:-1]:
        if chat:
            openai_schemas.validate(schema, event)
        (choice,) = event["choices"]
        u = event["usage"]
        so_far[choice["index"]] = u["completion_tokens"]  # per choice, as vLLM counts
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    assert dict(so_far) == {0: 4, 1: 4}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    # without include_usage, continuous_usage_stats alone adds nothing (vLLM's reading)
    body["stream_options"] = {"continuous_usage_stats": True}
    assert all("usage" not in e or e["usage"] is None for e in sse_events(server, path, body))
