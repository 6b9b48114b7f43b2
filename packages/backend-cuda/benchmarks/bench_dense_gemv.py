"""The decode GEMV of ``unquantized_gemm`` (kernels/dense_gemv.py) against cuBLAS (``F.linear``) on
a GPU: every configuration of a sweep, per shape and row count, and the table of the best ones.

    python packages/backend-cuda/benchmarks/bench_dense_gemv.py [--quick] [--rows 1,2,4]
        [--shapes llama8b.qkv,llama8b.o] [--output-json gemv.json]

Shapes: Llama-3.1-8B's qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096), down
(4096 x 14336) and LM head (128256 x 4096); Qwen3-0.6B's qkv (4096 x 1024), o (1024 x 2048),
gate_up (6144 x 1024) and down (1024 x 3072); rows T = 1, 2, 4; bf16 (``--dtype fp16``).

The sweep: BLOCK_N {4, 8, 16, 32, 64} x BLOCK_K {128, 256, 512, 1024} x SPLIT_K {1, 2, 4, 8} x
num_warps {2, 4, 8} x num_stages {1, 2, 3}, less what cannot fit or repeats another setting
(:func:`fits`); ``--quick`` times a pruned set of ~30 (the whole run well under 3 minutes on an
H200). Every configuration's variants are compiled first, in parallel (``launch.compile_only``,
as the engine's start-up does).

Timing is what a CUDA-graph replay costs, as decode runs: one graph of at least 20 back-to-back
calls cycling through copies of the weight (at least 256 MiB of them, 2 to 64 copies, so the 50
MB L2 of an H200 never holds the weight being read), the median of 5 to 20 replays (about 30 ms
of graphs; cuBLAS 20), per call. TB/s is the weight's bytes per call over its time.

Each configuration's output is first checked against ``x.float() @ w.float().T`` (max abs error
at most one bf16/fp16 unit in the last place at the output's largest magnitude); a wrong one is
reported and not timed, and any wrong result makes the exit status non-zero. The table printed
at the end is :data:`~pagedlm.backends.cuda.kernels.dense_gemv.DEFAULT_CONFIGS` ready to paste:
the best configuration where it beats cuBLAS by ``--min-speedup`` (default 1.03), None where not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedlm.backends.cuda.kernels.dense_gemv import GemvConfig, dense_gemv, gemv_config
from pagedlm.backends.cuda.kernels.launch import compile_only

#: (model, layer, N, K)
SHAPES = [
    ("llama8b", "qkv", 6144, 4096), ("llama8b", "o", 4096, 4096), ("llama8b", "gate_up", 28672, 4096),
    ("llama8b", "down", 4096, 14336), ("llama8b", "lm_head", 128256, 4096),
    ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o", 1024, 2048), ("qwen3-0.6b", "gate_up", 6144, 1024),
    ("qwen3-0.6b", "down", 1024, 3072),
]
#: calls per graph (at least), weight copies cycled through (at most), and their bytes (at least)
MIN_CALLS = 20
MAX_COPIES = 64
MIN_BYTES_CYCLED = 256 << 20
#: replays timed per configuration: enough for ~30 ms of graphs, within these bounds (cuBLAS: the most)
MIN_REPLAYS, MAX_REPLAYS = 5, 20
#: shared memory the pipelined stages may take (an H200 block may have 227 KiB)
MAX_STAGE_BYTES = 192 << 10


def sweep(quick: bool) -> list[GemvConfig]:
    if not quick:
        grid = itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (1, 2, 4, 8), (2, 4, 8), (1, 2, 3))
        return [GemvConfig(*c) for c in grid]
    grid = [GemvConfig(n, k, s, 4, 1) for n in (8, 16, 32) for k in (256, 512, 1024) for s in (1, 2, 4)]
    extra = [(16, 512, 1, 4, 3), (16, 512, 2, 4, 3), (8, 1024, 1, 4, 3), (16, 512, 2, 8, 1), (32, 512, 1, 8, 1),
             (16, 1024, 1, 8, 1), (8, 512, 1, 2, 1), (8, 512, 2, 2, 1), (4, 1024, 1, 2, 1), (64, 256, 1, 8, 1)]
    return grid + [GemvConfig(*c) for c in extra]


def effective_split(cfg: GemvConfig, k: int) -> int:
    """The splits the launch makes (dense_gemv: whole steps per split)."""
    k_per_split = math.ceil(math.ceil(k / cfg.split_k) / cfg.block_k) * cfg.block_k
    return math.ceil(k / k_per_split)


def fits(cfg: GemvConfig, t: int, n: int, k: int, elem: int = 2) -> str | None:
    """Why ``cfg`` is left out for ``t`` rows of ``[n, k]`` (None: it is timed)."""
    threads = 32 * cfg.num_warps
    per_thread = cfg.block_n * cfg.block_k // threads  # weight values a thread holds per step
    if cfg.block_k > k or cfg.block_n > n:
        return "block larger than the weight"
    if per_thread < 16 // elem:
        return "threads without a whole 16-byte vector"
    # the tile and, per row of x, a float32 accumulator of per_thread / VEC values: past these
    # the compiled kernel spills (seen in sm_90 builds)
    if per_thread > (64 if t > 2 else 128):
        return "too many values per thread"
    if cfg.num_stages > 1 and cfg.num_stages * (cfg.block_n + t) * cfg.block_k * elem > MAX_STAGE_BYTES:
        return "pipeline stages exceed shared memory"
    if effective_split(cfg, k) != cfg.split_k:
        return "fewer splits than asked (a repeat)"
    return None


def time_per_call(fn: Callable[[int], object], copies: int, replays: int = MAX_REPLAYS) -> float:
    """Milliseconds per ``fn(i % copies)`` (``i`` the call, ``i % copies`` its weight copy): the
    median of ``replays`` replays of a CUDA graph of ``max(MIN_CALLS, copies)`` back-to-back calls."""
    calls = max(MIN_CALLS, copies)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(max abs error, tolerance)``: one unit in the last place at the reference's largest value."""
    err = float((out.float() - ref).abs().max())
    return err, torch.finfo(out.dtype).eps * float(ref.abs().max())


