"""`pagedlm bench serve` against a small fake OpenAI-compatible SSE server on loopback.

The fake streams one ``data:`` chunk per token (a few ms apart), or ``tokens_per_chunk`` tokens
with their ``token_ids`` and no text (as a server with dummy weights and ``--stream-interval``
does), a usage chunk and ``[DONE]``, and answers every ``fail_every``-th request with HTTP 500, so
the load generator's metrics and error counting can be checked exactly. Everything is bounded: a
few dozen requests, seconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from pagedlm.core.cli import main

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


class FakeServer:
    def __init__(self, *, token_delay: float = 0.002, fail_every: int = 0, tokens_per_chunk: int = 0) -> None:
        self.token_delay = token_delay
        self.tokens_per_chunk = tokens_per_chunk  # 0: text chunks of one token, without token_ids
        self.fail_every = fail_every
        self.requests: list[dict] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body["max_tokens"])
            step = self.tokens_per_chunk or 1
            for i in range(0, n, step):
                await asyncio.sleep(self.token_delay)
                choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i + step >= n else None}
                if self.tokens_per_chunk:
                    choice.update(text="", token_ids=list(range(i, min(n, i + step))))
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            prompt = body["prompt"]
            usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else len(prompt.split()),
                     "completion_tokens": n, "total_tokens": n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self._in_flight -= 1

    def __enter__(self) -> FakeServer:
        self._thread.start()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)

        async def start() -> int:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer(fail_every=5) as server:
        yield server


def _run(argv: list[str], out_json) -> dict:
    assert main(argv + ["--output-json", str(out_json)]) == 0
    return json.loads(out_json.read_text())


def test_serve_metrics_errors_and_concurrency(fake_server, tmp_path, capsys):
    r = _run(["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "10", "--input-len", "12",
              "--output-len", "6", "--max-concurrency", "3", "--goodput", "ttft:10000", "e2e:20000"],
             tmp_path / "s.json")
    assert "pagedlm bench serve" in capsys.readouterr().out
    assert r["benchmark"] == "serve" and r["model"] == "fake-model"
    assert r["num_sent"] == 10 and r["completed"] == 8 and r["errors"] == 2 and r["cancelled"] == 0
    assert any("HTTP 500" in e for e in r["error_samples"])
    assert r["total_output_tokens"] == 8 * 6 and r["total_input_tokens"] == 8 * 12
    assert fake_server.max_in_flight <= 3 and r["peak_in_flight"] <= 3
    sent = fake_server.requests[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["return_token_ids"] is True
    assert isinstance(sent["prompt"], list) and len(sent["prompt"]) == 12 and sent["max_tokens"] == 6
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
        d = r[key]
        assert d["count"] == 8 and 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert r["itl_ms"]["count"] == 8 * 5
    assert r["ttft_ms"]["mean"] < r["e2e_latency_ms"]["mean"]
    assert r["tpot_ms"]["mean"] >= 1.0  # the fake waits 2 ms between tokens
    assert r["goodput"]["good_requests"] == 8 and r["request_throughput"] > 0 and r["output_throughput"] > 0
    # the fake sends no token_ids: one token per chunk with text
    assert r["tokens_counted_by"] == {"token_ids": 0, "text": 8, "none": 0} and r["output_len_mismatches"] == 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"median_{name}_ms"] is not None and r[f"p99_{name}_ms"] >= r[f"median_{name}_ms"] > 0
        assert r[f"std_{name}_ms"] >= 0
    assert r["mean_ttft_ms"] == pytest.approx(r["ttft_ms"]["mean"])


def test_serve_counts_token_ids_of_multi_token_chunks(tmp_path):
    """Chunks of 3 token ids and no text: ITL is per token (a chunk's gap shared by its tokens)."""
    with FakeServer(token_delay=0.02, tokens_per_chunk=3) as server:
        r = _run(["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--input-len", "3",
                  "--output-len", "7", "--metric-percentiles", "50,90"], tmp_path / "m.json")
    assert r["completed"] == 4 and r["completed_without_tokens"] == 0
    assert r["tokens_counted_by"]["token_ids"] == 4 and r["streamed_token_mismatches"] == 0
    assert r["total_output_tokens"] == 4 * 7 and r["output_len_mismatches"] == 0
    assert r["streamed_chunks"] == 4 * 3 and r["tokens_per_chunk"] == pytest.approx(7 / 3)
    assert r["ttft_ms"]["count"] == r["tpot_ms"]["count"] == 4
    # chunks of 3 + 3 + 1 tokens: 2 zero gaps after the first token, then 3 x gap/3 and 1 x gap
    assert r["itl_ms"]["count"] == 4 * 6 and r["itl_ms"]["min"] == 0.0
    assert 20 / 3 * 0.8 < r["median_itl_ms"] and r["itl_ms"]["max"] >= 20 * 0.8
    assert r["p50_itl_ms"] == r["median_itl_ms"] and "p90_ttft_ms" in r and "p99_ttft_ms" not in r
    # per token, the ITLs of a request add up to its time from the first token to the last
    assert r["mean_itl_ms"] * 6 == pytest.approx(r["mean_tpot_ms"] * 6, rel=0.3)


def test_serve_poisson_rate_text_prompts_and_duration_bound(tmp_path):
    with FakeServer(token_delay=0.05) as server:
        r = _run(["bench", "serve", "--base-url", server.url, "--num-prompts", "40", "--input-len", "5",
                  "--output-len", "100", "--request-rate", "50", "--prompt-format", "text", "--max-duration", "1.0",
                  "--workload-seed", "3"], tmp_path / "p.json")
    # 100 tokens x 50 ms = 5 s per request: nothing can finish within the 1 s bound.
    assert r["completed"] == 0 and r["cancelled"] == r["num_sent"] > 0
    assert r["num_sent"] + r["not_sent"] == 40 and r["duration_s"] < 5
    assert r["request_rate"] == 50 and isinstance(server.requests[0]["prompt"], str)


def test_serve_refuses_other_hosts_and_missing_servers(tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", "http://10.0.0.1:8000", "--num-prompts", "1"]) == 2
    assert "loopback" in capsys.readouterr().err
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    assert "/v1/models" in capsys.readouterr().err


def test_serve_launches_the_real_server(tiny_llama, tmp_path):
    """Dummy weights and no tokenizer: nothing streams as text, every token is timed by its id."""
    pytest.importorskip("pagedlm.server.app", reason="pagedlm-server is not installed")
    r = _run(["bench", "serve", "--launch", "--model", tiny_llama, "--device", "cpu", "--dtype", "float32",
              "--load-format", "dummy", "--skip-tokenizer-init", "--workload", "fixed",
              "--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--max-concurrency", "3",
              "--request-rate", "20", "--launch-timeout", "240", "--max-duration", "120"], tmp_path / "real.json")
    assert r["launched_server"] and r["base_url"].startswith("http://127.0.0.1:")
    assert r["completed"] == 6 and r["errors"] == 0, r["error_samples"]
    assert r["total_output_tokens"] == 6 * 8 and r["total_input_tokens"] == 6 * 16
    assert r["output_len_mismatches"] == 0 and r["streamed_token_mismatches"] == 0
    assert r["tokens_counted_by"] == {"token_ids": 6, "text": 0, "none": 0} and r["completed_without_tokens"] == 0
    assert r["e2e_latency_ms"]["count"] == r["ttft_ms"]["count"] == r["tpot_ms"]["count"] == 6
    assert r["itl_ms"]["count"] == 6 * 7
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"mean_{name}_ms"] > 0 and r[f"p99_{name}_ms"] >= r[f"median_{name}_ms"]
