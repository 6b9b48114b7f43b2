"""Process lifecycle: engine-core death, SIGTERM draining, and start-up errors of `pagedlm serve`.

Each test that kills or stops a server starts its own (the shared one must outlive them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)


class StreamReader(threading.Thread):
    """Reads one streamed completion in the background; records events and how it ended."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            self.first.set()


def test_engine_death_fails_requests_and_health(start_server, tiny_llama):
    server = start_server(tiny_llama, "--max-model-len", "512", api_key=None)
    long = {"prompt": "Never stop", "max_tokens": 500, "ignore_eos": True}
    readers = [StreamReader(server.url, {**long, "stream": True}) for _ in range(2)]
    for r in readers:
        r.start()
    result: dict[str, httpx.Response] = {}
    blocking = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(server.url + "/v1/completions", json=long, timeout=60)), daemon=True)
    blocking.start()
    assert all(r.first.wait(60) for r in readers)
    os.kill(server.engine_pid, signal.SIGKILL)
    start = time.monotonic()

    deadline = start + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 after the engine core died"
        time.sleep(0.1)
    health = httpx.get(server.url + "/health", timeout=5).json()
    assert "died" in health["error"]["message"]
    for r in readers:
        r.join(20)
        assert not r.is_alive(), "a stream hung after the engine core died"
        assert r.error is None and r.events[-1] == "[DONE]"
        error = json.loads(r.events[-2])["error"]
        assert "engine" in error["message"] and "died" in error["message"]
    blocking.join(20)
    assert not blocking.is_alive(), "a non-streaming request hung after the engine core died"
    assert result["r"].status_code == 503 and "died" in result["r"].json()["error"]["message"]
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert after.status_code == 503
    assert server.stop() == 0


def test_sigterm_drains_in_flight_requests_and_exits_0(start_server, tiny_llama):
    server = start_server(tiny_llama, "--max-model-len", "512", api_key=None)
    reader = StreamReader(server.url, {"prompt": "Drain me", "max_tokens": 400, "ignore_eos": True,
                                       "stream": True, "stream_options": {"include_usage": True}})
    reader.start()
    assert reader.first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    assert len(reader.events) < 100, "the request was (nearly) done before SIGTERM: nothing was drained"
    # New connections are refused while the in-flight request finishes.
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(server.url + "/health", timeout=2)
        except (httpx.ConnectError, httpx.ReadError):
            # ReadError: the kernel had queued this connection just before the listener closed,
            # so it is reset unanswered (seen on a loaded machine): refused as well
            break
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.1)
    reader.join(60)
    assert reader.error is None and reader.events[-1] == "[DONE]"
    assert json.loads(reader.events[-2])["usage"]["completion_tokens"] == 400
    assert server.proc.wait(60) == 0
    assert "server stopped" in server.log()


def test_startup_errors_exit_2_with_a_message(tiny_llama, tmp_path, capsys):
    from pagedlm.core.cli import main

    def serve(*args: str) -> str:
        assert main(["serve", *args]) == 2
        return capsys.readouterr().err

    missing = tmp_path / "missing"
    assert "error: " in (err := serve(str(missing), "--device", "cpu")) and str(missing) in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in serve(tiny_llama, "--device", "cpu", "--port", str(port))
    assert "--chat-template" in serve(tiny_llama, "--chat-template", str(tmp_path / "nope.jinja"))
    # no MODEL and no default model installed: how to get one or pass MODEL (with one installed,
    # serve serves it: tests/server/test_server_default_model.py)
    import pagedlm.core.default_model as default_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(default_model, "default_model_offers", list)
        err = serve("--device", "cpu")
    assert "no model given" in err and "pagedlm-models-gemma[default-model]" in err, err
    # an engine that cannot start (one KV block for a 512-token context) says why
    err = serve(tiny_llama, "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "1", "--port", "0")
    assert "KV cache" in err
