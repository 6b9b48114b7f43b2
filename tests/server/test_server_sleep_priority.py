"""A server with --scheduling-policy priority and --enable-sleep-mode: request priorities accepted,
/sleep, /wake_up and /is_sleeping (behind the API key), a request sent while asleep waits and then
gets the same greedy output; the shared (fcfs, no sleep mode) server refuses both by name."""

from __future__ import annotations

import threading

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

BODY = {"model": "tiny-llama", "prompt": [1, 17, 42, 99, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def sleepy_server(start_server, tiny_llama):
    return start_server(tiny_llama, "--max-model-len", "512", "--served-model-name", "tiny-llama",
                        "--scheduling-policy", "priority", "--enable-sleep-mode")


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=120, **kw)


def test_priority_is_accepted_and_refused_under_fcfs(sleepy_server, server):
    ok = post(sleepy_server, "/v1/completions", {**BODY, "priority": -5})
    assert ok.status_code == 200, ok.text
    chat = post(sleepy_server, "/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 2, "priority": 3,
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    refused = post(server, "/v1/completions", {**BODY, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "priority scheduling is not enabled" in refused.json()["error"]["message"]


def test_sleep_wake_up_and_a_request_while_asleep(sleepy_server):
    before = post(sleepy_server, "/v1/completions", BODY).json()["choices"][0]["text"]
    assert httpx.post(sleepy_server.url + "/sleep").status_code == 401  # the API key
    r = post(sleepy_server, "/sleep", params={"level": 1})
    assert r.status_code == 200, r.text
    assert httpx.get(sleepy_server.url + "/is_sleeping", headers=sleepy_server.headers).json() == {"is_sleeping": True}
    late: dict = {}
    waiting = threading.Thread(target=lambda: late.update(r=post(sleepy_server, "/v1/completions", BODY)))
    waiting.start()
    waiting.join(timeout=3)
    assert waiting.is_alive()  # held while the engine sleeps
    bad = post(sleepy_server, "/wake_up", params={"tags": "gpu"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
    assert post(sleepy_server, "/sleep", params={"level": 3}).status_code == 400
    r = post(sleepy_server, "/wake_up")
    assert r.status_code == 200 and r.json() == {"is_sleeping": False}, r.text
    waiting.join(timeout=60)
    assert late["r"].status_code == 200 and late["r"].json()["choices"][0]["text"] == before
    # level 2, woken in two steps
    assert post(sleepy_server, "/sleep", params={"level": 2}).status_code == 200
    assert post(sleepy_server, "/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
    assert post(sleepy_server, "/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
    assert post(sleepy_server, "/v1/completions", BODY).json()["choices"][0]["text"] == before


def test_sleep_routes_need_the_flag(server):
    for method, path in (("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")):
        r = getattr(httpx, method)(server.url + path, headers=server.headers)
        assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"], r.text
