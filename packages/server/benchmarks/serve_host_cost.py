"""The API server's host cost per request and per streamed chunk, with the engine core stubbed out.

Starts ``pagedlm serve`` (the real launcher, uvicorn, ``AsyncLLM``, the ZMQ engine-core process and
its loop) on the CPU with a stub ``EngineCore`` that models a GPU: each step takes ``--step-ms``,
schedules like the real one (decode first, then chunked prefill in FIFO order within
``max_num_batched_tokens`` and ``max_num_seqs``) and returns one token per running request at once.
Then fires the nano workload (256 streaming requests with token-id prompts, all at once, through
``pagedlm bench serve``'s client) and reports:

  * admission: first POST to the last request reaching the engine core, and the core's steps
    that ran before every request was there;
  * the API process's CPU ms per streamed chunk and per output token (all its threads, from
    /proc), and its share of one core while the load ran;
  * served output tokens/s against the "offline" figure of the same stub (every request queued
    before step 1: steps x --step-ms), the analogue of issue 28's 95% bar;
  * with ``--profile N``: cProfile's N most expensive functions (own time) of the API process's
    event-loop thread during the load.

    python3 packages/server/benchmarks/serve_host_cost.py [--step-ms 5] [--num-prompts 256]
        [--profile 25] [--repeat 2] [--serve-args "--stream-interval 2"]

CPU figures only: they rank the API process's costs; the GPU figures are ``pagedlm bench serve
--launch`` against ``pagedlm bench throughput`` on the device (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

_STATS_ENV = "PAGEDLM_STUB_CORE_STATS"  # where the stub core writes its admission record
_STEP_ENV = "PAGEDLM_STUB_CORE_STEP_MS"
_PROFILE_ENV = "PAGEDLM_STUB_PROFILE"  # where the server dumps its cProfile stats (SIGUSR2)
_PLAIN_ENV = "PAGEDLM_STUB_PLAIN_ASYNCIO"  # the server runs as if uvloop and httptools were not installed
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the stub engine core (runs in the engine-core process) ------------------------------------------
class StubScheduler:
    """Decode-first, then FIFO chunked prefill: which requests get a token in each step."""

    def __init__(self, max_num_seqs: int, token_budget: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        #: [request_id, prompt tokens still to prefill, output tokens still to make]
        self.waiting: deque[list[Any]] = deque()
        self.running: list[list[Any]] = []

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        self.waiting.append([request_id, prompt_len, max_tokens])

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(r for r in self.waiting if r[0] not in request_ids)
        self.running = [r for r in self.running if r[0] not in request_ids]

    def step(self) -> list[tuple[str, bool]]:
        """(request id, finished) of every request that made a token this step."""
        budget = self.token_budget - len(self.running)
        emitted = list(self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            chunk = min(head[1], budget)
            head[1] -= chunk
            budget -= chunk
            if head[1]:
                break  # a partly prefilled prompt: no token yet
            self.running.append(self.waiting.popleft())
            emitted.append(head)
        result = []
        for r in emitted:
            r[2] -= 1
            result.append((r[0], r[2] <= 0))
        self.running = [r for r in self.running if r[2] > 0]
        return result


class StubEngineCore:
    """What ``EngineCoreProc`` needs of ``EngineCore``, with steps of a fixed duration."""

    def __init__(self, vllm_config: Any) -> None:
        sc = vllm_config.scheduler_config
        self.vllm_config = vllm_config
        self.num_gpu_blocks = 1 << 20
        self.sched = StubScheduler(sc.max_num_seqs, int(sc.max_num_batched_tokens or 8192))
        self.step_s = float(os.environ.get(_STEP_ENV, "5")) / 1000
        self.stats_path = os.environ.get(_STATS_ENV)
        kv = SimpleNamespace(num_blocks=self.num_gpu_blocks, num_free_blocks=self.num_gpu_blocks, usage=0.0,
                             prefix_cache_stats=SimpleNamespace(num_queries_tokens=0, num_hit_tokens=0))
        # EngineStatsSnapshot.from_engine_core reads these
        self.scheduler = SimpleNamespace(running=self.sched.running, waiting=self.sched.waiting, kv_cache_manager=kv,
                                         lora_gate=None, spec=None, kv_transfer=None, num_preemptions_total=0)
        self._reset()

    def _reset(self) -> None:
        self.add_times: list[float] = []
        self.steps_before_last_add = 0
        self.num_steps = 0
        self.token = 0
        self.first_step: float | None = None
        self.last_step = 0.0

    def add_request(self, request: Any) -> None:
        self.add_times.append(time.monotonic())
        self.steps_before_last_add = self.num_steps
        self.sched.add(request.request_id, len(request.prompt_token_ids), int(request.sampling_params.max_tokens))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.sched.abort(set(request_ids))

    def has_work(self) -> bool:
        busy = bool(self.sched.waiting or self.sched.running)
        if not busy and self.add_times:
            self._write_stats()
        return busy

    def step(self) -> list[Any]:
        from pagedlm.core.sched import EngineCoreOutput

        start = time.monotonic()
        if self.first_step is None:
            self.first_step = start
        self.last_step = start
        self.num_steps += 1
        outputs = []
        for request_id, finished in self.sched.step():
            self.token = (self.token + 7919) % 10000
            outputs.append(EngineCoreOutput(request_id, [self.token], "length" if finished else None))
        self.scheduler.running, self.scheduler.waiting = self.sched.running, self.sched.waiting
        time.sleep(max(0.0, start + self.step_s - time.monotonic()))  # the "GPU" time of the step
        return outputs

    def _write_stats(self) -> None:
        if self.stats_path:
            _write_json(self.stats_path, {
                "first_add": self.add_times[0], "last_add": self.add_times[-1], "num_adds": len(self.add_times),
                "steps_before_last_add": self.steps_before_last_add, "num_steps": self.num_steps,
                # the real loop's time per step (the stub's --step-ms plus EngineCoreProc's own work)
                "step_interval_s": (self.last_step - (self.first_step or 0.0)) / max(1, self.num_steps - 1)})
        self._reset()

    def shutdown(self) -> None:
        pass


def _stub_core_main(vllm_config: Any, input_addr: str, output_addr: str) -> None:
    """The engine-core process's entry point: the real loop around the stub core."""
    import pagedlm.core.engine.core as core_module
    from pagedlm.core.engine.core_proc import run_engine_core

    core_module.EngineCore = StubEngineCore  # type: ignore[misc]
    run_engine_core(vllm_config, input_addr, output_addr)


