"""``pagedlm run-batch``: an OpenAI batch file run offline through the server's own handlers,
each result equal to what `pagedlm serve` answers for the same request, bad lines failing alone."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 5, "temperature": 0}
LINES = [
    {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": COMPLETION},
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "bad-field", "method": "POST", "url": "/v1/completions", "body": {**COMPLETION, "max_tokens": -1}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/foo", "body": COMPLETION},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/completions", "body": {**COMPLETION, "stream": True}},
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}},
]


def run_batch(tiny_llama: str, tmp_path, lines: list[str], *extra: str) -> subprocess.CompletedProcess:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "pagedlm.core.cli", "run-batch", "-i", str(src), "-o", str(out),
                           tiny_llama, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", *extra],
                          capture_output=True, text=True, timeout=240)


def test_run_batch_answers_as_the_server_does(tiny_llama, tmp_path, server):
    done = run_batch(tiny_llama, tmp_path, [json.dumps(line) for line in LINES] + ["{not json"])
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in LINES] + [None]
    assert len({r["id"] for r in results}) == len(results)
    ok = {r["custom_id"]: r for r in results if r["error"] is None}
    assert set(ok) == {"c1", "chat"}
    for custom_id, path, body in (("c1", "/v1/completions", COMPLETION), ("chat", "/v1/chat/completions", CHAT)):
        served = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60).json()
        got = ok[custom_id]["response"]
        assert got["status_code"] == 200 and got["request_id"] == got["body"]["id"]
        assert got["body"]["choices"] == served["choices"] and got["body"]["usage"] == served["usage"]
    failed = {r["custom_id"]: r for r in results if r["error"] is not None}
    assert failed["bad-field"]["response"]["status_code"] == 400
    assert failed["bad-field"]["error"]["param"] == "max_tokens" and failed["bad-field"]["response"]["body"] is None
    assert "url='/v1/foo'" in failed["bad-url"]["error"]["message"]
    assert "stream" in failed["streamed"]["error"]["message"]
    assert failed["embed"]["response"]["status_code"] == 400  # a generative model serves no embeddings
    assert "line 7 is not valid JSON" in failed[None]["error"]["message"]


def test_run_batch_refuses_a_missing_input_before_loading(tiny_llama, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pagedlm.core.cli", "run-batch", "-i", str(tmp_path / "nope.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), tiny_llama], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--input-file" in done.stderr and "Traceback" not in done.stderr


def test_run_batch_serves_metrics_while_it_runs(tiny_llama, tmp_path):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {**COMPLETION, "max_tokens": 300, "ignore_eos": True}
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
             for i in range(32)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines))
    proc = subprocess.Popen([sys.executable, "-m", "pagedlm.core.cli", "run-batch", "-i", str(src), "-o", str(out),
                             tiny_llama, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                             "--enable-metrics", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    scraped = ""
    deadline = time.monotonic() + 200
    while proc.poll() is None and time.monotonic() < deadline and "request_success" not in scraped:
        try:
            scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            time.sleep(0.05)
    _, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err[-3000:]
    assert "pagedlm:num_requests_running" in scraped, scraped[:500]
    assert len(out.read_text().splitlines()) == 32
