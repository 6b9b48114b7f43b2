"""Bad input gets an OpenAI-shaped 4xx that names the parameter, the value and what is allowed.

Never a 500, a traceback or a hang: a table of hand-written cases, the openai client's exception
classes, the API-key gate, and a bounded schemathesis fuzz of the schema the app publishes.
"""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
HI = [{"role": "user", "content": "hi"}]


def cmpl(**kw):
    return {"model": MODEL, "prompt": "hello", **kw}


def chat(**kw):
    return {"model": MODEL, "messages": HI, **kw}


# (path, body (dict or raw bytes), status, param, words the message must contain)
CASES = [
    ("/v1/completions", b'{"prompt": "x", ', 400, None, ["not valid JSON"]),
    ("/v1/completions", b"[1, 2]", 400, None, ["must be a JSON object"]),
    ("/v1/completions", b"", 400, None, ["empty"]),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", ["prompt is required"]),
    ("/v1/completions", cmpl(temperature="hot"), 400, "temperature", ["temperature", '"hot"', "number"]),
    ("/v1/completions", cmpl(temperature=2.5), 400, "temperature", ["temperature=2.5", "less than or equal to 2"]),
    ("/v1/completions", cmpl(top_p=0), 400, "top_p", ["top_p=0", "greater than 0"]),
    ("/v1/completions", cmpl(n=0), 400, "n", ["n=0", "greater than or equal to 1"]),
    ("/v1/completions", cmpl(n=1.5), 400, "n", ["n=1.5", "integer"]),
    ("/v1/completions", cmpl(max_tokens=0), 400, "max_tokens", ["max_tokens=0", "greater than or equal to 1"]),
    ("/v1/completions", cmpl(max_tokens="5"), 400, "max_tokens", ["max_tokens", "integer"]),
    ("/v1/completions", cmpl(max_tokens=10_000), 400, "max_tokens", ["10000", "max_model_len=512", "at most"]),
    ("/v1/completions", cmpl(prompt=[1] * 600), 400, "prompt", ["600 tokens", "max_model_len=512", "at most 511"]),
    ("/v1/completions", cmpl(prompt=[1, "a"]), 400, "prompt", ["prompt=[1, \"a\"]", "list of token ids"]),
    ("/v1/completions", cmpl(prompt=[]), 400, "prompt", ["prompt=[]"]),
    ("/v1/completions", cmpl(prompt=""), 400, "prompt", ["empty"]),
    ("/v1/completions", cmpl(prompt=[99999]), 400, "prompt", ["99999", "vocabulary [0, 512)"]),
    ("/v1/completions", cmpl(prompt=["ok", ""]), 400, "prompt[1]", ["empty"]),
    ("/v1/completions", cmpl(stream=1), 400, "stream", ["stream=1", "boolean"]),
    ("/v1/completions", cmpl(stream_options={"include_usage": True}), 400, "stream_options", ["stream=true"]),
    ("/v1/completions", cmpl(stop=5), 400, "stop", ["stop=5", "a string or a list of strings"]),
    ("/v1/completions", cmpl(stop=[""]), 400, "stop", ["stop", "non-empty"]),
    ("/v1/completions", cmpl(logprobs=21), 400, "logprobs", ["logprobs=21", "at most 20", "--max-logprobs"]),
    ("/v1/completions", cmpl(logit_bias={"x": 1}), 400, "logit_bias", ['"x"', "token ids"]),
    ("/v1/completions", cmpl(logit_bias={"1": 101}), 400, "logit_bias", ["101", "[-100, 100]"]),
    ("/v1/completions", cmpl(logit_bias={"99999": 1}), 400, "logit_bias", ["99999", "vocabulary"]),
    ("/v1/completions", cmpl(presence_penalty=3), 400, "presence_penalty", ["presence_penalty=3"]),
    ("/v1/completions", cmpl(frequency_penalty=-3), 400, "frequency_penalty", ["frequency_penalty=-3"]),
    ("/v1/completions", cmpl(seed="x"), 400, "seed", ["seed", "integer"]),
    ("/v1/completions", cmpl(seed=2**70), 400, "seed", ["seed="]),
    ("/v1/completions", cmpl(top_k=-2), 400, "top_k", ["top_k=-2"]),
    ("/v1/completions", cmpl(min_p=1.5), 400, "min_p", ["min_p=1.5"]),
    ("/v1/completions", cmpl(repetition_penalty=0), 400, "repetition_penalty", ["repetition_penalty=0"]),
    ("/v1/completions", cmpl(min_tokens=9, max_tokens=3), 400, "min_tokens", ["min_tokens=9", "max_tokens=3"]),
    ("/v1/completions", cmpl(stop_token_ids=[-1]), 400, "stop_token_ids", ["stop_token_ids"]),
    ("/v1/completions", cmpl(suffix="x"), 400, "suffix", ["suffix"]),
    ("/v1/completions", cmpl(best_of=3), 400, "best_of", ["best_of=3"]),
    ("/v1/completions", cmpl(echo="yes"), 400, "echo", ["echo", "boolean"]),
    ("/v1/completions", cmpl(model="gpt-4"), 404, "model", ["gpt-4", "does not exist"]),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", ["messages is required"]),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages", ["messages=[]", "at least 1"]),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role",
     ["wizard", "'user'"]),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     ["messages[0].content=5", "a string or a list of content parts"]),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0].type", ["image_url", "text parts only"]),
    ("/v1/chat/completions", chat(messages=[{"content": "x"}]), 400, "messages[0].role",
     ["messages[0].role is required"]),
    ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs", ["logprobs=true"]),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=30), 400, "top_logprobs", ["top_logprobs=30"]),
    ("/v1/chat/completions", chat(max_completion_tokens=600), 400, "max_completion_tokens",
     ["600", "max_model_len=512"]),
    ("/v1/chat/completions", chat(max_tokens=-5), 400, "max_tokens", ["max_tokens=-5"]),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools[0]", ["tools[0]", "function"]),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), 400, "response_format.type",
     ["yaml", "json_schema"]),
    ("/v1/chat/completions", chat(model="other"), 404, "model", ["other"]),
    ("/tokenize", {"model": MODEL}, 400, "prompt", ["exactly one of prompt"]),
    ("/tokenize", {"prompt": 5}, 400, "prompt", ["prompt=5", "string"]),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens", ["100000", "vocabulary"]),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", ["tokens", "list"]),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", ["nope"]),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(server, openai_schemas, path, body, status, param, words):
    headers = dict(server.headers)
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={**headers, "Content-Type": "application/json"},
                       timeout=30)
    else:
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    openai_schemas.validate("ErrorResponse", error)
    message = error["error"]["message"]
    assert error["error"]["param"] == param, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert "Traceback" not in message


