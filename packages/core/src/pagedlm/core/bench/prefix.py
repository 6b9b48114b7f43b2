"""``pagedlm bench prefix``: the prefix-cache experiment, caching on versus off.

``--num-prompts`` requests share ``--num-prefixes`` long "system prompts" of ``--prefix-len``
tokens (request i uses prefix i mod K), each followed by ``--suffix-len`` tokens of its own. The
same workload runs on two engines, identical but for ``enable_prefix_caching``, one after the other.
For each run: wall time, prompt tokens submitted, prompt tokens actually computed (prefill work,
from the engine's per-step stats; preempted requests count again), tokens served from the cache,
and the hit rate. With caching, each prefix is computed about once: the first request to reach it
computes it and every later one (even in the same step) reuses its blocks.

With ``--kv-offloading-size GIB`` (``--kv-offload-gib``) a third run is made: caching on with the
host-memory offload tier (OffloadingConnector) beside caching on without it, so that a workload
whose prefixes exceed the device cache (``--num-gpu-blocks-override`` makes it small) shows what
the tier keeps: its hit rate counts blocks brought back from host memory.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from pagedlm.core.bench import common
from pagedlm.core.bench.timeline import StepRecorder, write_timelines
from pagedlm.core.bench.workloads import prefix_workload


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefix", help="prefix-cache experiment: shared system prompts, caching on vs off",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="requests")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens per shared system prompt")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own question")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--kv-timeline", default=None, metavar="FILE.png",
                   help="plot both runs side by side: KV blocks, requests and tokens per step (+ FILE.json)")
    common.add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return common.run_offline(args, args.prefix_len + args.suffix_len + args.output_len, measure, _print)


def _one_run(setup: common.EngineSetup, workload: Any, *, caching: bool, vocab: int,
             offload: bool = False) -> tuple[dict[str, Any], Any]:
    t_init = time.perf_counter()
    tier = {} if offload else {"kv_offloading_size": None}
    llm = setup.build(enable_prefix_caching=caching, **tier)
    init_s = time.perf_counter() - t_init
    engine = common.engine_summary(llm, setup)
    common.warm_up(llm, vocab)
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    llm.reset_prefix_cache()  # the warm-up's blocks must not count as hits
    kv.reset_prefix_cache_stats()
    kvt = llm.llm_engine.core.scheduler.kv_transfer
    external_before = kvt.stats.num_hit_tokens if kvt is not None else 0
    recorder = StepRecorder(llm)
    recorder.restart_clock()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], workload.sampling_params(),
                           use_tqdm=False)
    elapsed = time.perf_counter() - start
    recorder.finish(llm)
    stats = kv.reset_prefix_cache_stats()
    steps = recorder.summary()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    result = {
        "enable_prefix_caching": caching,
        "offload_tier": offload,
        "offload_tier_hit_tokens": (kvt.stats.num_hit_tokens - external_before) if kvt is not None else 0,
        "engine": engine,
        "init_s": init_s,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": steps.get("prefill_tokens_computed", 0),
        "cached_prompt_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "lookup_hit_rate": stats.hit_rate,
        "num_preemptions": steps.get("num_preemptions", 0),
        "peak_kv_cache_usage": steps.get("peak_kv_cache_usage", 0.0),
        "num_steps": steps.get("num_steps", 0),
    }
    samples = recorder.samples
    llm.shutdown()
    del llm, outputs
    gc.collect()  # the second engine must not find the first one's memory still taken
    return result, samples


def measure(args: argparse.Namespace, setup: common.EngineSetup) -> dict[str, Any]:
    vocab = setup.vocab_size()
    workload = prefix_workload(num_prompts=args.num_prompts, num_prefixes=args.num_prefixes,
                               prefix_len=args.prefix_len, suffix_len=args.suffix_len, output_len=args.output_len,
                               seed=args.workload_seed, vocab_size=vocab)
    tier = None
    if setup.kwargs.get("kv_offloading_size"):
        tier, _ = _one_run(setup, workload, caching=True, vocab=vocab, offload=True)
    on, on_samples = _one_run(setup, workload, caching=True, vocab=vocab)
    off, off_samples = _one_run(setup, workload, caching=False, vocab=vocab)
    result: dict[str, Any] = {
        "benchmark": "prefix",
        "workload": workload.summary(),
        "caching_on": on,
        "caching_off": off,
        "speedup": off["elapsed_s"] / on["elapsed_s"],
        "prefill_tokens_saved": off["prefill_tokens_computed"] - on["prefill_tokens_computed"],
        "prefill_reduction": (1.0 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
                              if off["prefill_tokens_computed"] else 0.0),
    }
    if tier is not None:
        result["offload_tier_on"] = tier
        result["offload_prefill_tokens_saved"] = on["prefill_tokens_computed"] - tier["prefill_tokens_computed"]
    if args.kv_timeline:
        e = on["engine"]
        p = workload.params
        title = (f"pagedlm bench prefix: {e['model']} ({e['device']}, {e['dtype']}), {p['num_prompts']} requests = "
                 f"one of {p['num_prefixes']} shared {p['prefix_len']}-token prefixes + {p['suffix_len']} own tokens, "
                 f"{p['output_len']} out\n{e['num_blocks']:,} blocks x {e['block_size']} tokens, "
                 f"max_num_seqs={e['max_num_seqs']}, max_num_batched_tokens={e['max_num_batched_tokens']}")
        png, js = write_timelines(args.kv_timeline, [("prefix caching ON", on_samples),
                                                     ("prefix caching OFF", off_samples)], title, e)
        result["kv_timeline"] = {"png": png, "json": js}
    return result


def _print(r: dict[str, Any]) -> None:
    on, off, w = r["caching_on"], r["caching_off"], r["workload"]
    e = on["engine"]
    p = w["params"]

    def line(x: dict[str, Any]) -> str:
        return (f"{x['elapsed_s']:.2f}s, {x['prefill_tokens_computed']:,} prefill tokens computed, "
                f"{x['cached_prompt_tokens']:,} from cache (hit rate {x['hit_rate']:.1%}), "
                f"{x['num_preemptions']} preemptions")

    tier = r.get("offload_tier_on")
    rows = [
        ("model", f"{e['model']} ({e['device']}, {e['dtype']}, load_format={e['load_format']})"),
        ("workload", f"{p['num_prompts']} requests, {p['num_prefixes']} prefixes x {p['prefix_len']} + "
                     f"{p['suffix_len']} own tokens, {p['output_len']} out "
                     f"({w['total_input_tokens']:,} prompt tokens)"),
        *([("caching on + offload tier", line(tier) + f", {tier['offload_tier_hit_tokens']:,} from host memory"),
           ("caching on, no tier", line(on))] if tier else [("caching on", line(on))]),
        ("caching off", line(off)),
        ("speedup (off / on)", f"{r['speedup']:.2f}x"),
        ("prefill tokens saved", f"{r['prefill_tokens_saved']:,} ({r['prefill_reduction']:.1%})"),
    ]
    if tier:
        rows.append(("saved by the tier", f"{r['offload_prefill_tokens_saved']:,} prefill tokens"))
    if "kv_timeline" in r:
        rows.append(("KV timeline", f"{r['kv_timeline']['png']} (+ {r['kv_timeline']['json']})"))
    common.print_table("pagedlm bench prefix", rows)