def _server_main(serve_argv: list[str]) -> int:
    """``pagedlm serve`` with the stub core. SIGUSR1 starts a load: the garbage collector's pauses
    are recorded (and cProfile runs on the loop thread with ``--profile``); SIGUSR2 ends it and
    writes them (``<stats>.gc``, the profile)."""
    import cProfile
    import gc

    import pagedlm.core.engine.core_proc as core_proc
    from pagedlm.core.cli import main

    core_proc.run_engine_core = _stub_core_main  # type: ignore[assignment]
    if os.environ.get(_PLAIN_ENV):
        sys.modules["uvloop"] = sys.modules["httptools"] = None  # type: ignore[assignment]  # ImportError
    profile_path = os.environ.get(_PROFILE_ENV)
    profiler = cProfile.Profile()
    # (generation, CPU seconds: the wall clock would add the time a busy machine preempted us)
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses.append((info["generation"], time.thread_time() - started[0]))

    def start(*_: Any) -> None:
        pauses.clear()
        arrivals.clear()
        gc.callbacks.append(on_gc)
        if profile_path:
            profiler.enable()

    def stop(*_: Any) -> None:
        gc.callbacks.remove(on_gc)
        if profile_path:
            profiler.disable()
            profiler.dump_stats(profile_path + ".tmp")
            os.replace(profile_path + ".tmp", profile_path)  # whole, for the reader polling for it
        _write_json(os.environ[_STATS_ENV] + ".gc", {
            "count": len(pauses), "total_s": sum(p for _, p in pauses),
            "max_s": [max((p for g, p in pauses if g == gen), default=0.0) for gen in range(3)],
            "full": sum(1 for g, _ in pauses if g == 2), "tracked": len(gc.get_objects()),
            "frozen": gc.get_freeze_count(), "first_arrival": min(arrivals, default=0.0),
            "last_arrival": max(arrivals, default=0.0)})

    import pagedlm.server.launcher as launcher

    arrivals: list[float] = []  # when each POST /v1/completions reached the app (monotonic)
    build_app = launcher.build_app

    def timed_app(state: Any) -> Any:
        app = build_app(state)

        async def timed(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/v1/completions":
                arrivals.append(time.monotonic())
            await app(scope, receive, send)

        return timed

    launcher.build_app = timed_app  # type: ignore[assignment]
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return main(["serve", *serve_argv])


def _write_json(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole, for the reader polling for it


# -- the load (this process) ----------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime, every thread


def _offline_steps(workload: Any, max_num_seqs: int, budget: int) -> int:
    sched = StubScheduler(max_num_seqs, budget)
    for i, (ids, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        sched.add(str(i), len(ids), out_len)
    steps = 0
    while sched.waiting or sched.running:
        sched.step()
        steps += 1
    return steps


def _bench_args(num_prompts: int) -> argparse.Namespace:
    return argparse.Namespace(workload_seed=0, request_timeout=300.0, max_concurrency=None, served_model=None,
                              max_duration=600.0, request_rate=math.inf, prompt_format="ids",
                              metric_percentiles=[99.0], num_prompts=num_prompts)


def _wait_stats(path: str, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("the stub core wrote no admission record")
        time.sleep(0.05)
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    os.remove(path)
    return record


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_server":
        return _server_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=5.0, help="duration of one stub engine step")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N nano requests (default all 256)")
    p.add_argument("--repeat", type=int, default=1, help="loads in a row against the same server")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the API process's loop thread; print cProfile's N most expensive functions of the "
                        "last load")
    p.add_argument("--plain-asyncio", action="store_true",
                   help="serve as if uvloop and httptools were not installed (asyncio's loop, uvicorn's h11)")
    p.add_argument("--profile-out", default=None, metavar="FILE", help="keep the cProfile stats (pstats) here")
    p.add_argument("--serve-args", default="", help="more `pagedlm serve` flags, e.g. '--stream-interval 2'")
    args = p.parse_args()

    import aiohttp  # noqa: F401 - imported before the clock starts

    from pagedlm.core.bench import common
    from pagedlm.core.bench.serve import _bench, _free_port, _http_ok
    from pagedlm.core.bench.workloads import nano_workload

    tmp = tempfile.mkdtemp(prefix="pagedlm-serve-host-cost-")
    model_dir = common.model_config_dir("qwen3-0.6b", os.path.join(tmp, "model"))
    stats_path = os.path.join(tmp, "admission.json")
    profile_path = os.path.join(tmp, "api.prof")
    workload = nano_workload(num_prompts=args.num_prompts)
    max_num_seqs, budget = 256, 8192  # the server's defaults on the GPU
    port = _free_port()
    serve_argv = ["--model", model_dir, "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "2048",
                  "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(budget),
                  "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.serve_args)]
    env = {**os.environ, _STATS_ENV: stats_path, _STEP_ENV: str(args.step_ms),
           **({_PROFILE_ENV: profile_path} if args.profile else {}),
           **({_PLAIN_ENV: "1"} if args.plain_asyncio else {})}
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_server", *serve_argv], env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while not _http_ok(base_url + "/v1/models"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.3)
        offline_steps = _offline_steps(workload, max_num_seqs, budget)
        # one request first: the server's one-time costs (first request, lazy imports) stay out of the figures
        asyncio.run(_bench(_bench_args(1), nano_workload(num_prompts=1), base_url, {}))
        _wait_stats(stats_path)
        for run in range(args.repeat):
            server.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            cpu0, client_cpu0, t0 = _cpu_s(server.pid), time.process_time(), time.monotonic()
            result = asyncio.run(_bench(_bench_args(workload.num_requests), workload, base_url, {}))
            cpu_s, client_cpu_s = _cpu_s(server.pid) - cpu0, time.process_time() - client_cpu0
            server.send_signal(signal.SIGUSR2)
            adm, gc_pauses = _wait_stats(stats_path), _wait_stats(stats_path + ".gc")
            # offline: every request queued before step 1, at the step time the core loop really took
            offline_tps = sum(workload.output_lens) / (offline_steps * adm["step_interval_s"])
            chunks, tokens = result["streamed_chunks"], result["total_output_tokens"]
            print(f"run {run + 1}: {result['completed']}/{workload.num_requests} completed, {result['errors']} errors, "
                  f"{tokens} output tokens in {chunks} chunks ({result['tokens_per_chunk']:.2f} tokens/chunk)")
            print(f"  admission: {1000 * (adm['last_add'] - t0):.0f} ms from the first POST to the last request in "
                  f"the core ({1000 * (adm['last_add'] - adm['first_add']):.0f} ms first to last add; the POSTs "
                  f"reached the app {1000 * (gc_pauses['first_arrival'] - t0):.0f} to "
                  f"{1000 * (gc_pauses['last_arrival'] - t0):.0f} ms after the start); "
                  f"{adm['steps_before_last_add']} of {adm['num_steps']} steps ran before it")
            print(f"  API process: {cpu_s:.2f} s CPU in {result['duration_s']:.2f} s "
                  f"({100 * cpu_s / result['duration_s']:.0f}% of a core): {1000 * cpu_s / max(1, chunks):.3f} ms per "
                  f"chunk, {1000 * cpu_s / max(1, tokens):.3f} ms per token; the client: {client_cpu_s:.2f} s CPU")
            longest = ", ".join(f"{1000 * s:.1f}" for s in gc_pauses["max_s"])
            print(f"  API process's garbage collections: {gc_pauses['count']} ({gc_pauses['full']} full), "
                  f"{1000 * gc_pauses['total_s']:.0f} ms CPU in all, the longest of generations 0, 1, 2: {longest} ms "
                  f"({gc_pauses['tracked']:,} objects tracked, {gc_pauses['frozen']:,} frozen)")
            print(f"  output tokens/s: {result['output_throughput']:,.0f} served vs {offline_tps:,.0f} offline "
                  f"({100 * result['output_throughput'] / offline_tps:.1f}%, {1000 * adm['step_interval_s']:.2f} ms "
                  f"per step); TTFT median {result['median_ttft_ms']:.0f} ms, TPOT median "
                  f"{result['median_tpot_ms']:.2f} ms, ITL median {result['median_itl_ms']:.2f} / p99 "
                  f"{result['p99_itl_ms']:.2f} ms")
        if args.profile:
            import pstats

            deadline = time.monotonic() + 10
            while not os.path.exists(profile_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            pstats.Stats(profile_path).sort_stats("tottime").print_stats(args.profile)
            if args.profile_out:
                shutil.copy(profile_path, args.profile_out)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
