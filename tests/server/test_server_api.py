"""The OpenAI API of `pagedlm serve`, driven by the official `openai` client (sync and async).

Every response body is also fetched raw and validated against OpenAI's published schemas.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_harness import API_KEY, COMPLETION_CHUNK

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def sse_events(server, path: str, body: dict) -> list[str]:
    """The raw ``data:`` payloads of a streamed response, checking the SSE framing on the way."""
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), raw[:500]
    return [e[len("data: "):] for e in events]


def test_models_health_version(server, client, openai_schemas):
    assert [m.id for m in client.models.list().data] == [MODEL]
    body = httpx.get(server.url + "/v1/models", headers=server.headers, timeout=10).json()
    openai_schemas.validate("ListModelsResponse", body)
    assert body["data"][0]["max_model_len"] == 512
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]


def test_completion(server, client, openai_schemas):
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8,
                                             "temperature": 0, "ignore_eos": True}).json()
    openai_schemas.validate("CreateCompletionResponse", body)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == body["choices"][0]["text"]
    assert out.choices[0].finish_reason == "length"
    count = post(server, "/tokenize", {"prompt": "The quick brown fox"}).json()["count"]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (count, 8, count + 8)


def test_completion_stream_matches_non_stream(server, client, openai_schemas):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/completions", body)
    for event in events[:-1]:
        openai_schemas.validate(COMPLETION_CHUNK, json.loads(event))
    assert events[-1] == "[DONE]"


def test_chat_and_chat_stream(server, client, openai_schemas):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    body = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 12,
                                                  "temperature": 0}).json()
    openai_schemas.validate("CreateChatCompletionResponse", body)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert full.choices[0].message.content == body["choices"][0]["message"]["content"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    count = post(server, "/tokenize", {"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == count
    raw = sse_events(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 12,
                                                       "stream": True, "stream_options": {"include_usage": True}})
    for event in raw[:-1]:
        openai_schemas.validate("CreateChatCompletionStreamResponse", json.loads(event))


def test_n_with_seed(client):
    args = dict(model=MODEL, prompt="Random words:", max_tokens=12, temperature=1.0, n=3, seed=1234,
                extra_body={"ignore_eos": True})
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 36
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2, seed=5)
    a, b = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # streamed n > 1: every choice gets its own role delta and its own finish
    chunks = list(client.chat.completions.create(**chat, stream=True))
    finished = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finished == [0, 1]
    streamed = ["".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == i) for i in (0, 1)]
    assert streamed == [c.message.content for c in a.choices]


def test_logprobs(server, client, openai_schemas):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert value == pytest.approx(max(top.values()))
        assert chosen in top
    assert lp.text_offset[0] == len("Hello")
    body = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                                                  "temperature": 0}).json()
    openai_schemas.validate("CreateChatCompletionResponse", body)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
               for c in content)
    hi = [{"role": "user", "content": "Hi"}]
    events = sse_events(server, "/v1/chat/completions", {"model": MODEL, "messages": hi, "max_tokens": 4,
                                                          "logprobs": True, "top_logprobs": 2, "stream": True,
                                                          "temperature": 0})
    streamed = [t for e in events[:-1] for ch in json.loads(e)["choices"] if ch["logprobs"]
                for t in ch["logprobs"]["content"]]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    for e in events[:-1]:
        openai_schemas.validate("CreateChatCompletionStreamResponse", json.loads(e))


def test_stop_strings_streamed_and_not(client):
    args = dict(model=MODEL, prompt="The quick brown", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**args).choices[0].text
    stop = text[6:9]
    assert stop
    out = client.completions.create(**args, stop=[stop, "never-matches"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True))
    assert streamed == out.choices[0].text


def test_echo_and_prompt_forms(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert out.choices[0].text.startswith("Echo me")
    out = client.completions.create(model=MODEL, prompt=["first", "second"], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    single = client.completions.create(model=MODEL, prompt="second", max_tokens=3, temperature=0)
    assert by_index[2] == single.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    lists = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=4, temperature=0)
    assert lists.choices[0].text == ids.choices[0].text and len(lists.choices) == 2
    assert ids.usage.prompt_tokens == 4 and lists.usage.prompt_tokens == 6


def test_echo_with_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, echo=True, logprobs=1,
                                    temperature=0)
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2
    # as OpenAI does: the first prompt token has no logprob
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_tokenize_detokenize(server):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "hello world", "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 512
    assert post(server, "/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": "hello world"}
    with_bos = post(server, "/tokenize", {"prompt": "hello world"}).json()
    assert with_bos["count"] == r["count"] + 1


def test_vllm_extensions(server, client):
    out = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=10, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 10, "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 10
    first = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    tokens = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    assert "".join(tokens) == first.choices[0].text
    # logit_bias (OpenAI) pushes one token to the top under greedy decoding
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Z", "add_special_tokens": False},
                     headers=server.headers, timeout=10).json()
    biased = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0,
                                       logit_bias={str(tok["tokens"][0]): 100})
    assert biased.choices[0].text == "ZZZ"


def test_async_client_concurrent(server):
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as ac:
            async def chat(i: int) -> str:
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=8,
                    temperature=0, stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            async def complete(i: int) -> str:
                out = await ac.completions.create(model=MODEL, prompt=f"number {i}", max_tokens=8, temperature=0)
                return out.choices[0].text

            return await asyncio.gather(*[chat(i) for i in range(4)], *[complete(i) for i in range(4)])

    results = asyncio.run(run())
    assert len(results) == 8 and all(isinstance(r, str) for r in results)


def test_metrics_and_stats_log(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4, temperature=0)
    m = server.metrics()
    for name in ("pagedlm:num_requests_running", "pagedlm:num_requests_waiting", "pagedlm:kv_cache_usage_perc",
                 "pagedlm:prefix_cache_queries_total", "pagedlm:prefix_cache_hits_total",
                 "pagedlm:num_preemptions_total", "pagedlm:prompt_tokens_total", "pagedlm:generation_tokens_total",
                 "pagedlm:request_success_total[length]", "pagedlm:request_success_total[stop]",
                 "pagedlm:time_to_first_token_seconds_count", "pagedlm:inter_token_latency_seconds_count",
                 "pagedlm:e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["pagedlm:prompt_tokens_total"] > 0 and m["pagedlm:generation_tokens_total"] >= 4
    assert m["pagedlm:request_success_total[length]"] >= 1
    assert m["pagedlm:e2e_request_latency_seconds_count"] >= 1
    assert m["pagedlm:prefix_cache_queries_total"] > 0
    assert 0.0 <= m["pagedlm:kv_cache_usage_perc"] <= 1.0
    # the stats line comes from a timer (--log-stats-interval 1): within a few intervals
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Avg generation throughput" in server.log()


def test_sagemaker_invocations_route_by_the_body(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    completion = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    for body, route in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        direct, invoked = post(server, route, body).json(), post(server, "/invocations", body).json()
        assert invoked["object"] == direct["object"] and invoked["choices"] == direct["choices"], invoked
    streamed = sse_events(server, "/invocations", {**completion, "stream": True})
    # the server may send the 4 tokens in one chunk: a completion chunk, then [DONE]
    assert streamed[-1] == "[DONE]" and json.loads(streamed[0])["object"] == "text_completion"
    for body, param in (({"max_tokens": 4}, "messages"), ({**completion, "max_tokens": "x"}, "max_tokens")):
        r = post(server, "/invocations", body)
        assert r.status_code == 400 and param in json.dumps(r.json()["error"]), r.text
    r = httpx.post(server.url + "/invocations", content=b"{not json", headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert httpx.post(server.url + "/invocations", json=chat, timeout=30).status_code == 401  # behind the API key
