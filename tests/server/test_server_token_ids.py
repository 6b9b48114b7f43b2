"""``return_token_ids`` (vLLM's extension): token ids beside the text, streamed and not.

Placement as vLLM's: completions carry ``prompt_token_ids`` and ``token_ids`` on every choice;
chat carries ``prompt_token_ids`` at the top level of the response (in a stream: of its first
chunk) and ``token_ids`` on every choice. Without the flag the fields are there, null. A chunk of
tokens that decode to no text still goes out, with its ids, and all of one engine delta's ids go
in one chunk.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from server_harness import COMPLETION_CHUNK
from test_engine_client import FakeEngine

from pagedlm.core.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
IDS = {"return_token_ids": True, "ignore_eos": True}


def post(server, path: str, body: dict):
    import httpx

    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def sse_events(server, path: str, body: dict) -> list[dict]:
    import httpx

    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_token_ids(server, client, openai_schemas):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=IDS)
    choice = out.choices[0]
    assert len(choice.token_ids) == 8 == out.usage.completion_tokens
    assert choice.prompt_token_ids == post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": choice.token_ids}).json()["prompt"] == choice.text
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                             **IDS}).json()
    openai_schemas.validate("CreateCompletionResponse", body)
    assert body["choices"][0]["token_ids"] == choice.token_ids
    # without the flag the fields are there, null, as vLLM sends them
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}).json()
    openai_schemas.validate("CreateCompletionResponse", plain)
    c = plain["choices"][0]
    assert c["text"] == choice.text
    assert c["token_ids"] is None and c["prompt_token_ids"] is None and c["prompt_logprobs"] is None


def test_completion_stream_token_ids(server, client, openai_schemas):
    prompts = [[1, 17, 42, 99, 7], [1, 5, 6]]
    args = dict(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, n=2, extra_body=IDS)
    full = client.completions.create(**args)
    expected = {c.index: c.token_ids for c in full.choices}
    assert sorted(expected) == [0, 1, 2, 3] and all(len(ids) == 10 for ids in expected.values())
    streamed: dict[int, list[int]] = defaultdict(list)
    prompt_ids: dict[int, list[list[int] | None]] = defaultdict(list)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            assert c.token_ids, "every chunk of a choice carries the ids of its delta"
            streamed[c.index] += c.token_ids
            prompt_ids[c.index].append(c.prompt_token_ids)
    assert streamed == expected
    for index, seen in prompt_ids.items():
        # the first chunk of each choice has its prompt's ids (choice i * n + j is of prompt i)
        assert seen[0] == prompts[index // 2] and all(p is None for p in seen[1:])
    assert chunks[-1].usage.completion_tokens == sum(len(ids) for ids in streamed.values())
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 6, "stream": True, **IDS}
    events = sse_events(server, "/v1/completions", body)
    for event in events:
        openai_schemas.validate(COMPLETION_CHUNK, event)
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 6
    plain = sse_events(server, "/v1/completions", {**body, "return_token_ids": False})
    assert all(e["choices"][0]["token_ids"] is None and e["choices"][0]["prompt_token_ids"] is None for e in plain)


def test_chat_token_ids(server, client, openai_schemas):
    messages = [{"role": "user", "content": "Say hi"}]
    args = dict(model=MODEL, messages=messages, max_completion_tokens=9, temperature=0, extra_body=IDS)
    full = client.chat.completions.create(**args)
    rendered = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert full.prompt_token_ids == rendered and len(full.choices[0].token_ids) == 9
    body = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 9,
                                                  "temperature": 0, **IDS}).json()
    openai_schemas.validate("CreateChatCompletionResponse", body)
    assert body["choices"][0]["token_ids"] == full.choices[0].token_ids
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].prompt_token_ids == rendered and chunks[0].choices[0].delta.role == "assistant"
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == full.choices[0].token_ids
    events = sse_events(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 9,
                                                          "stream": True, **IDS})
    for event in events:
        openai_schemas.validate("CreateChatCompletionStreamResponse", event)
    plain = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}).json()
    openai_schemas.validate("CreateChatCompletionResponse", plain)
    assert plain["prompt_token_ids"] is None and plain["prompt_logprobs"] is None
    assert plain["choices"][0]["token_ids"] is None
    plain_events = sse_events(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                "max_tokens": 4, "stream": True})
    assert "prompt_token_ids" in plain_events[0] and plain_events[0]["prompt_token_ids"] is None
    assert all(e["choices"][0]["token_ids"] is None for e in plain_events[1:])


class DeltaEngine(FakeEngine):
    """Streams deltas of several tokens each, none of which decodes to text (as dummy weights or
    a server without a tokenizer do), then a last one with text."""

    DELTAS = [[11, 12, 13], [14], [15, 16], [17]]

    async def generate(self, prompt, sampling_params, request_id, *, add_special_tokens: bool = True,
                       lora_request=None, priority: int = 0):
        ids = prompt["prompt_token_ids"]
        for k, delta in enumerate(self.DELTAS):
            last = k == len(self.DELTAS) - 1
            yield RequestOutput(request_id=request_id, prompt=prompt["prompt"], prompt_token_ids=ids,
                                prompt_logprobs=None, finished=last,
                                outputs=[CompletionOutput(index=0, text="!" if last else "", token_ids=delta,
                                                          cumulative_logprob=None, logprobs=None,
                                                          finish_reason="length" if last else None)])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_one_chunk_per_delta_with_all_its_ids(path, monkeypatch):
    from fastapi.testclient import TestClient

    import pagedlm.server.serving_chat as serving_chat
    from pagedlm.server.app import build_app
    from pagedlm.server.serving_common import ServerState

    # the fake has no tokenizer, so no chat template: the messages render as fixed ids
    monkeypatch.setattr(serving_chat, "render_chat", lambda *a, **k: ("hi", [3, 4]))
    client = TestClient(build_app(ServerState(engine=DeltaEngine(), served_model_names=["fake"])))
    body: dict = {"model": "fake", "max_tokens": 7, "stream": True, "return_token_ids": True}
    chat = path == "/v1/chat/completions"
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [3, 4]})
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n")[:-1] if e != "data: [DONE]"]
    if chat:
        assert events[0]["prompt_token_ids"] == [3, 4]
        events = events[1:]
    else:
        assert events[0]["choices"][0]["prompt_token_ids"] == [3, 4]
    assert [e["choices"][0]["token_ids"] for e in events] == DeltaEngine.DELTAS
    texts = [e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"] for e in events]
    assert texts == ["", "", "", "!"]
