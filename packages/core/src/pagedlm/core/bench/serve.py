"""``pagedlm bench serve``: an async load generator for an OpenAI-compatible ``/v1/completions``.

Requests stream (``stream: true`` with ``stream_options.include_usage``, ``return_token_ids: true``,
``ignore_eos: true``) and are sent at a Poisson ``--request-rate`` (requests/s; default: all at once)
and/or capped at ``--max-concurrency`` in flight. Tokens are counted per chunk from its
``token_ids`` (one per chunk with text from a server that does not send them), so a server with
dummy weights or without a tokenizer, which streams no text, is timed too. Per request: TTFT (time
to the first chunk with a token), ITL (per token: a chunk's gap to the previous one, divided among
its tokens), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency (E2EL); reported
in ms as mean / median / std / p99 (``--metric-percentiles``), as vLLM's ``bench serve`` does.
Goodput counts the requests per second that succeeded within every ``--goodput`` bound. Errors
(HTTP status, error payloads, broken streams) are counted and a few are shown.

Bounded: ``--num-prompts`` requests at most, nothing new after ``--max-duration`` seconds (requests
still running then are cancelled and counted), ``--request-timeout`` per request. Loopback only:
the target host must resolve to 127.0.0.0/8 or ::1. ``--launch`` starts ``pagedlm serve`` itself on
a free loopback port with the engine options given here, and stops it afterwards;
``--launch-disagg`` starts a prefill and a decode instance with those options (P2pConnector) and
``pagedlm disagg-proxy`` in front of them, and measures through the proxy (bench/disagg_launch.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pagedlm.core.bench import common
from pagedlm.core.bench.workloads import add_workload_options, workload_from_args

# Words for --prompt-format text: common enough to be about one token each in most vocabularies.
_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "paged", "attention", "keeps",
    "every", "block", "of", "keys", "and", "values", "in", "a", "table", "so", "that", "many", "requests",
    "share", "one", "cache", "and", "nothing", "is", "copied", "when", "a", "sequence", "grows",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="load generator for a running `pagedlm serve` (or one it starts)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    p.add_argument("--launch", action="store_true",
                   help="start `pagedlm serve` on a free loopback port with the engine options below")
    p.add_argument("--launch-disagg", action="store_true",
                   help="start a prefill and a decode `pagedlm serve` (P2pConnector) and `pagedlm disagg-proxy` with "
                        "the engine options given here, measure through the proxy, stop them afterwards")
    p.add_argument("--launch-timeout", type=float, default=600.0, help="seconds to wait for a launched server")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, requests/s")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--max-duration", type=float, default=600.0, help="send nothing new after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:10000 (milliseconds)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send prompts as token-id lists (exact lengths) or as text of that many words")
    p.add_argument("--metric-percentiles", default="99", metavar="P,P,...",
                   help="percentiles reported beside mean, median and std (as vLLM's bench serve; "
                        "default 99); the full distributions carry p50/p90/p99 as well")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="highest token id + 1 for id prompts (default: from --model/--model-config, else 10001)")
    add_workload_options(p)
    common.add_engine_options(p)
    p.set_defaults(func=run)


def check_loopback(url: str) -> tuple[str, int]:
    """(host, port) of ``url``; ValueError unless every address of the host is a loopback address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url {url!r} must look like http://127.0.0.1:8000")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {e}") from e
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not addr.is_loopback:
            raise ValueError(f"--base-url {url!r} resolves to {addr}, which is not a loopback address: "
                             "this load generator only targets servers on this machine")
    return parts.hostname, port


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from e
    return slos