def test_wrong_content_type_and_methods(server, openai_schemas):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(cmpl()), headers={
        **server.headers, "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405),
                                 ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server.url + path, headers=server.headers, timeout=30)
        assert r.status_code == status
        openai_schemas.validate("ErrorResponse", r.json())


def test_openai_client_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert "max_model_len=512" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HI, temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HI)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize", "/metrics", "/v1/anything"])
def test_api_key_required(server, openai_schemas, path):
    method = "GET" if path in ("/v1/models", "/metrics", "/v1/anything") else "POST"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=30)
        assert r.status_code == 401, (path, headers, r.text)
        openai_schemas.validate("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "invalid_api_key"
    for path_open in ("/health", "/version"):
        assert httpx.get(server.url + path_open, timeout=30).status_code == 200


def test_openai_client_with_a_bad_key(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


# -- fuzzing ---------------------------------------------------------------------------------------
# Bounds that keep each fuzzed request cheap: big n or max_tokens are valid but only cost time;
# their edges are covered by the explicit cases above.
#: examples per generation mode: bounded here; PAGEDLM_FUZZ_EXAMPLES=2000 for a longer run by hand
FUZZ_EXAMPLES = int(os.environ.get("PAGEDLM_FUZZ_EXAMPLES", "60"))
_CLAMP = {"prompt_logprobs": 2, "logprobs": 2, "top_logprobs": 2, "truncate_prompt_tokens": 64, "n": 2,
          "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8}


def _cheap(case):
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODEL  # an unknown model stops at a 404 (tested above): go deeper
        for key, limit in _CLAMP.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = limit
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
            body["prompt"] = body["prompt"][:4]
        if case.path == "/v1/chat/completions/batch" and isinstance(body.get("messages"), list):
            body["messages"] = body["messages"][:4]
        if case.path.startswith("/v1/chat/completions") and body.get("max_tokens") is None:
            body.setdefault("max_completion_tokens", 8)  # chat's default is "the rest of the context"
    return case


@pytest.mark.timeout(600)
def test_fuzz_published_schema_no_server_errors(server):
    hypothesis = pytest.importorskip("hypothesis")
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", timeout=30)
    failures: list[str] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        strategy = schema.as_strategy(generation_mode=mode).map(_cheap)

        @hypothesis.given(case=strategy)
        @hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
        def run(case):
            response = case.call(base_url=server.url, headers=server.headers, timeout=60)
            body = response.text
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code} {body[:300]}")
            elif response.status_code >= 400:
                assert set(json.loads(body)) == {"error"}, body[:300]

        run()
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
