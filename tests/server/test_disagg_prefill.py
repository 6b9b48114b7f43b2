"""Disaggregated prefill: a prefill `pagedlm serve` (P2pConnector, kv_producer), a decode one
(kv_consumer) and `pagedlm disagg-proxy` in front give the text one instance gives, for
concurrent requests, streamed or not; a dead instance fails a request with a clear error in time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import API_KEY, ROOT, free_port

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The quick brown fox jumps over the lazy dog " * 4, "Once upon a time in a land far away " * 5,
           "Tiny models say tiny things, " * 6]


def _p2p(role: str, port: int, **extra) -> str:
    return json.dumps({"kv_connector": "P2pConnector", "kv_role": role, "kv_port": port,
                       "kv_connector_extra_config": {"transfer_timeout_s": 3, **extra}})


class _Proxy:
    def __init__(self, prefill: str, decode: str, log_path, timeout: float = 20.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedlm.core.cli", "disagg-proxy", "--prefill", prefill,
                                      "--decode", decode, "--port", str(self.port), "--timeout", str(timeout)],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log_path.read_text()
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.url + "/v1/models", timeout=2, headers={"Authorization": f"Bearer {API_KEY}"})
                return
            time.sleep(0.2)
        raise TimeoutError(log_path.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def disagg(start_server, tiny_llama, tmp_path_factory):
    common = ("--max-model-len", "512", "--served-model-name", "tiny-llama")
    prefill = start_server(tiny_llama, *common, "--kv-transfer-config", _p2p("kv_producer", free_port()))
    decode = start_server(tiny_llama, *common, "--enable-prompt-tokens-details",
                          "--kv-transfer-config", _p2p("kv_consumer", free_port()))
    proxy = _Proxy(prefill.url, decode.url, tmp_path_factory.mktemp("proxy") / "proxy.log")
    yield prefill, decode, proxy
    proxy.stop()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _complete(url: str, prompt: str, stream: bool) -> tuple[str, int | None]:
    with _client(url) as client:
        if not stream:
            r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens \
                if r.usage.prompt_tokens_details else None
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        return text, None


def test_proxy_matches_one_instance_concurrently_streaming_included(server, disagg):
    prefill, decode, proxy = disagg
    expected = [_complete(server.url, p, stream=False)[0] for p in PROMPTS]
    jobs = [(p, s) for p in PROMPTS for s in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(proxy.url, *job)[0], jobs))
    assert got == [expected[PROMPTS.index(p)] for p, _ in jobs]
    # the decode instance loaded the prompts' KV instead of computing it, and says so
    _, cached = _complete(proxy.url, PROMPTS[2] + " once more", stream=False)
    assert cached is not None and cached >= 16
    metrics = decode.metrics()
    assert metrics["pagedlm:external_prefix_cache_hits_total"] >= 16 * len(PROMPTS)
    with _client(proxy.url) as client:
        chat = client.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": PROMPTS[0]}])
    with _client(server.url) as client:
        alone = client.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": PROMPTS[0]}])
    assert chat.choices[0].message.content == alone.choices[0].message.content


def test_prefill_response_carries_kv_transfer_params(disagg):
    prefill, _, _ = disagg
    r = httpx.post(prefill.url + "/v1/completions", headers=prefill.headers, timeout=60,
                   json={"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True}})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0 and params["remote_num_blocks"] >= 1


def test_dead_producer_fails_the_request_within_the_timeout(disagg):
    _, decode, _ = disagg
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
            "remote_request_id": "gone", "remote_num_blocks": 8, "remote_block_size": 16}
    start = time.monotonic()
    r = httpx.post(decode.url + "/v1/completions", headers=decode.headers, timeout=60,
                   json={"model": "tiny-llama", "prompt": "A prompt nobody prefilled " * 8, "max_tokens": 4,
                         "kv_transfer_params": dead})
    elapsed = time.monotonic() - start
    assert r.status_code == 500 and "no answer from the KV producer" in r.json()["error"]["message"], r.text
    assert elapsed < 3 + 10  # transfer_timeout_s plus slack for a loaded machine


def test_proxy_names_a_dead_prefill_instance(disagg):
    from fastapi.testclient import TestClient

    from pagedlm.server.disagg_proxy_app import build_proxy_app

    _, decode, _ = disagg
    dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_proxy_app(dead, decode.url, timeout_s=3)) as proxy:
        start = time.monotonic()
        r = proxy.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert time.monotonic() - start < 3 + 10
        assert r.status_code == 502 and f"prefill instance at {dead}" in r.json()["error"]["message"]
        assert proxy.post("/v1/completions", content=b"not json").status_code == 400


@pytest.mark.parametrize("params", [{"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "abc",
                                     "remote_request_id": "x", "remote_num_blocks": 4},
                                    {"do_remote_prefill": True, "remote_num_blocks": -1}])
def test_malformed_kv_transfer_params_compute_the_prompt_here(server, disagg, params):
    _, decode, _ = disagg
    body = {"model": "tiny-llama", "prompt": PROMPTS[0] + " again", "max_tokens": 6, "temperature": 0}
    r = httpx.post(decode.url + "/v1/completions", headers=decode.headers, timeout=60,
                   json={**body, "kv_transfer_params": params})
    alone = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    bad = httpx.post(decode.url + "/v1/completions", headers=decode.headers, timeout=60,
                     json={**body, "kv_transfer_params": "not an object"})
    assert bad.status_code == 400 and "kv_transfer_params" in bad.text
