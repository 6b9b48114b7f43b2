"""``pagedlm run-batch``: an OpenAI batch input file run offline, as vLLM's ``run-batch`` does.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``. Every line is sent to the
server's own FastAPI app in this process (no socket), so it is validated and answered exactly as
``pagedlm serve`` answers it; all lines are in flight at once and the engine batches them. The
output has one line per input line, in the input's order::

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"},
     "error": null}

A request that fails keeps its line: ``body`` is null and ``error`` holds the error object that
the server would have answered (a bad line of the file fails alone, the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
import uuid
from typing import Any

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

#: the routes a batch line may name (OpenAI's batch endpoints that pagedlm serves)
BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
#: an http(s) input file is read within this many seconds
FETCH_TIMEOUT_S = 60.0


def run_batch_file(args: argparse.Namespace) -> int:
    from pagedlm.server.launcher import _run_event_loop

    lines = read_input(args.input_file)  # before the model loads: a missing file fails at once
    if args.output_file != "-" and "://" in args.output_file:
        raise ValueError(f"--output-file={args.output_file!r}: the results are written to a local file (or '-')")
    return _run_event_loop(_run(args, lines))


def read_input(source: str) -> list[str]:
    """The non-blank lines of a local file or an http(s) URL."""
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=FETCH_TIMEOUT_S) as response:
                text = response.read().decode("utf-8")
        else:
            with open(source, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--input-file={source!r} cannot be read: {e}") from None
    return [line for line in text.splitlines() if line.strip()]


def check_line(number: int, line: str) -> tuple[str | None, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; ``ValueError`` saying what is wrong with it."""
    try:
        item = json.loads(line)
    except ValueError as e:
        raise ValueError(f"line {number} is not valid JSON: {e}") from None
    if not isinstance(item, dict):
        raise ValueError(f"line {number} must be a JSON object with custom_id, method, url and body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {number}: custom_id={custom_id!r} must be a non-empty string")
    if item.get("method", "POST") != "POST":
        raise ValueError(f"line {number}: method={item.get('method')!r} is not supported: only POST")
    url = item.get("url")
    if url not in BATCH_URLS:
        raise ValueError(f"line {number}: url={url!r} is not supported: one of {', '.join(BATCH_URLS)}")
    body = item.get("body")
    if not isinstance(body, dict):
        raise ValueError(f"line {number}: body must be a JSON object (the request of {url})")
    if body.get("stream"):
        raise ValueError(f"line {number}: body.stream=true is not supported in a batch: each result is one line")
    return custom_id, url, body


async def _run(args: argparse.Namespace, lines: list[str]) -> int:
    import httpx

    from pagedlm.core.engine.arg_utils import EngineArgs
    from pagedlm.server.app import build_app
    from pagedlm.server.launcher import build_state, load_chat_template, start_engine

    engine, metrics = start_engine(args, EngineArgs.from_cli_args(args))
    metrics_server = None
    try:
        state = await build_state(args, engine, metrics, None, load_chat_template(args.chat_template))
        app = build_app(state)
        if args.enable_metrics:
            metrics_server = await _start_metrics_server(app, args.host, args.port)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
            results = await _run_lines(client, lines)
    finally:
        if metrics_server is not None:
            server, task = metrics_server
            server.should_exit = True
            await task
        engine.shutdown()
    failed = sum(result["error"] is not None for result in results)
    _write(args.output_file, results)
    logger.info("run-batch: %d requests, %d succeeded, %d failed; results in %s", len(results),
                len(results) - failed, failed, args.output_file)
    return 0


async def _run_lines(client: Any, lines: list[str]) -> list[dict[str, Any]]:
    from tqdm import tqdm

    progress = tqdm(total=len(lines), desc="run-batch", unit="req", file=sys.stderr, disable=not lines)

    async def one(number: int, line: str) -> dict[str, Any]:
        try:
            return await _run_line(client, number, line)
        finally:
            progress.update(1)

    try:
        return list(await asyncio.gather(*(one(n, line) for n, line in enumerate(lines, start=1))))
    finally:
        progress.close()


async def _run_line(client: Any, number: int, line: str) -> dict[str, Any]:
    request_id = f"batch-{uuid.uuid4().hex}"
    try:
        custom_id, url, body = check_line(number, line)
    except ValueError as e:
        item = _loads_or_none(line)
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        return _result(custom_id, 400, request_id, None, {"message": str(e), "type": "invalid_request_error",
                                                            "param": None, "code": None})
    response = await client.post(url, json=body)
    payload = response.json()
    if response.status_code == 200:
        return _result(custom_id, 200, payload.get("id") or request_id, payload, None)
    error = payload.get("error", payload) if isinstance(payload, dict) else {"message": str(payload)}
    return _result(custom_id, response.status_code, request_id, None, error)


def _result(custom_id: str | None, status: int, request_id: str, body: Any, error: Any) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}


def _loads_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def _write(path: str, results: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


async def _start_metrics_server(app: Any, host: str, port: int) -> tuple[Any, asyncio.Task]:
    """uvicorn on ``host:port`` serving the same app (its /metrics and /health) while the batch runs."""
    import uvicorn

    from pagedlm.server.launcher import _bind, _Server

    sock = _bind(host, port)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # uvicorn's own error, if it could not start
    logger.info("run-batch: /metrics on http://%s:%d", host, sock.getsockname()[1])
    return server, task
