"""``pagedlm bench throughput``: offline batch throughput through ``LLM.generate``.

All requests are submitted at once (like nano-vllm's bench.py and vLLM's ``benchmark_throughput``)
and the clock runs from the ``generate`` call to its return, after an untimed warm-up batch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from typing import Any

from pagedlm.core.bench import common, structured
from pagedlm.core.bench.images import add_image_options, image_prompts, run_hf_generate, warm_up_images
from pagedlm.core.bench.lora import RandomAdapters, add_lora_options, engine_overrides
from pagedlm.core.bench.profile import profiled
from pagedlm.core.bench.timeline import StepRecorder, write_timelines
from pagedlm.core.bench.workloads import add_workload_options, workload_from_args
from pagedlm.core.platforms import resolve_platform


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput (requests/s, tokens/s) through LLM.generate",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(p)
    add_lora_options(p)
    add_image_options(p)
    p.add_argument("--compare", choices=["hf"], default=None,
                   help="also run the workload through HF transformers' continuous batching and print the ratio")
    p.add_argument("--hf-attn-implementation", default="paged|sdpa",
                   help="attn_implementation for --compare hf (e.g. paged|sdpa, paged|flash_attention_2, sdpa)")
    p.add_argument("--kv-timeline", default=None, metavar="FILE.png",
                   help="plot KV-cache blocks, requests and tokens per engine step (samples go to FILE.json)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="run the timed batch under torch.profiler; DIR gets the top ops and device time "
                        "(profiling slows the host: compare device times, not throughput)")
    structured.add_structured_output_options(p)
    common.add_engine_options(p)
    p.set_defaults(func=run)


def _need_len(args: argparse.Namespace) -> int | None:
    if args.images_per_request:
        return None  # image placeholders lengthen prompts: the model's own context
    if args.workload == "nano":
        return 2048  # nano's longest possible request (1024 + 1024); its bench.py uses 4096
    if args.workload == "fixed":
        return args.input_len + args.output_len
    return None  # sharegpt-like adapts its lengths to max_model_len


def run(args: argparse.Namespace) -> int:
    return common.run_offline(args, _need_len(args), measure, _print)


def measure(args: argparse.Namespace, setup: common.EngineSetup) -> dict[str, Any]:
    # With data parallelism every replica's engine core runs in its own process: its per-step
    # statistics (steps, KV use, preemptions) stay there, and a profile of this process or a
    # one-device HF baseline would not describe the run.
    data_parallel = (setup.kwargs.get("data_parallel_size") or 1) > 1
    if data_parallel:
        for flag, value in (("--kv-timeline", args.kv_timeline), ("--profile", args.profile),
                            ("--compare", args.compare)):
            if value:
                raise ValueError(f"{flag} needs one engine core in this process; with --data-parallel-size "
                                 f"{setup.kwargs['data_parallel_size']} each replica runs its own")
    vocab = setup.vocab_size()
    if args.workload == "sharegpt-like" and setup.kwargs.get("max_model_len") is None:
        # The workload's clip range fits 2 x 1024 tokens; its lengths adapt to a shorter context.
        setup.kwargs["max_model_len"] = min(2048, setup.model_max_len())
    workload = workload_from_args(args, vocab_size=vocab, max_model_len=setup.kwargs.get("max_model_len"))
    if args.num_loras and args.compare:
        raise ValueError("--compare hf runs the base model only; drop --num-loras (or --compare)")
    setup.kwargs.update(engine_overrides(args, setup.kwargs))
    if args.structured_output_schema:
        if data_parallel:
            raise ValueError("--structured-output-schema measures the bitmasks of one engine core in this process")
        structured.prepare_engine(setup.kwargs, vocab)
    t_init = time.perf_counter()
    llm = setup.build()
    init_s = time.perf_counter() - t_init
    adapters = RandomAdapters(llm, args.num_loras, args.lora_rank, seed=args.seed) if args.num_loras else None
    rss_mb = common.resident_memory_mb()
    engine = common.engine_summary(llm, setup)
    common.warm_up(llm, vocab)
    warm_up_images(args, llm)
    recorder = None if data_parallel else StepRecorder(llm)
    prompts = image_prompts(args, llm, workload.prompts) or [{"prompt_token_ids": p} for p in workload.prompts]
    params = workload.sampling_params()
    bitmask_cost = None
    if args.structured_output_schema:
        structured.apply_schema(args.structured_output_schema, params)
        structured.warm_up(llm, params, workload.prompts[0])
        bitmask_cost = structured.BitmaskCost()
    recorder = None if data_parallel else StepRecorder(llm)
    if recorder is not None:
        recorder.restart_clock()
    with profiled(args.profile, engine["device"]) as profile_summary, \
            (bitmask_cost.measuring() if bitmask_cost is not None else contextlib.nullcontext()):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False,
                               lora_request=adapters.for_requests(len(prompts)) if adapters else None)
        elapsed = time.perf_counter() - start
    if adapters is not None:
        adapters.cleanup()
    if recorder is not None:
        recorder.finish(llm)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if recorder is None:  # the statistics stay in the replicas' processes: unknown, not zero
        steps: dict[str, Any] = {}
        step_stats = dict.fromkeys(("num_steps", "peak_kv_cache_usage", "peak_used_blocks", "num_preemptions"))
    else:
        steps = recorder.summary()
        step_stats = {"num_steps": steps.get("num_steps", 0),
                      "peak_kv_cache_usage": steps.get("peak_kv_cache_usage", 0.0),
                      "peak_used_blocks": steps.get("peak_used_blocks", 0),
                      "num_preemptions": steps.get("num_preemptions", 0)}
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "engine": engine,
        "workload": workload.summary(),
        "init_s": init_s,
        "resident_memory_after_load_mb": rss_mb,
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": num_in / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        **step_stats,
        "prefix_cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "num_images": args.images_per_request * len(outputs),
        "images_per_s": args.images_per_request * len(outputs) / elapsed,
        "steps": steps,
    }
    if adapters is not None:
        result["lora"] = adapters.summary()
    if profile_summary:
        result["profile"] = profile_summary
        if adapters is not None and profile_summary.get("device_time_s"):
            result["lora"]["kernel_share_of_device_time"] = (profile_summary["lora_device_time_s"]
                                                             / profile_summary["device_time_s"])
    if bitmask_cost is not None:
        result["structured_outputs"] = {"schema": args.structured_output_schema, **bitmask_cost.summary(llm)}
    if args.kv_timeline:
        title = (f"pagedlm bench throughput: {engine['model']} ({engine['device']}, {engine['dtype']}), "
                 f"workload {workload.name} x{workload.num_requests}\n{engine['num_blocks']:,} blocks x "
                 f"{engine['block_size']} tokens, max_num_seqs={engine['max_num_seqs']}, "
                 f"max_num_batched_tokens={engine['max_num_batched_tokens']}, "
                 f"prefix caching {'on' if engine['enable_prefix_caching'] else 'off'}")
        png, js = write_timelines(args.kv_timeline, [("pagedlm", recorder.samples)], title, engine)
        result["kv_timeline"] = {"png": png, "json": js}
    if args.compare == "hf":
        kv_tokens = int(engine["num_blocks"] or 0) * int(engine["block_size"])
        dtype = llm.vllm_config.model_config.dtype
        device = engine["device"]
        model_dir = str(setup.kwargs["model"])
        dummy = setup.kwargs.get("load_format") == "dummy"
        mm_processor = llm.llm_engine.processor.mm_processor
        llm.shutdown()
        del llm
        left = _release_device_memory(device)
        if args.images_per_request:
            try:
                result["hf"] = run_hf_generate(outputs, prompts, mm_processor, model_dir=model_dir, dummy=dummy,
                                               dtype=dtype, device=device, batch_size=args.hf_batch_size,
                                               seed=args.seed)
            except Exception as e:  # noqa: BLE001 - HF's failure is a result to report
                result["hf"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            del outputs
            result["hf"] = _compare(args, workload, model_dir=model_dir, dummy=dummy, dtype=dtype, device=device,
                                    kv_tokens=kv_tokens, engine=engine)
        if left is not None:
            result["hf"]["device_memory_held_before_hf_gib"] = left
        if "output_tokens_per_s" in result["hf"]:
            result["speedup_vs_hf"] = result["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"]
    return result


def _release_device_memory(device: str) -> float | None:
    """Free pagedlm's weights and KV cache before HF loads; returns GiB still allocated (None where
    the platform cannot tell, as on the CPU).

    HF sizes its cache from the free device memory, so memory pagedlm still held would shrink it.
    """
    gc.collect()
    import torch

    platform = resolve_platform(device)
    platform.empty_cache()
    allocated = platform.allocated_memory_bytes(torch.device(device))
    return None if allocated is None else allocated / 2**30


def _compare(args: argparse.Namespace, workload: Any, *, model_dir: str, dummy: bool, dtype: Any, device: str,
             kv_tokens: int, engine: dict[str, Any]) -> dict[str, Any]:
    from pagedlm.core.bench.hf_compare import run_hf

    try:
        return run_hf(workload, model_dir=model_dir, dummy=dummy, dtype=dtype, device=device,
                      attn_implementation=args.hf_attn_implementation, seed=args.seed, kv_tokens=kv_tokens,
                      max_batch_tokens=engine["max_num_batched_tokens"], max_requests=engine["max_num_seqs"])
    except Exception as e:  # noqa: BLE001 - HF's failure is a result to report, not a reason to lose ours
        return {"error": f"{type(e).__name__}: {e}"}


def _print(r: dict[str, Any]) -> None:
    e, w = r["engine"], r["workload"]
    rows = [
        ("model", f"{e['model']} ({e['device']}, {e['dtype']}, load_format={e['load_format']})"),
        ("workload", f"{w['name']}: {w['num_requests']} requests, {w['total_input_tokens']:,} in / "
                     f"{w['total_output_tokens']:,} out tokens"),
        ("elapsed (s)", r["elapsed_s"]),
        ("requests/s", r["requests_per_s"]),
        ("input tokens/s", r["input_tokens_per_s"]),
        ("output tokens/s", r["output_tokens_per_s"]),
        ("total tokens/s", r["total_tokens_per_s"]),
    ]
    if "lora" in r:
        share = r["lora"].get("kernel_share_of_device_time")
        kernels = "" if share is None else f"; LoRA kernels {share:.1%} of device time"
        rows.insert(2, ("LoRA", f"{r['lora']['num_loras']} adapters of rank {r['lora']['rank']}, requests "
                                f"round-robin{kernels}"))
    if r["num_images"]:
        rows.append(("images/s", r["images_per_s"]))
    if r["num_steps"] is None:
        rows.insert(2, ("data parallel", f"{e['data_parallel_size']} replicas (steps, KV use and preemptions "
                                         "stay in their processes)"))
    else:
        rows.insert(2, ("KV cache", f"{e['num_blocks']:,} blocks x {e['block_size']} tokens"))
        rows += [("engine steps", r["num_steps"]),
                 ("peak KV usage", f"{r['peak_kv_cache_usage']:.1%} ({r['peak_used_blocks']:,} blocks)"),
                 ("preemptions", r["num_preemptions"])]
    hf = r.get("hf")
    if hf is not None:
        if "error" in hf:
            rows.append(("HF transformers", f"failed: {hf['error']}"))
        else:
            if "images_per_s" in hf:
                rows.append(("HF images/s", hf["images_per_s"]))
            rows += [("HF elapsed (s)", hf["elapsed_s"]), ("HF output tokens/s", hf["output_tokens_per_s"]),
                     ("pagedlm / HF", f"{r['speedup_vs_hf']:.2f}x output tokens/s ({hf['api']}, "
                                      f"{hf['attn_implementation']})")]
    if "structured_outputs" in r:
        so = r["structured_outputs"]
        rows += structured.describe(so["schema"], so)
    if "kv_timeline" in r:
        rows.append(("KV timeline", f"{r['kv_timeline']['png']} (+ {r['kv_timeline']['json']})"))
    if "profile" in r:
        prof = r["profile"]
        busy = "" if prof["device_time_s"] is None else \
            f": device busy {prof['device_time_s']:.2f} s of {r['elapsed_s']:.2f} s (profiled run)"
        rows.append(("profile", f"{prof['directory']}/profile-top.txt{busy}"))
        rows += [(f"  {op['name'][:40]}", f"{op['device_time_s']:.3f} s, {op['calls']} calls")
                 for op in prof["top_device_ops"][:8]]
    common.print_table("pagedlm bench throughput", rows)
