"""The open GPU targets of docs/benchmarks.md in one run: each ``pagedlm bench`` command as a fresh
process (its JSON kept in ``--out``), then one short table of the figures each target is stated
in, beside the target, every ratio against bf16 measured in the same run.

    python packages/backend-cuda/benchmarks/gpu_targets.py --out DIR [--only fp8,w4a16,nano,latency]

Targets (Llama-3.1-8B and Qwen3-0.6B shapes, dummy weights):

- ``latency``: bf16 decode at batch 1 within 1.15x of one read of the weights at the copy
  bandwidth measured in the run;
- ``w4a16``: W4A16 g128 (compressed-tensors) decode at batch 1 at least 2.5x bf16's tokens/s, its
  weights at most 0.3x bf16's (also with the LM head and embedding packed, which the weights
  target needs);
- ``fp8``: FP8 weights + FP8 KV cache on the fixed 256 x 512/512 workload at least 1.6x bf16's
  output tokens/s;
- ``nano``: the nano workload at least 32,000 output tokens/s, median of 3 runs.

The table is also written to ``DIR/targets.json``; a command that fails is reported with its exit
status and the tail of its output, and the others still run.

``--ab KEY=VALUE`` (repeatable) measures a switch in the same run: each command runs twice in a
row, as it is and with those environment variables set (say ``PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel``),
and a second table and each run's headline figure side by side follow; ``DIR/ab.json`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

LATENCY = ["bench", "latency", "--model-config", "llama-3.1-8b", "--load-format", "dummy", "--batch-size", "1",
           "--input-len", "128", "--output-len", "128", "--num-iters", "3"]
FIXED = ["bench", "throughput", "--model-config", "llama-3.1-8b", "--load-format", "dummy", "--workload", "fixed",
         "--num-prompts", "256", "--input-len", "512", "--output-len", "512"]
NANO = ["bench", "throughput", "--model-config", "qwen3-0.6b", "--load-format", "dummy", "--workload", "nano"]
#: W4A16 g128 with the LM head and the embedding table packed too (compressed-tensors targets)
PACKED = json.dumps({"quantization_config": {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [],
    "config_groups": {"group_0": {"targets": ["Linear", "Embedding"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}})

#: run name -> the ``pagedlm`` arguments (without ``--output-json``)
RUNS: dict[str, list[str]] = {
    "latency bf16": LATENCY,
    "latency w4a16": [*LATENCY, "--quantization", "compressed-tensors"],
    "latency w4a16 packed": [*LATENCY, "--quantization", "compressed-tensors", "--hf-overrides", PACKED],
    "fixed bf16": FIXED,
    "fixed fp8": [*FIXED, "--quantization", "fp8", "--kv-cache-dtype", "fp8"],
    "nano 1": NANO, "nano 2": NANO, "nano 3": NANO,
}
#: target -> the runs it needs
TARGETS: dict[str, list[str]] = {
    "latency": ["latency bf16"],
    "w4a16": ["latency bf16", "latency w4a16", "latency w4a16 packed"],
    "fp8": ["fixed bf16", "fixed fp8"],
    "nano": ["nano 1", "nano 2", "nano 3"],
}


def _decode_ms(r: dict[str, Any]) -> float:
    return r["decode_latency_ms"]["p50"]


def _weights(r: dict[str, Any]) -> float:
    return r["weight_read_floor"]["weight_bytes"]


def evaluate(results: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """One row per figure: ``{"target", "figure", "value", "bar", "met"}`` from the runs' JSON
    (``None`` for a run that failed: its figures are reported as not measured)."""
    rows: list[dict[str, Any]] = []

    def row(target: str, figure: str, needs: list[str], value_of, bar: float, higher_is_better: bool) -> None:
        if any(results.get(name) is None for name in needs):
            rows.append({"target": target, "figure": figure, "value": None, "bar": bar, "met": False})
            return
        value = value_of(*(results[name] for name in needs))
        met = value >= bar if higher_is_better else value <= bar
        rows.append({"target": target, "figure": figure, "value": value, "bar": bar, "met": met})

    row("latency", "bf16 decode p50 / weight read", ["latency bf16"],
        lambda r: r["weight_read_floor"]["decode_p50_over_floor"], 1.15, False)
    row("w4a16", "decode speed-up vs bf16", ["latency bf16", "latency w4a16"],
        lambda b, q: _decode_ms(b) / _decode_ms(q), 2.5, True)
    row("w4a16", "decode speed-up vs bf16, head + embedding packed", ["latency bf16", "latency w4a16 packed"],
        lambda b, q: _decode_ms(b) / _decode_ms(q), 2.5, True)
    row("w4a16", "weights vs bf16, head + embedding packed", ["latency bf16", "latency w4a16 packed"],
        lambda b, q: _weights(q) / _weights(b), 0.3, False)
    row("fp8", "output tokens/s vs bf16", ["fixed bf16", "fixed fp8"],
        lambda b, q: q["output_tokens_per_s"] / b["output_tokens_per_s"], 1.6, True)
    row("nano", "output tokens/s, median of 3", ["nano 1", "nano 2", "nano 3"],
        lambda *rs: statistics.median(r["output_tokens_per_s"] for r in rs), 32000.0, True)
    return rows


def headline(result: dict[str, Any]) -> tuple[str, float]:
    """A run's one figure: decode p50 (ms) for a latency run, else output tokens/s."""
    if "decode_latency_ms" in result:
        return "decode p50 ms", _decode_ms(result)
    return "output tok/s", result["output_tokens_per_s"]


