"""``pagedlm bench spec``: speculative decoding against no speculation, in the same run.

The workload is input-grounded (``--workload rewrite``): a code passage and the instruction to
repeat it with a variable renamed, through the model's chat template, so most of the answer copies
spans of the prompt, which n-gram drafts find. Two engines are built one after the other on the
same options, without and with ``--speculative-config`` (default: n-gram, k=4, lookups of 4, no
drafts in steps of 32 or more running requests):

* single request, greedy: decode tokens/s (tokens after the first over the time from the first
  token to the last), best of ``--num-iters`` runs, the two engines' runs interleaved; the outputs
  of both engines are compared (greedy speculation is lossless: they must be identical) and the
  acceptance rate printed;
* ``--batch-size`` requests at once (each renaming its own variable): output tokens/s over the
  whole batch, the throughput change a busy server would see.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedlm.core.bench import common

#: steps of 32 or more running requests run without drafts (asynchronously where the platform
#: schedules asynchronously): a busy batch gains the least from drafts and pays their host work
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "disable_by_batch_size": 32}
WORKLOADS = ("rewrite",)

_CODE = '''def summarize_orders(orders, tax_rate, discount_threshold):
    """Return the subtotal, tax, discount and total of a list of orders."""
    subtotal = 0.0
    for order in orders:
        if order["status"] == "cancelled":
            continue
        line_total = order["quantity"] * order["unit_price"]
        if order.get("coupon"):
            line_total = line_total - order["coupon"]
        subtotal = subtotal + line_total
    tax = subtotal * tax_rate
    discount = 0.0
    if subtotal > discount_threshold:
        discount = subtotal * 0.05
    total = subtotal + tax - discount
    return {"subtotal": subtotal, "tax": tax, "discount": discount, "total": total}
'''
_RENAMES = ("subtotal", "tax", "discount", "total", "line_total", "orders", "order", "tax_rate")


def rewrite_prompt(index: int = 0) -> str:
    old = _RENAMES[index % len(_RENAMES)]
    return (f"{_CODE}\nRepeat the code above exactly, with the variable `{old}` renamed to `{old}_{index}`. "
            "Output only the code.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("spec", help="speculative decoding on vs off: decode tok/s, acceptance, throughput",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="rewrite", help="the prompt (input-grounded)")
    p.add_argument("--output-len", type=int, default=256, help="tokens of the single request")
    p.add_argument("--num-iters", type=int, default=3, help="single-request runs (the best counts)")
    p.add_argument("--batch-size", type=int, default=64, help="requests of the throughput run (0: skip it)")
    p.add_argument("--batch-output-len", type=int, default=64, help="tokens per request of the throughput run")
    common.add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("output_len", "num_iters", "batch_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.batch_size < 0:
        raise ValueError(f"--batch-size must be >= 0 (got {args.batch_size})")
    if args.speculative_config is None:
        args.speculative_config = dict(DEFAULT_SPEC)
    return common.run_offline(args, None, measure, _print)


def measure(args: argparse.Namespace, setup: common.EngineSetup) -> dict[str, Any]:
    spec = setup.kwargs.pop("speculative_config")
    if setup.kwargs.get("max_model_len") is None:
        # the prompt is about 250 tokens with a chat template: room for it and the longer output,
        # within the model's context
        need = 512 + max(args.output_len, args.batch_output_len)
        setup.kwargs["max_model_len"] = min(-(-need // 16) * 16, setup.model_max_len())
    # NOTE: both engines at once, their runs interleaved, so a change in the machine's load
    # (a shared host) affects both alike
    engines = {"off": setup.build(speculative_config=None), "on": setup.build(speculative_config=spec)}
    engine_info = common.engine_summary(engines["off"], setup)
    runs = {name: _single_request(args, llm) for name, llm in engines.items()}
    for it in range(args.num_iters):
        for run in runs.values():
            _iterate(run, it)
    for run in runs.values():
        _finish_single(run)
    if args.batch_size:
        for name, llm in engines.items():
            runs[name].update(_batch(args, llm))
    for llm in engines.values():
        llm.shutdown()
    off, on = runs["off"], runs["on"]
    off_rate, on_rate = _best(off), _best(on)
    result: dict[str, Any] = {
        "benchmark": "spec",
        "engine": engine_info,
        "speculative_config": spec,
        "workload": args.workload,
        "prompt_tokens": off["prompt_tokens"],
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "off": off,
        "on": on,
        "identical_greedy_outputs": off["single_output"] == on["single_output"],
        "decode_speedup": on_rate / off_rate,
        "decode_speedup_median": on["decode_tokens_per_s_median"] / off["decode_tokens_per_s_median"],
    }
    if args.batch_size:
        result["batch_size"] = args.batch_size
        result["batch_output_len"] = args.batch_output_len
        result["batch_throughput_change"] = on["batch_output_tokens_per_s"] / off["batch_output_tokens_per_s"] - 1.0
    return result


def _best(run: dict[str, Any]) -> float:
    rates = sorted(run["decode_tokens_per_s_iters"])
    run["decode_tokens_per_s"] = rates[-1]
    run["decode_tokens_per_s_median"] = rates[len(rates) // 2]
    return run["decode_tokens_per_s"]


def _prompt(llm: Any, index: int) -> dict[str, Any]:
    tokenizer = llm.get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):  # a base model: the text as it is
        return {"prompt_token_ids": list(tokenizer(rewrite_prompt(index)).input_ids)}
    messages = [{"role": "user", "content": rewrite_prompt(index)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return {"prompt_token_ids": list(ids)}


def _single_request(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    from pagedlm.core import SamplingParams

    engine = llm.llm_engine
    spec_state = engine.core.scheduler.spec
    prompt = _prompt(llm, 0)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    return {"prompt_tokens": len(prompt["prompt_token_ids"]), "decode_tokens_per_s_iters": [],
            "_engine": engine, "_prompt": prompt, "_spec": spec_state, "_before": _acceptance(spec_state),
            "_params": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)}


def _iterate(run: dict[str, Any], it: int) -> None:
    engine = run["_engine"]
    engine.add_request(f"spec-{it}", run["_prompt"], run["_params"])
    first = last = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            tokens = list(out.outputs[0].token_ids)
            if first is None and tokens:
                first = now
            last = now
    assert first is not None and last is not None
    run["decode_tokens_per_s_iters"].append((len(tokens) - 1) / max(last - first, 1e-9))
    run["single_output"] = tokens


def _finish_single(run: dict[str, Any]) -> None:
    run["acceptance"] = _difference(_acceptance(run["_spec"]), run["_before"])
    for key in [k for k in run if k.startswith("_")]:
        del run[key]


def _batch(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    from pagedlm.core import SamplingParams

    spec_state = llm.llm_engine.core.scheduler.spec
    prompts = [_prompt(llm, i) for i in range(args.batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.batch_output_len, ignore_eos=True)
    before = _acceptance(spec_state)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"batch_output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "batch_acceptance": _difference(_acceptance(spec_state), before)}


def _acceptance(spec_state: Any) -> dict[str, Any]:
    if spec_state is None:
        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}
    s = spec_state.stats
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "per_pos": list(s.num_accepted_tokens_per_pos)}


def _difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return d


def _print(r: dict[str, Any]) -> None:
    e, off, on = r["engine"], r["off"], r["on"]
    acc = on["acceptance"]
    rows: list[tuple[str, Any]] = [
        ("model", f"{e['model']} ({e['device']}, {e['dtype']}, load_format={e['load_format']})"),
        ("speculative config", json.dumps(r["speculative_config"])),
        ("single request", f"{r['prompt_tokens']} prompt + {r['output_len']} output tokens, greedy, "
                           f"best of {r['num_iters']}"),
        ("decode tok/s, speculation off", off["decode_tokens_per_s"]),
        ("decode tok/s, speculation on", on["decode_tokens_per_s"]),
        ("decode speedup", f"{r['decode_speedup']:.2f}x (best runs), {r['decode_speedup_median']:.2f}x (median runs)"),
        ("acceptance rate", acc["acceptance_rate"] if acc["acceptance_rate"] is not None else "n/a"),
        ("mean acceptance length", acc["mean_acceptance_length"] or "n/a"),
        ("identical greedy outputs", r["identical_greedy_outputs"]),
    ]
    if "batch_size" in r:
        rows += [
            (f"batch {r['batch_size']} out tok/s, off", off["batch_output_tokens_per_s"]),
            (f"batch {r['batch_size']} out tok/s, on", on["batch_output_tokens_per_s"]),
            ("batch throughput change", f"{100.0 * r['batch_throughput_change']:+.1f}%"),
            ("batch acceptance rate", on["batch_acceptance"]["acceptance_rate"] or "n/a"),
        ]
    common.print_table("pagedlm bench spec", rows)