def parse_percentiles(text: str | list[float]) -> list[float]:
    if isinstance(text, list):
        return text
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--metric-percentiles {text!r}: give numbers separated by commas, e.g. 50,90,99") from e
    if not values or not all(0 <= v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in [0, 100]")
    return values


def run(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (got {args.request_rate})")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (got {args.max_concurrency})")
    slos = parse_goodput(args.goodput)
    args.metric_percentiles = parse_percentiles(args.metric_percentiles)
    if args.launch and args.launch_disagg:
        raise ValueError("pass --launch or --launch-disagg, not both")
    launching = args.launch or args.launch_disagg
    setup = common.EngineSetup(args) if (launching or args.model or args.model_config) else None
    procs: list[subprocess.Popen] = []
    try:
        vocab = args.vocab_size or (setup.vocab_size() if setup else 10001)
        # sharegpt-like shortens requests to the context: the given one, else the model's (up to 2048)
        context = args.max_model_len or (min(2048, setup.model_max_len()) if setup else None)
        workload = workload_from_args(args, vocab_size=vocab, max_model_len=context)
        base_url = args.base_url.rstrip("/")
        if launching:
            assert setup is not None
            if setup.kwargs.get("max_model_len") is None:
                setup.kwargs["max_model_len"] = min(setup.model_max_len(), _round_up(workload.max_total_len, 16))
        if args.launch:
            proc, base_url = _launch(setup, args)
            procs.append(proc)
        elif args.launch_disagg:
            from pagedlm.core.bench.disagg_launch import launch_disagg

            def start(tail: list[str], what: str) -> tuple[subprocess.Popen, str]:
                started = _start(args, tail, what)
                procs.append(started[0])
                return started

            _, base_url = launch_disagg(_engine_flags(setup.kwargs), start, _free_port, setup.kwargs)
        check_loopback(base_url)
        result = asyncio.run(_bench(args, workload, base_url, slos))
    finally:
        for proc in reversed(procs):  # the proxy first
            _stop(proc)
        if setup is not None:
            setup.cleanup()
    result["launched_server"] = bool(args.launch)
    result["launched_disagg"] = bool(args.launch_disagg)
    _print(result)
    common.finish(result, args.output_json)
    return 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# -- a server of our own -------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """Engine options that differ from their defaults, as ``pagedlm serve`` flags."""
    from pagedlm.core.engine.arg_utils import EngineArgs

    defaults = EngineArgs()
    flags: list[str] = []
    for name, value in kwargs.items():
        if value == getattr(defaults, name, None) or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, dict):  # JSON options (--kv-transfer-config, --hf-overrides, ...)
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def _launch(setup: common.EngineSetup, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    return _start(args, ["serve", *_engine_flags(setup.kwargs)], "`pagedlm serve`")


def _start(args: argparse.Namespace, tail: list[str], what: str) -> tuple[subprocess.Popen, str]:
    """``pagedlm TAIL --host 127.0.0.1 --port FREE`` in the background, once it answers /v1/models."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedlm.core.cli", *tail, "--host", "127.0.0.1", "--port", str(port)]
    log_path = os.path.join(tempfile.gettempdir(), f"pagedlm-bench-serve-{port}.log")
    print("launching: " + " ".join(cmd), file=sys.stderr)
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log_path  # type: ignore[attr-defined]
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            with open(log_path, encoding="utf-8") as f:
                tail = f.read()[-3000:]
            raise ValueError(f"{what} exited with code {proc.returncode} before answering:\n{tail}")
        if _http_ok(base_url + "/v1/models"):
            return proc, base_url
        time.sleep(0.5)
    _stop(proc)
    raise ValueError(f"{what} did not answer on {base_url} within {args.launch_timeout:.0f}s "
                     f"(log: {log_path})")


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(OSError):
        os.remove(proc.log_path)  # type: ignore[attr-defined]


# -- the load --------------------------------------------------------------------------------------
async def _bench(args: argparse.Namespace, workload: Any, base_url: str, slos: dict[str, float]) -> dict[str, Any]:
    try:
        import aiohttp
    except ImportError as e:
        raise ValueError("`pagedlm bench serve` needs aiohttp: pip install 'pagedlm-core[bench]'") from e

    rng = random.Random(args.workload_seed)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # NOTE: limit=0 lifts aiohttp's default cap of 100 connections, which would silently act as
    # a concurrency limit; --max-concurrency is enforced by the semaphore instead.
    connector = aiohttp.TCPConnector(limit=0)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    in_flight = [0, 0]  # now, peak
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.served_model or await _first_model(session, base_url)
        url = base_url + "/v1/completions"
        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        deadline = start + args.max_duration
        for i, (ids, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
            if i and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
            if time.perf_counter() >= deadline:
                break
            prompt: Any = ids if args.prompt_format == "ids" else " ".join(rng.choice(_WORDS) for _ in ids)
            # NOTE: ignore_eos + max_tokens: every request generates exactly its output length
            payload = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": workload.temperature,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                       "return_token_ids": True}
            tasks.append(asyncio.create_task(_request(session, url, payload, len(ids), sem, in_flight)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter())) if tasks else \
            (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    records = [t.result() for t in tasks if t in done and not t.cancelled()]
    return _summarize(args, workload, model, base_url, records, len(tasks), len(pending), duration, slos, in_flight[1])


async def _first_model(session: Any, base_url: str) -> str:
    try:
        async with session.get(base_url + "/v1/models") as resp:
            body = await resp.json(content_type=None)
        return str(body["data"][0]["id"])
    except Exception as e:
        raise ValueError(f"cannot list models at {base_url}/v1/models ({type(e).__name__}: {e}); is the server "
                         "running? pass --served-model NAME or --launch") from e


async def _request(session: Any, url: str, payload: dict[str, Any], prompt_len: int, sem: Any,
                   in_flight: list[int]) -> dict[str, Any]:
    async with sem if sem is not None else contextlib.nullcontext():
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            return await _stream(session, url, payload, prompt_len)
        finally:
            in_flight[0] -= 1


async def _stream(session: Any, url: str, payload: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": False, "error": None, "prompt_tokens": prompt_len, "output_tokens": 0,
                           "expected_output_tokens": int(payload["max_tokens"]), "streamed_tokens": 0,
                           "counted_by": None, "ttft": None, "latency": None, "itl": [], "chunks": 0}
    events = _Events(rec, time.perf_counter())
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            # NOTE: whatever bytes arrived, split into lines here: one read per arrival instead of
            # one per line halves this process's cost per event (~24k/s against a fast server),
            # which otherwise delays the timestamps it takes.
            pending = b""
            done = False
            async for block in resp.content.iter_any():
                now = time.perf_counter()
                *lines, pending = (pending + block).split(b"\n")
                if any(events.line(line, now) for line in lines):
                    done = True
                    break
            if not done and pending:
                events.line(pending, time.perf_counter())
            if rec["error"]:
                return rec
    except asyncio.TimeoutError:
        rec["error"] = "timed out (--request-timeout)"
        return rec
    except Exception as e:  # noqa: BLE001 - a broken stream is a counted error, not a crash of the run
        rec["error"] = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec["latency"] = time.perf_counter() - events.start
    usage = events.usage
    if usage:
        rec["prompt_tokens"] = int(usage.get("prompt_tokens", prompt_len))
        rec["output_tokens"] = int(usage.get("completion_tokens", rec["streamed_tokens"]))
    else:
        rec["output_tokens"] = rec["streamed_tokens"]
    if rec["ttft"] is None and not rec.get("answered") and not usage:
        rec["error"] = "the stream ended without any output"
        return rec
    # NOTE: a server that sends no token ids and streams no text (no tokenizer) still counts for
    # latency and throughput, but has no TTFT or ITL.
    rec["ok"] = True
    return rec


class _Events:
    """One response's SSE lines, recorded into ``rec`` (tokens, TTFT, ITL) as they arrive."""

    def __init__(self, rec: dict[str, Any], start: float) -> None:
        self.rec = rec
        self.start = self.last = start
        self.usage: dict[str, Any] | None = None

    def line(self, raw: bytes, now: float) -> bool:
        """Take one line; True when the stream is over (``[DONE]``, or an error payload)."""
        line = raw.strip()
        if not line.startswith(b"data:"):
            return False  # blank separators, SSE comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        rec = self.rec
        chunk = msgspec.json.decode(data)
        if chunk.get("error"):
            rec["error"] = f"stream error: {json.dumps(chunk['error'])[:200]}"
            return True
        self.usage = chunk.get("usage") or self.usage
        choices = chunk.get("choices") or []
        rec["answered"] = rec.get("answered", False) or bool(choices)
        if not choices:
            return False
        k = _chunk_tokens(choices[0], rec)
        if not k:
            return False
        if rec["ttft"] is None:
            rec["ttft"] = now - self.start
            # tokens that arrive with the first one follow it without any wait
            rec["itl"].extend([0.0] * (k - 1))
        else:
            # NOTE: a chunk of k tokens (--stream-interval, a lagging server) is k inter-token
            # latencies of gap / k each, so ITL stays per token and sums to latency - TTFT
            rec["itl"].extend([(now - self.last) / k] * k)
        self.last = now
        rec["chunks"] += 1
        rec["streamed_tokens"] += k
        return False


def _chunk_tokens(choice: dict[str, Any], rec: dict[str, Any]) -> int:
    """Tokens one streamed choice carries: its ``token_ids``, else one if it has text."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        rec["counted_by"] = "token_ids"
        return len(ids)
    if choice.get("text"):  # a server without return_token_ids: one token per chunk with text
        rec["counted_by"] = rec["counted_by"] or "text"
        return 1
    return 0


def _summarize(args: argparse.Namespace, workload: Any, model: str, base_url: str, records: list[dict[str, Any]],
               num_sent: int, num_cancelled: int, duration: float, slos: dict[str, float],
               peak_in_flight: int) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    errors = [r["error"] for r in records if not r["ok"]]
    timed = [r for r in ok if r["ttft"] is not None]
    tpots = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in timed if r["output_tokens"] > 1]
    itls = [x for r in timed for x in r["itl"]]
    num_out = sum(r["output_tokens"] for r in ok)
    num_in = sum(r["prompt_tokens"] for r in ok)

    def good(r: dict[str, Any]) -> bool:
        ttft = r["ttft"] if r["ttft"] is not None else r["latency"]  # nothing streamed: the answer is the first token
        tpot = (r["latency"] - ttft) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else 0.0
        values = {"ttft": ttft * 1000, "tpot": tpot * 1000, "e2e": r["latency"] * 1000}
        return all(values[k] <= v for k, v in slos.items())

    counted_by = {"token_ids": 0, "text": 0, "none": 0}
    for r in ok:
        counted_by[r["counted_by"] or "none"] += 1
    result: dict[str, Any] = {
        "benchmark": "serve",
        "base_url": base_url,
        "model": model,
        "workload": workload.summary(),
        "prompt_format": args.prompt_format,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "peak_in_flight": peak_in_flight,
        "duration_s": duration,
        "num_requests": workload.num_requests,
        "num_sent": num_sent,
        "completed": len(ok),
        "completed_without_tokens": len(ok) - len(timed),
        "errors": len(errors),
        "cancelled": num_cancelled,
        "not_sent": workload.num_requests - num_sent,
        "error_samples": sorted(set(errors))[:5],
        # how streamed tokens were counted, per completed request: from token_ids, one per chunk
        # with text (a server without return_token_ids), or not at all (neither was streamed)
        "tokens_counted_by": counted_by,
        # completed requests whose output (usage) differs from the max_tokens they asked for, and
        # those whose streamed token ids do not add up to it
        "output_len_mismatches": sum(1 for r in ok if r["output_tokens"] != r["expected_output_tokens"]),
        "streamed_token_mismatches": sum(1 for r in ok if r["counted_by"] == "token_ids"
                                         and r["streamed_tokens"] != r["output_tokens"]),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        # chunks that carried tokens, and tokens per such chunk (> 1 with --stream-interval or a lagging server)
        "streamed_chunks": sum(r["chunks"] for r in ok),
        "tokens_per_chunk": (sum(r["streamed_tokens"] for r in ok) / max(1, sum(r["chunks"] for r in ok))),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": num_out / duration if duration else 0.0,
        "total_token_throughput": (num_in + num_out) / duration if duration else 0.0,
        "ttft_ms": common.distribution([r["ttft"] for r in timed], 1000.0),
        "tpot_ms": common.distribution(tpots, 1000.0),
        "itl_ms": common.distribution(itls, 1000.0),
        "e2e_latency_ms": common.distribution([r["latency"] for r in ok], 1000.0),
        "metric_percentiles": list(args.metric_percentiles),
    }
    # vLLM's bench serve names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ... e2el
    for name, values in (("ttft", [r["ttft"] for r in timed]), ("tpot", tpots), ("itl", itls),
                         ("e2el", [r["latency"] for r in ok])):
        result.update(vllm_style(name, values, args.metric_percentiles))
    if slos:
        num_good = sum(1 for r in ok if good(r))
        result["goodput"] = {"slo_ms": slos, "good_requests": num_good,
                             "requests_per_s": num_good / duration if duration else 0.0}
    return result


def _pct_label(q: float) -> str:
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def vllm_style(name: str, values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """``mean_NAME_ms``, ``median_NAME_ms``, ``std_NAME_ms`` (population) and ``pQ_NAME_ms`` of
    ``values`` (seconds), as vLLM's bench serve reports them; None where there are no values."""
    ms = [v * 1000.0 for v in values]
    out: dict[str, float | None] = {}
    mean = sum(ms) / len(ms) if ms else None
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = common.percentile(ms, 50) if ms else None
    out[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)) if mean is not None else None
    for q in percentiles:
        out[f"{_pct_label(q)}_{name}_ms"] = common.percentile(ms, q) if ms else None
    return out


