"""Defences found by an adversarial pass: each test fails without its fix.

Text that is not valid Unicode, bodies over the cap however they are framed, prompts too long to
tokenize on the event loop, requests that would create too many sequences, loose logit_bias
keys, and small responses held back by Nagle's algorithm.
"""

from __future__ import annotations

import json
import socket
import statistics
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"


def _read_response(sock: socket.socket, buffer: bytearray) -> bytes:
    """One HTTP/1.1 response with a Content-Length from a keep-alive socket; returns its body."""
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    del buffer[:]
    buffer += rest
    while len(buffer) < length:
        buffer += sock.recv(65536)
    body = bytes(buffer[:length])
    del buffer[:length]
    return body


def test_small_responses_are_not_delayed_by_nagle(server):
    # The client disables Nagle itself, so a delay can only come from the server's side.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()
        buffer = bytearray()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            sock.sendall(request)
            assert b"ok" in _read_response(sock, buffer)
            times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.005, times


def test_logit_bias_keys_are_strict_and_all_reported(server):
    bad = [" 7", "+7", "7_0", "\u0667", "7 ", "-1", "0x7", ""]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {**dict.fromkeys(bad, 1), "7": 1, "8": 500}}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logit_bias"
    for key in bad:
        assert f'"{key}"' in error["message"], (key, error["message"])
    assert '"8": 500' in error["message"]
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "logit_bias": {"7": 1, "007": -1}}
    assert httpx.post(server.url + "/v1/completions", json=ok, headers=server.headers, timeout=30).status_code == 200


def _post_json(server, path: str, body: dict, **kw) -> httpx.Response:
    # json.dumps escapes lone surrogates as "\ud800", as a client's JSON encoder may send them.
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={**server.headers, "Content-Type": "application/json"}, **kw)


LONE = "x \ud800 y"
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b", LONE], "max_tokens": 2}, "prompt[2]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": ["ok", "\udfff"]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": [
        {"type": "text", "text": LONE}]}], "max_tokens": 2, "stream": True}, "messages[1].content[0].text"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES, ids=[c[2] + c[0] for c in SURROGATE_CASES])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(server, openai_schemas, path, body, param):
    r = _post_json(server, path, body)
    assert r.status_code == 400, r.text
    openai_schemas.validate("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "surrogate" in error["message"] and error["message"].startswith(param), error


def test_lone_surrogate_in_other_fields_is_never_a_500(server):
    r = _post_json(server, "/v1/completions", {"prompt": "hi", "temperature": "\ud800"})
    assert r.status_code == 400, r.text
    assert '"\\ud800"' in r.json()["error"]["message"]  # the bad value quoted as an escape
    r = _post_json(server, "/v1/completions", {"prompt": "hi", "logit_bias": {"\ud800": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "surrogate" in r.json()["error"]["message"]


def test_chunked_body_over_the_cap_is_a_413(server, openai_schemas):
    from pagedlm.server.app import MAX_BODY_BYTES

    sent = 0

    def chunks():  # no Content-Length: httpx sends a generator with Transfer-Encoding: chunked
        nonlocal sent
        yield b'{"prompt": "'
        piece = b"a" * 2**20
        while sent < MAX_BODY_BYTES + 6 * 2**20:
            sent += len(piece)
            yield piece
        yield b'", "max_tokens": 1}'

    try:
        r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                       headers={**server.headers, "Content-Type": "application/json"})
    except httpx.TransportError as e:  # e.g. it read the whole body and is still parsing it
        pytest.fail(f"no 413 after {sent} bytes sent: {e!r}")
    assert r.status_code == 413, r.text[:300]
    openai_schemas.validate("ErrorResponse", r.json())
    assert str(MAX_BODY_BYTES) in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_sequences_are_bounded(server):
    # the shared server runs with the default --max-num-seqs=256, hence 256 sequences per request
    body = {"model": MODEL, "prompt": ["hi there"] * 1000, "n": 128, "max_tokens": 4}
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "prompt" and "128000" in error["message"] and "256" in error["message"], error
    assert "--max-request-sequences" in error["message"]
    assert time.monotonic() - start < 5
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ["hi"] * 3}, headers=server.headers,
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ok = {**body, "prompt": ["hi"] * 2, "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=ok, headers=server.headers, timeout=60).status_code == 200


def test_long_text_is_refused_before_tokenization_and_health_stays_responsive(server):
    import threading

    limit = 32 * 512  # MAX_CHARS_PER_TOKEN x max_model_len of the shared server
    answers: dict[str, httpx.Response] = {}

    def send(name: str, path: str, body: dict) -> None:
        answers[name] = httpx.post(server.url + path, json=body, headers=server.headers, timeout=120)

    huge = "lorem ipsum " * (20 * 2**20 // 12)  # 20 MB: seconds of tokenizing, were it allowed
    maximal = "lorem ipsum " * (limit // 12)  # the longest text accepted: tokenized, then too many tokens
    senders = [
        threading.Thread(target=send, args=("huge", "/v1/completions", {"prompt": huge, "max_tokens": 1})),
        threading.Thread(target=send, args=("chat", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": huge[: limit + 1]}], "max_tokens": 1})),
        *[threading.Thread(target=send, args=(f"max{i}", "/v1/completions", {
            "prompt": [maximal] * 8, "max_tokens": 1})) for i in range(4)],
    ]
    for t in senders:
        t.start()
    latencies = []
    while any(t.is_alive() for t in senders):
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    for t in senders:
        t.join()
    assert max(latencies) < 1.0, latencies
    for name, param in (("huge", "prompt"), ("chat", "messages")):
        error = answers[name].json()["error"]
        assert answers[name].status_code == 400 and error["param"] == param, error
        assert f"at most {limit} are accepted" in error["message"] and "max_model_len=512" in error["message"]
    for i in range(4):
        error = answers[f"max{i}"].json()["error"]
        assert error["param"] == "prompt[0]" and "tokens" in error["message"], error


def test_retrieve_model(server, openai_schemas, client):
    r = httpx.get(server.url + f"/v1/models/{MODEL}", headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    openai_schemas.validate("Model", r.json())
    assert r.json()["id"] == MODEL and r.json()["max_model_len"] == 512
    assert client.models.retrieve(MODEL).id == MODEL
    for unknown in ("gpt-4", "org/name"):
        r = httpx.get(server.url + f"/v1/models/{unknown}", headers=server.headers, timeout=10)
        assert r.status_code == 404, r.text
        openai_schemas.validate("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "model_not_found" and unknown in r.json()["error"]["message"]
    assert httpx.get(server.url + f"/v1/models/{MODEL}", timeout=10).status_code == 401


def test_tokenize_token_strs(server):
    def tokenize(**kw):
        r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world", **kw}, headers=server.headers,
                       timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    assert tokenize()["token_strs"] is None
    assert tokenize(return_token_strs=False)["token_strs"] is None
    body = tokenize(return_token_strs=True)
    assert len(body["token_strs"]) == body["count"] and all(isinstance(t, str) for t in body["token_strs"])
    decoded = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, headers=server.headers,
                         timeout=10).json()["prompt"]
    assert "hello" in decoded
