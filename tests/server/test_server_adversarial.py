"""A bounded adversarial pass (the longer one is ``PAGEDLM_FUZZ_EXAMPLES=2000`` on the schema fuzz
of test_server_errors.py): deeply nested JSON, every field at its type's edges, many concurrent
slow clients. Nothing may give a 5xx, and the server must keep answering others meanwhile."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
INT64 = 2**63


def post(server, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_is_a_400(server, openai_schemas, depth):
    for body in (b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
                 b'{"prompt": "hi", "logit_bias": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}",
                 b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"):
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = post(server, path, body)
            assert r.status_code == 400, (depth, r.text[:200])
            openai_schemas.validate("ErrorResponse", r.json())
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


EDGES = [
    *[{k: v} for k in ("n", "max_tokens", "seed", "top_k", "min_tokens", "logprobs", "prompt_logprobs",
                       "truncate_prompt_tokens", "best_of")
      for v in (-INT64 - 1, -INT64, -1, 0, INT64 - 1, INT64, 2**64, 1e308, -0.0, 1.5)],
    *[{k: v} for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                       "repetition_penalty") for v in (5e-324, -5e-324, 1e-300, 1e308, -1e308, 2.0, 0)],
    {"stop_token_ids": [INT64]}, {"stop_token_ids": [2**64]}, {"stop_token_ids": [-1]},
    {"logit_bias": {str(2**64): 1}}, {"logit_bias": {"1": 1e308}}, {"logit_bias": {"1": -5e-324}},
    {"stop": ["x" * 100_000]}, {"stop": [""]}, {"stop": "\x00"}, {"prompt": "\x00\x01"}, {"prompt": [INT64]},
    {"prompt": [[1], [2**64]]}, {"user": "u" * 1_000_000}, {"model": "m" * 1_000_000},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
]


@pytest.mark.parametrize("edge", EDGES, ids=[str(e)[:48] for e in EDGES])
def test_fields_at_their_type_edges_are_never_a_server_error(server, edge):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **edge}
    r = post(server, "/v1/completions", body)
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert set(r.json()) == {"error"} and len(r.text) < 10_000, r.text[:300]  # nothing echoed in full
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **{k: v for k, v in edge.items() if k != "prompt"}}
    assert post(server, "/v1/chat/completions", chat).status_code < 500


def test_many_concurrent_slow_clients_do_not_starve_the_others(server):
    socks = []
    try:
        for i in range(150):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 3 == 0:  # headers never finished (slowloris)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            elif i % 3 == 1:  # a body that never arrives in full
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + server.api_key.encode() + b"\r\nContent-Length: 100000\r\n\r\n"
                          b'{"prompt": "')
            else:  # a chunked body that stops mid-chunk
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          b"Authorization: Bearer " + server.api_key.encode() + b"\r\n\r\n400\r\n{\"pro")
            socks.append(s)
        for _ in range(5):
            start = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - start < 1.0
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "still here?", "max_tokens": 3})
        assert r.status_code == 200, r.text
        for s in socks[::2]:  # a trickle: one more byte each, then nothing
            s.sendall(b"a")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        for s in socks:
            s.close()
    # the abandoned requests left nothing running in the engine
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pagedlm:num_requests_running"] == 0 and m["pagedlm:num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    assert m["pagedlm:num_requests_running"] == 0 and m["pagedlm:num_requests_waiting"] == 0