def _print(r: dict[str, Any]) -> None:
    def pct(name: str) -> str:
        if r[f"mean_{name}_ms"] is None:
            return "n/a"
        parts = [f"mean {r[f'mean_{name}_ms']:.2f}", f"median {r[f'median_{name}_ms']:.2f}"]
        parts += [f"{_pct_label(q)} {r[f'{_pct_label(q)}_{name}_ms']:.2f}" for q in r["metric_percentiles"]]
        return "  ".join(parts + [f"std {r[f'std_{name}_ms']:.2f}"])

    w = r["workload"]
    rows = [
        ("server", f"{r['base_url']} (model {r['model']}{', launched by bench' if r.get('launched_server') else ''})"),
        ("workload", f"{w['name']}: {r['num_requests']} requests, rate {r['request_rate']}/s, "
                     f"max concurrency {r['max_concurrency'] or 'unlimited'} (peak {r['peak_in_flight']})"),
        ("completed / errors", f"{r['completed']} / {r['errors']} (cancelled {r['cancelled']}, "
                               f"not sent {r['not_sent']})"),
        ("duration (s)", r["duration_s"]),
        ("input / output tokens", f"{r['total_input_tokens']:,} / {r['total_output_tokens']:,} "
                                  f"({r['tokens_per_chunk']:.2f} tokens per streamed chunk)"),
        ("requests/s", r["request_throughput"]),
        ("output tokens/s", r["output_throughput"]),
        ("total tokens/s", r["total_token_throughput"]),
        ("TTFT (ms)", pct("ttft")),
        ("TPOT (ms)", pct("tpot")),
        ("ITL (ms)", pct("itl")),
        ("E2EL (ms)", pct("e2el")),
    ]
    counted = r["tokens_counted_by"]
    if counted["text"]:
        rows.append(("note", f"{counted['text']} responses had no token_ids (a server without return_token_ids?): "
                             "their tokens were counted as one per chunk with text"))
    if r["completed_without_tokens"]:
        rows.append(("note", f"{r['completed_without_tokens']} responses streamed neither token ids nor text: "
                             "they have no TTFT/TPOT/ITL"))
    if r["output_len_mismatches"] or r["streamed_token_mismatches"]:
        rows.append(("warning", f"{r['output_len_mismatches']} responses did not generate the requested output "
                                f"length; {r['streamed_token_mismatches']} streamed token ids that do not add up to "
                                "their usage"))
    if "goodput" in r:
        g = r["goodput"]
        rows.append(("goodput", f"{g['requests_per_s']:.2f} req/s ({g['good_requests']} within {g['slo_ms']})"))
    for err in r["error_samples"]:
        rows.append(("error", err))
    common.print_table("pagedlm bench serve", rows)