def parse_env(assignments: list[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` as a dict; ValueError naming an entry that is not one."""
    env = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum():
            raise ValueError(f"--ab {item!r}: expected KEY=VALUE, an environment variable and its value")
        env[key] = value
    return env


def _run(name: str, args: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    path = out / (name.replace(" ", "_") + ("_ab" if env else "") + ".json")
    cmd = [sys.executable, "-m", "pagedlm.core.cli", *args, "--output-json", str(path)]
    with_env = "".join(f"{k}={v} " for k, v in (env or {}).items())
    print(f"== {name}: {with_env}pagedlm {' '.join(args)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0 or not path.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        print(f"   failed (exit status {proc.returncode}):", *tail, sep="\n   ", flush=True)
        return None
    return json.loads(path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for each run's JSON and targets.json")
    parser.add_argument("--only", default=",".join(TARGETS),
                        help=f"comma-separated targets (default all: {', '.join(TARGETS)})")
    parser.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE",
                        help="also run every command with this environment variable set (repeatable)")
    args = parser.parse_args()
    wanted = [t.strip() for t in args.only.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in TARGETS]
    if unknown:
        parser.error(f"--only {args.only!r}: unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    try:
        ab_env = parse_env(args.ab)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(name for t in wanted for name in TARGETS[t]))
    results, ab_results = {}, {}
    for name in names:  # with --ab, each command and its variant back to back (same machine state)
        results[name] = _run(name, RUNS[name], out)
        if ab_env:
            ab_results[name] = _run(name, RUNS[name], out, ab_env)
    rows = [r for r in evaluate(results) if r["target"] in wanted]
    _print_rows(rows)
    (out / "targets.json").write_text(json.dumps(rows, indent=1))
    if ab_env:
        ab_rows = [r for r in evaluate(ab_results) if r["target"] in wanted]
        print(f"-- with {' '.join(f'{k}={v}' for k, v in ab_env.items())}:")
        _print_rows(ab_rows)
        runs = compare_runs(results, ab_results)
        for r in runs:
            print(f"{r['run']:<22} {r['figure']:<14} {r['base']!s:>12} -> {r['ab']!s:>12}  ({r['ratio']})")
        (out / "ab.json").write_text(json.dumps({"env": ab_env, "targets": ab_rows, "runs": runs}, indent=1))
    return 0


def compare_runs(base: dict[str, dict[str, Any] | None], ab: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Per run: its headline figure without and with the switch, and their ratio (``ab / base``;
    None where either run failed)."""
    rows = []
    for name, b in base.items():
        a = ab.get(name)
        (figure_b, vb), (figure_a, va) = headline(b) if b else (None, None), headline(a) if a else (None, None)
        ratio = round(va / vb, 4) if vb and va else None
        rows.append({"run": name, "figure": figure_b or figure_a or "-", "base": vb, "ab": va, "ratio": ratio})
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        value = "not measured" if r["value"] is None else f"{r['value']:,.3f}"
        verdict = "met" if r["met"] else "NOT met"
        print(f"{r['target']:<8} {r['figure']:<50} {value:>14}  target {r['bar']:g}  {verdict}")


if __name__ == "__main__":
    sys.exit(main())