def compile_all(x: torch.Tensor, w: torch.Tensor, configs: list[GemvConfig]) -> float:
    """Compile every configuration's variant in parallel; seconds taken. A configuration that does
    not build is left for its own (timed) launch to report."""
    start = time.perf_counter()
    try:
        with compile_only():
            for cfg in configs:
                dense_gemv(x, w, None, cfg)
    except Exception as e:  # noqa: BLE001 - one variant failing must not stop the sweep
        print(f"  (parallel compile stopped: {type(e).__name__}: {str(e)[:120]}; the rest compile at launch)")
    return time.perf_counter() - start


def fmt(cfg: GemvConfig | None) -> str:
    return "None" if cfg is None else f"GemvConfig({', '.join(str(v) for v in cfg)})"


def bench_shape(model: str, layer: str, n: int, k: int, rows: list[int], configs: list[GemvConfig],
                dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    size = n * k * torch.finfo(dtype).bits // 8
    # a weight larger than L2 needs few copies; small ones many (each call reads another copy)
    copies = max(2, min(MAX_COPIES, math.ceil(MIN_BYTES_CYCLED / size)))
    base = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float32).mul_(k**-0.5).to(dtype)
    weights = [base] + [base.clone() for _ in range(copies - 1)]
    results = []
    for t in rows:
        x = torch.randn(t, k, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
        ref = x.float() @ base.float().T
        cublas_ms = time_per_call(lambda i, x=x: F.linear(x, weights[i]), copies)
        # the kernel's graphs take about as long as cuBLAS's: replays for ~30 ms of them
        graph_ms = max(MIN_CALLS, copies) * cublas_ms
        replays = max(MIN_REPLAYS, min(MAX_REPLAYS, math.ceil(30.0 / graph_ms)))
        cublas_err, tol = check(F.linear(x, base), ref)
        default = gemv_config(t, n, k)
        todo = [c for c in configs if fits(c, t, n, k) is None]
        if default is not None and default not in todo:
            todo.append(default)
        compile_s = compile_all(x, base, todo)
        timings, failures = [], []
        for cfg in todo:
            try:
                out = dense_gemv(x, base, None, cfg)
                err, _ = check(out, ref)
                if err > tol:
                    failures.append({"config": list(cfg), "error": f"max abs error {err:.3g} > {tol:.3g}"})
                    print(f"  {layer} T={t} {fmt(cfg)} is WRONG: max abs error {err:.3g} > {tol:.3g}")
                    continue
                ms = time_per_call(lambda i, x=x, cfg=cfg: dense_gemv(x, weights[i], None, cfg), copies, replays)
            except Exception as e:  # noqa: BLE001 - out of resources etc.: a result, not the end
                failures.append({"config": list(cfg), "error": f"{type(e).__name__}: {str(e)[:160]}"})
                continue
            timings.append({"config": list(cfg), "us": ms * 1e3, "tb_s": size / ms / 1e9, "max_abs_err": err})
        timings.sort(key=lambda r: r["us"])
        best = timings[0] if timings else None
        default_row = next((r for r in timings if default is not None and r["config"] == list(default)), None)
        row = {"model": model, "layer": layer, "n": n, "k": k, "t": t, "weight_bytes": size, "copies": copies,
               "cublas_us": cublas_ms * 1e3, "cublas_tb_s": size / cublas_ms / 1e9, "cublas_max_abs_err": cublas_err,
               "tolerance": tol, "best": best, "default": default_row, "compile_s": compile_s,
               "num_timed": len(timings), "timings": timings, "failures": failures}
        results.append(row)
        line = f"{model:>10} {layer:<8} T={t} cuBLAS {row['cublas_us']:7.1f} us {row['cublas_tb_s']:5.2f} TB/s"
        if best:
            line += (f" | best {best['us']:7.1f} us {best['tb_s']:5.2f} TB/s x{row['cublas_us'] / best['us']:4.2f} "
                     f"{fmt(GemvConfig(*best['config']))} err {best['max_abs_err']:.2g} (tol {tol:.2g}, cuBLAS "
                     f"{cublas_err:.2g}): ok")
        if default_row:
            line += f" | table's {default_row['us']:.1f} us"
        print(line + f" [{len(timings)} timed, {len(failures)} failed, compile {compile_s:.0f} s]", flush=True)
    return results


def paste_table(results: list[dict], min_speedup: float) -> str:
    """``DEFAULT_CONFIGS`` as Python: the best configuration per (N, K) and rows where it beats
    cuBLAS by ``min_speedup``, else None; shapes where it never does are left out."""
    lines = ["DEFAULT_CONFIGS: dict[tuple[int, int], dict[int, GemvConfig | None]] = {"]
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        by_shape.setdefault((r["n"], r["k"]), []).append(r)
    for (n, k), rows in by_shape.items():
        entries, notes = [], []
        for r in rows:
            best = r["best"]
            speedup = r["cublas_us"] / best["us"] if best else 0.0
            cfg = GemvConfig(*best["config"]) if best and speedup >= min_speedup else None
            entries.append(f"{r['t']}: {fmt(cfg)}")
            times = f" ({r['cublas_us']:.1f} -> {best['us']:.1f} us)" if best else ""
            notes.append(f"T={r['t']} x{speedup:.2f}{times}")
        if all(e.endswith("None") for e in entries):
            lines.append(f"    # {rows[0]['model']} {rows[0]['layer']} ({n}, {k}): cuBLAS wins ({', '.join(notes)})")
            continue
        lines.append(f"    # {rows[0]['model']} {rows[0]['layer']}: {', '.join(notes)}")
        lines.append(f"    ({n}, {k}): {{{', '.join(entries)}}},")
    lines.append("}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a pruned sweep (~30 configurations)")
    parser.add_argument("--rows", default="1,2,4", help="comma-separated row counts T of 1, 2, 4 (default all)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated model.layer names (default: all), e.g. llama8b.qkv,llama8b.o")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--min-speedup", type=float, default=1.03, help="the table's bar over cuBLAS")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = [int(r) for r in args.rows.split(",")]
    if not set(rows) <= {1, 2, 4}:
        parser.error("--rows: 1, 2 and 4 only (the table's keys; 3 rows take the 4-row entry)")
    shapes = SHAPES
    if args.shapes:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in SHAPES if f"{s[0]}.{s[1]}" in wanted]
        if not shapes:
            parser.error(f"no shape matches {args.shapes}; known: {', '.join(f'{m}.{x}' for m, x, _, _ in SHAPES)}")
    configs = sweep(args.quick)
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()}, {len(configs)} configurations before pruning, {args.dtype}")
    results = []
    for model, layer, n, k in shapes:
        results += bench_shape(model, layer, n, k, rows, configs, dtype, gen)
        torch.cuda.empty_cache()  # the shape's weight copies (up to 2 GiB for the LM head)
    elapsed = time.perf_counter() - start

    print(f"\nsummary ({elapsed:.0f} s): per shape and row count, cuBLAS against the best configuration")
    print(f"{'shape':<20} {'T':>2} {'cuBLAS us':>10} {'TB/s':>6} {'best us':>9} {'TB/s':>6} {'speed-up':>8}  config")
    for r in results:
        best = r["best"]
        name = f"{r['model']}.{r['layer']}"
        if best is None:
            print(f"{name:<20} {r['t']:>2} {r['cublas_us']:10.1f} {r['cublas_tb_s']:6.2f}  (no configuration ran)")
            continue
        print(f"{name:<20} {r['t']:>2} {r['cublas_us']:10.1f} {r['cublas_tb_s']:6.2f} {best['us']:9.1f} "
              f"{best['tb_s']:6.2f} {r['cublas_us'] / best['us']:8.2f}  {fmt(GemvConfig(*best['config']))}")
    table = paste_table(results, args.min_speedup)
    print(f"\nthe table for kernels/dense_gemv.py (>= x{args.min_speedup} over cuBLAS):\n{table}")
    wrong = [(r["model"], r["layer"], r["t"], f) for r in results for f in r["failures"]
             if f["error"].startswith("max abs error")]
    print(f"\nevery best configuration's output within tolerance of float32: {'yes' if not wrong else 'NO'}; "
          f"{len(wrong)} configurations gave wrong results")
    for w in wrong[:20]:
        print("  WRONG:", w)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "quick": args.quick,
                       "rows": rows, "elapsed_s": elapsed, "min_speedup": args.min_speedup, "table": table,
                       "results": results}, f, indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
