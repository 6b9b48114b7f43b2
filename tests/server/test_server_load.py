"""Load and disconnects: clients that go away are aborted in the engine and free their KV blocks.

The shared server is loaded with 64 concurrent streams, a quarter of which the client closes
mid-stream; the rest must finish cleanly, and afterwards the engine must be empty
(``num_requests_running`` 0, ``kv_cache_usage_perc`` 0), judged by /metrics.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import openai
import pytest
from server_harness import API_KEY

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
KEEP_TOKENS = 48
CLOSED_MAX_TOKENS = 400  # what a closed request would generate if it were not aborted


def wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["pagedlm:num_requests_running"] == 0 and m["pagedlm:num_requests_waiting"] == 0
                and m["pagedlm:kv_cache_usage_perc"] == 0.0)
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "bucket" not in k}
            return m
        time.sleep(0.1)


def test_64_streams_with_a_quarter_closed_mid_stream(server):
    before = wait_idle(server)

    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        close_early = i % 4 == 0
        stream = await ac.completions.create(
            model=MODEL, prompt=f"Request number {i} says", temperature=0.8, seed=i, stream=True,
            max_tokens=CLOSED_MAX_TOKENS if close_early else KEEP_TOKENS, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks, reason, usage = 0, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                chunks += 1
                reason = choice.finish_reason or reason
            if close_early and chunks >= 3:
                await stream.close()  # the client goes away mid-stream
                return "closed", chunks, None
        return "done", usage, reason

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as ac:
            return await asyncio.gather(*[one(ac, i) for i in range(64)])

    results = asyncio.run(run())
    done = [r for r in results if r[0] == "done"]
    assert len(done) == 48 and sum(r[0] == "closed" for r in results) == 16, results
    assert all(r[1] == KEEP_TOKENS and r[2] == "length" for r in done), done
    after = wait_idle(server)
    counts = {k: after[k] - before[k] for k in after if k.startswith("pagedlm:request_success_total")}
    # Every request is accounted for: the 48 kept ones finished by length; each closed one was
    # aborted, unless it finished before the server saw the client go (the core runs ahead of the
    # API process by the outputs still queued for it, by a lot on a loaded 2-core machine; seen:
    # 7 of 16 finished first). Nothing else may happen to them.
    aborted = counts["pagedlm:request_success_total[abort]"]
    finished_closed = counts["pagedlm:request_success_total[length]"] - 48
    assert aborted + finished_closed == 16 and sum(counts.values()) == 64, counts
    # An aborted request stopped short of its max_tokens, one that finished generated all of them.
    generated = after["pagedlm:generation_tokens_total"] - before["pagedlm:generation_tokens_total"]
    closed_generated = generated - 48 * KEEP_TOKENS
    assert closed_generated <= 16 * CLOSED_MAX_TOKENS - aborted, (generated, counts)
    assert closed_generated >= finished_closed * CLOSED_MAX_TOKENS, (generated, counts)
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-5000:]


def test_non_streaming_client_timeout_aborts(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        # NOTE: the tiny model can write 500 tokens in under 0.5 s on a quiet machine: a short read
        # timeout (and a normal connect timeout) keeps the request cut off mid-generation
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(5.0, read=0.1))
    after = wait_idle(server)
    assert after["pagedlm:request_success_total[abort]"] == before["pagedlm:request_success_total[abort]"] + 1
    assert after["pagedlm:generation_tokens_total"] - before["pagedlm:generation_tokens_total"] < 500


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads CPU time from /proc (Linux)")
def test_idle_engine_core_does_not_spin(server):
    wait_idle(server)
    time.sleep(0.5)
    pids = (server.engine_pid, server.proc.pid)
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(2.0)
    used = [_cpu_seconds(p) - b for p, b in zip(pids, before)]
    # Blocking on the input socket (core) and on the output pipe (API process) costs ~nothing.
    assert used[0] < 0.2 and used[1] < 0.3, used
