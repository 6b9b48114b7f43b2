"""vLLM's GET /load (--enable-server-load-tracking) and GET /tokenizer_info
(--enable-tokenizer-info-endpoint), on a real `pagedlm serve`."""

from __future__ import annotations

import time

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(300)


def get(server, path: str, **kwargs) -> httpx.Response:
    return httpx.get(server.url + path, headers=server.headers, timeout=30, **kwargs)


def wait_for_load(server, expected: int) -> int:
    deadline = time.monotonic() + 10
    while (load := get(server, "/load").json()["server_load"]) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return load


def test_load_counts_requests_in_flight_streams_until_their_end(flagged_server, server):
    assert get(flagged_server, "/load").json() == {"server_load": 0}
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    for srv, counted in ((flagged_server, 1), (server, 0)):
        with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                          headers=srv.headers, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # NOTE: kept, as dropping it would close the connection
            next(lines)  # streaming has begun
            assert get(srv, "/load").json()["server_load"] == counted
        # the client went away mid-stream: the server aborts the request and stops counting it
        assert wait_for_load(srv, 0) == 0
    done = httpx.post(flagged_server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                      headers=flagged_server.headers, timeout=60)
    assert done.status_code == 200 and get(flagged_server, "/load").json()["server_load"] == 0
    refused = httpx.post(flagged_server.url + "/v1/completions", json={**body, "max_tokens": -1},
                         headers=flagged_server.headers, timeout=60)
    assert refused.status_code == 400 and get(flagged_server, "/load").json()["server_load"] == 0
    # /load is open, as /health is, for load balancers
    assert httpx.get(flagged_server.url + "/load", timeout=30).status_code == 200


def test_tokenizer_info_is_the_tokenizers_configuration(flagged_server, server, tiny_llama):
    info = get(flagged_server, "/tokenizer_info").json()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert not [key for key in info if key.endswith("_file")]  # the server's file paths stay private
    decoder = info["added_tokens_decoder"]
    assert decoder[str(tokenizer.eos_token_id)]["content"] == tokenizer.eos_token
    assert decoder[str(tokenizer.eos_token_id)]["special"] is True
    assert info["model_max_length"] >= get(flagged_server, "/v1/models").json()["data"][0]["max_model_len"]
    off = get(server, "/tokenizer_info")
    assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.json()["error"]["message"]
    assert httpx.get(flagged_server.url + "/tokenizer_info", timeout=30).status_code == 401  # behind the API key
