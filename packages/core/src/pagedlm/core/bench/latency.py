"""``pagedlm bench latency``: one batch of a fixed size, prefill and per-token decode latency.

Each iteration submits ``--batch-size`` fresh random prompts of ``--input-len`` tokens (new ids every
iteration, so the prefix cache never helps) and steps the engine until all have ``--output-len``
tokens. Every engine step is timed; the stats hook says which steps computed prompt tokens.

* prefill latency: from submission to the end of the last step that computed prompt tokens, i.e.
  when the whole batch has its first token (one step unless the prompts exceed the token budget);
* decode latency: the duration of each later step, every request gaining one token per step, so
  it is the per-output-token latency (TPOT) at this batch size;
* end-to-end latency: the whole batch, submission to last token.

On CUDA it also reports the decode floor of a small batch: the model's weight bytes over the
device-to-device copy bandwidth measured in the same process (bytes read plus written), i.e. the
time to read every weight once, and the measured decode time per token against it.

Percentiles are over iterations (prefill, mean decode, end-to-end) and over all decode steps.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pagedlm.core.bench import common
from pagedlm.core.bench.peer_latency import PEERS
from pagedlm.core.bench.profile import profiled


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("latency", help="prefill and per-token decode latency of one batch",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--num-iters", type=int, default=10, help="measured iterations")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random prompt ids")
    p.add_argument("--compare", nargs="+", choices=PEERS, default=[], metavar="PEER",
                   help="run the same batch through peers in the same run: hf (transformers' generate on the "
                        "same weights) and/or llama.cpp (llama-cpp-python on the same GGUF file, batch 1)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="run the measured iterations under torch.profiler; DIR gets the top ops and device time")
    common.add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0 (got {args.num_iters_warmup})")
    return common.run_offline(args, args.input_len + args.output_len, measure, _print)


def measure(args: argparse.Namespace, setup: common.EngineSetup) -> dict[str, Any]:
    from pagedlm.core import SamplingParams

    vocab = setup.vocab_size()
    t_init = time.perf_counter()
    llm = setup.build()
    init_s = time.perf_counter() - t_init
    rss_mb = common.resident_memory_mb()
    engine_info = common.engine_summary(llm, setup)
    engine = llm.llm_engine
    last: list[Any] = [None]
    engine.core.add_stats_listener(lambda s: last.__setitem__(0, s))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    iterations: list[dict[str, Any]] = []
    all_decode_steps: list[float] = []
    with profiled(args.profile, engine_info["device"]) as profile_summary:
        _iterate(args, engine, last, vocab, params, iterations, all_decode_steps)
    floor = _weight_read_floor(llm)
    dtype, threads = llm.vllm_config.model_config.dtype, _threads()
    llm.shutdown()
    del llm
    decode_means = [x["decode_mean_s"] for x in iterations if x["decode_steps"]]
    tokens_per_iter = args.batch_size * args.output_len
    e2e = [x["e2e_s"] for x in iterations]
    decode = common.distribution(decode_means, 1000.0)
    if floor and decode.get("count"):
        floor["decode_p50_over_floor"] = decode["p50"] / floor["weight_read_ms"]
    result = {
        "benchmark": "latency",
        "engine": engine_info,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "init_s": init_s,
        "e2e_latency_ms": common.distribution(e2e, 1000.0),
        "prefill_latency_ms": common.distribution([x["prefill_s"] for x in iterations], 1000.0),
        "decode_latency_ms": decode,
        "decode_step_latency_ms": common.distribution(all_decode_steps, 1000.0),
        "output_tokens_per_s": tokens_per_iter * len(e2e) / sum(e2e),
        "weight_read_floor": floor,
        "resident_memory_after_load_mb": rss_mb,
        "iterations": iterations,
    }
    if args.compare:
        result["peers"] = _peers(args, setup, vocab, dtype, engine_info["device"], threads)
    if profile_summary:
        result["profile"] = profile_summary
    return result


def _iterate(args: argparse.Namespace, engine: Any, last: list[Any], vocab: int, params: Any,
             iterations: list[dict[str, Any]], all_decode_steps: list[float]) -> None:
    rng = random.Random(args.workload_seed)
    for it in range(args.num_iters_warmup + args.num_iters):
        for i in range(args.batch_size):
            ids = [rng.randrange(vocab) for _ in range(args.input_len)]
            engine.add_request(f"latency-{it}-{i}", {"prompt_token_ids": ids}, params)
        prefill_s = 0.0
        decode_steps: list[float] = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            stats = last[0]
            if stats is not None and stats.num_prefill_tokens > 0:
                prefill_s = time.perf_counter() - start
                decode_steps.clear()  # a chunked prefill's earlier steps may carry decodes: not pure decode
            else:
                decode_steps.append(dt)
        total = time.perf_counter() - start
        if it < args.num_iters_warmup:
            continue
        iterations.append({
            "e2e_s": total,
            "prefill_s": prefill_s,
            "decode_steps": len(decode_steps),
            "decode_mean_s": sum(decode_steps) / len(decode_steps) if decode_steps else float("nan"),
        })
        all_decode_steps += decode_steps


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _peers(args: argparse.Namespace, setup: common.EngineSetup, vocab: int, dtype: Any, device: str,
           threads: int) -> list[dict[str, Any]]:
    from pagedlm.core.bench import peer_latency

    rng = random.Random(args.workload_seed + 1)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    model = str(setup.kwargs["model"])
    iters, warmup = args.num_iters, min(args.num_iters_warmup, 1)
    out = []
    for peer in dict.fromkeys(args.compare):
        try:
            if peer == "hf":
                out.append(peer_latency.hf_generate(prompts, args.output_len, model=model,
                                                    dummy=setup.kwargs.get("load_format") == "dummy", dtype=dtype,
                                                    device=device, iters=iters, warmup=warmup, seed=args.workload_seed))
            else:
                out.append(peer_latency.llama_cpp(prompts, args.output_len, model=model, iters=iters, warmup=warmup,
                                                  threads=threads))
        except Exception as e:  # noqa: BLE001 - a peer's failure is a result to report, not a reason to lose ours
            out.append({"peer": peer, "error": f"{type(e).__name__}: {e}"})
    return out


def _weight_read_floor(llm: Any) -> dict[str, float] | None:
    """Weights (from the in-process worker) over the copy bandwidth the platform measures now;
    None where it measures none (the CPU) or the workers run in other processes."""
    from pagedlm.core.platforms import resolve_platform

    try:
        runner = llm.llm_engine.core.executor.worker.model_runner
    except (AttributeError, RuntimeError):  # RuntimeError: data-parallel cores run elsewhere
        return None
    weight_bytes = getattr(runner, "model_weight_bytes", None)
    if not weight_bytes:
        return None
    bandwidth = resolve_platform(llm.vllm_config.device_config.device).copy_bandwidth_bytes_per_s(runner.device)
    if not bandwidth:
        return None
    return {"weight_bytes": weight_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
            "weight_read_ms": weight_bytes / bandwidth * 1000.0}


def _print(r: dict[str, Any]) -> None:
    e = r["engine"]

    def pct(d: dict[str, Any]) -> str:
        if not d.get("count"):
            return "n/a"
        return f"mean {d['mean']:.2f}  p50 {d['p50']:.2f}  p90 {d['p90']:.2f}  p99 {d['p99']:.2f}"

    common.print_table("pagedlm bench latency", [
        ("model", f"{e['model']} ({e['device']}, {e['dtype']}, load_format={e['load_format']})"),
        ("batch", f"{r['batch_size']} x ({r['input_len']} in + {r['output_len']} out), {r['num_iters']} iterations"),
        ("prefill latency (ms)", pct(r["prefill_latency_ms"])),
        ("decode / token (ms)", pct(r["decode_latency_ms"])),
        ("decode steps (ms)", pct(r["decode_step_latency_ms"])),
        ("end-to-end (ms)", pct(r["e2e_latency_ms"])),
        ("output tokens/s", r["output_tokens_per_s"]),
        *_floor_rows(r.get("weight_read_floor")),
        *([("resident memory after load (MB)", r["resident_memory_after_load_mb"])]
          if r.get("resident_memory_after_load_mb") else []),
        *_peer_rows(r),
    ])
    if "profile" in r:
        prof = r["profile"]
        print(f"profile: {prof['directory']}/profile-top.txt (device time {prof['device_time_s']}s)")


def _peer_rows(r: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    ours = r["decode_latency_ms"].get("p50")
    for peer in r.get("peers", []):
        name = peer["peer"]
        if "error" in peer:
            rows.append((name, f"not run: {peer['error']}"))
            continue
        rows += [(f"{name} ({peer['api']})", f"prefill {peer['prefill_ms']:.2f} ms, decode "
                                              f"{peer['decode_ms_per_token']:.2f} ms/token, "
                                              f"{peer['output_tokens_per_s']:.1f} out tok/s")]
        if ours:
            rows.append((f"  {name} decode / pagedlm decode", f"{peer['decode_ms_per_token'] / ours:.2f}x"))
    return rows


def _floor_rows(floor: dict[str, float] | None) -> list[tuple[str, Any]]:
    if not floor:
        return []
    rows = [("weights (GiB)", floor["weight_bytes"] / 2**30),
            ("copy bandwidth (TB/s)", floor["copy_bandwidth_bytes_per_s"] / 1e12),
            ("weight read once (ms)", floor["weight_read_ms"])]
    if "decode_p50_over_floor" in floor:
        rows.append(("decode p50 / weight read", floor["decode_p50_over_floor"]))
    return rows
