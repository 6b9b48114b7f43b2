"""Quantized GEMMs on a GPU: each kernel against dequantize-then-matmul, its time against a bf16
matmul, and the weight-read bandwidth it reaches.

    python packages/backend-cuda/benchmarks/bench_quant.py [--rows 1,16,256] [--full] [--output-json quant.json]

For Llama-3.1-8B's four projections (qkv, o, gate_up, down) and each row count M (default 1, 16
and 256: a decode step at batch 1, 16 and 256), it times ``F.linear`` in bf16 and each quantized
op: W4A16 group 128 (symmetric, zero points, act-order), W8A16 per channel, FP8 W8A8 (dynamic
and static activation scales, and the activation quantization alone), INT8 W8A8 dynamic
(``--full``: every bit width x group size x zero points / act-order). Each op is first checked
against core's torch reference (the op contract); a result off by more than the tolerance makes
the exit status non-zero.

Timing is what a CUDA-graph replay costs, as in the engine: 20 calls captured in one graph,
median of 20 replays, per call. The calls cycle through copies of the weights (at least 256 MiB
in all) so they are read from HBM, not from the 50 MiB L2. ``GB/s`` is the op's weight bytes
(packed weights, scales, zero points, g_idx) per call over its time; the H200's HBM3e peaks at
4.8 TB/s. The summary adds the four projections up: one decoder layer's linears, per row count.

``--sweep-gemv`` instead times the decode matrix-vector kernel (W4A16 group 128, one row) at
each shape over its tuning grid (columns per program, word rows per step, programs per SM,
the next step's loads in registers or not) and prints the best setting per shape next to the
default's. (Pipeline stages through shared memory were in the grid until 2026-12-06 and never
won.)

``--sweep-mma`` times the tensor-core W4A16 GEMV (``kernels/w4a16_mma.py``) over its grid (warps
per block, K blocks in flight per warp, warps per SM the grid is sized for, and on sm_90 bulk
copies or not; also the defaults with bulk copies) at each shape and row
count (default 1, 4, 8), beside the Triton GEMV, and sums each setting over the four projections.

``--sweep-batch`` times W4A16 on that layout past 8 rows (9 to 128), the GEMV once per 8 rows
against the weights dequantized into dense chunks for cuBLAS, beside bf16: where the two cross is
what ``w4a16_mma.CHUNKED_MAX_ROWS`` should be.

``--sweep-fp8`` times the row-wise FP8 GEMM alone at decode-batch row counts (16 to 512):
``torch._scaled_mm``, the same with its operands swapped, and the Triton kernel of
``kernels/fp8_gemm.py`` over its tile grid (small tiles, and large ones split along K), summed
over the projections it would take (a split entry counts cuBLASLt's time for a product it would not
split, as the op does); it prints the tile table that follows (``--apply`` writes it into that file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedlm.backends.cuda.kernels.quant_act import quantize_rows
from pagedlm.backends.cuda.kernels.quant_gemm import fp8_scaled_mm, int8_scaled_mm, wna16_gemm, wna16_repack
from pagedlm.core.layers.quantization.utils import (
    fp8_scaled_mm_ref,
    int8_scaled_mm_ref,
    pack_rows,
    wna16_gemm_ref,
)

#: name, N, K of Llama-3.1-8B's linear layers
LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
CALLS_PER_GRAPH = 20
MIN_BYTES_CYCLED = 256 << 20


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def time_per_call(fn: Callable[[int], object], copies: int) -> tuple[float, str]:
    """Milliseconds per ``fn(i)`` (``i`` the weight copy), replayed from a CUDA graph; eager
    (launch gaps included) when the op cannot be captured, which the second value says."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(CALLS_PER_GRAPH):
                fn(i % copies)
        run, mode = graph.replay, "graph"
    except RuntimeError as e:  # report it, and time it eagerly
        print(f"  (not capturable: {e}; timed eagerly)")

        def run() -> None:
            for i in range(CALLS_PER_GRAPH):
                fn(i % copies)
        mode = "eager"
    for _ in range(3):
        run()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2], mode


def time_cycled(call: Callable[[torch.Tensor], object], weight: torch.Tensor, size: int) -> tuple[float, str]:
    """:func:`time_per_call` of ``call(w)`` over copies of ``weight`` (``size`` bytes of weights
    per call) that add up to at least ``MIN_BYTES_CYCLED``."""
    copies = max(1, min(64, math.ceil(MIN_BYTES_CYCLED / size)))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    return time_per_call(lambda i: call(weights[i]), copies)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def wna16_cases(full: bool) -> list[tuple[int, int, bool, bool]]:
    """(bits, group, zero points, act-order)."""
    if not full:
        return [(4, 128, False, False), (4, 128, True, False), (4, 128, False, True), (8, -1, False, False)]
    return [(bits, group, zeros, act) for bits in (4, 8) for group in (32, 64, 128, -1)
            for zeros, act in ((False, False), (True, False), (False, True)) if not (act and group == -1)]


def sweep_gemv(dev: torch.device, gen: torch.Generator) -> None:
    """The GEMV's tuning grid at one row, per Llama-3.1-8B shape (W4A16 group 128, symmetric)."""
    from pagedlm.backends.cuda.kernels.wna16_gemv import wna16_gemv

    for name, n, k in LLAMA_8B:
        x = torch.randn(1, k, device=dev, generator=gen, dtype=torch.bfloat16)
        qw = pack_rows(torch.randint(0, 16, (k, n), device=dev, generator=gen, dtype=torch.int32), 4)
        s = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
        ref = wna16_gemm_ref(x.float(), qw, s.float(), None, None, 4, 128)
        size = nbytes(qw, s)
        grid = [dict(block_n=b, cells=c, programs_per_sm=p, prefetch=f)
                for b, c, p, f in itertools.product((64, 128, 256), (8, 16, 32), (2, 4, 6, 8), (False, True))]
        timings = []
        for tuning in grid:
            if rel_err(wna16_gemv(x, qw, s, None, None, 4, 128, **tuning), ref) > 2e-2:
                print(f"  {name}: {tuning} is WRONG")
                continue
            t, _ = time_cycled(lambda w, x=x, s=s, a=tuning: wna16_gemv(x, w, s, None, None, 4, 128, **a), qw, size)
            timings.append((t, tuning))
        default = next(t for t, c in timings
                       if c == dict(block_n=64, cells=32, programs_per_sm=8, prefetch=False))
        timings.sort(key=lambda item: item[0])
        print(f"{name} N={n} K={k}: default {default * 1e3:.1f} us ({size / default / 1e6:.0f} GB/s); best:")
        for t, tuning in timings[:3]:
            print(f"  {t * 1e3:.1f} us ({size / t / 1e6:.0f} GB/s) {tuning}")


def sweep_mma(dev: torch.device, gen: torch.Generator, rows: list[int]) -> None:
    """The tensor-core W4A16 GEMV (group 128, symmetric) over its grid (warps per block, blocks in
    flight per warp, warps per SM the grid is sized for) and at its defaults, per Llama-3.1-8B
    shape and row count, next to the Triton GEMV's default (at most 4 rows)."""
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack, w4a16_mma_gemv
    from pagedlm.backends.cuda.kernels.wna16_gemv import GEMV_MAX_ROWS, wna16_gemv

    total: dict[str, float] = {}
    for m in rows:
        for name, n, k in LLAMA_8B:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            qw = pack_rows(torch.randint(0, 16, (k, n), device=dev, generator=gen, dtype=torch.int32), 4)
            s = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
            ref = wna16_gemm_ref(x.float(), qw, s.float(), None, None, 4, 128)
            size = nbytes(qw, s)
            line = [f"M={m} {name} N={n} K={k}:"]
            if m <= GEMV_MAX_ROWS:
                t, _ = time_cycled(lambda w, x=x, s=s: wna16_gemv(x, w, s, None, None, 4, 128), qw, size)
                line.append(f"triton {t * 1e3:.1f} us ({size / t / 1e6:.0f} GB/s)")
                total[f"M={m} triton"] = total.get(f"M={m} triton", 0.0) + t
            packed = mma_repack(qw)
            timings = []
            bulk_options = (False, True) if torch.cuda.get_device_capability(dev) >= (9, 0) else (False,)
            for warps, stages, per_sm, bulk in itertools.product((1, 2, 4, 8), (4, 8), (16, 32, 64), bulk_options):
                tuning = dict(warps=warps, stages=stages, warps_per_sm=per_sm, bulk=bulk)
                if rel_err(w4a16_mma_gemv(x, packed, s, None, 128, **tuning), ref) > 2e-2:
                    line.append(f"{tuning} WRONG")
                    continue
                t, _ = time_cycled(lambda w, x=x, s=s, a=tuning: w4a16_mma_gemv(x, w, s, None, 128, **a), packed, size)
                key = f"warps={warps} stages={stages} warps_per_sm={per_sm} bulk={int(bulk)}"
                timings.append((t, key))
                total[f"M={m} mma {key}"] = total.get(f"M={m} mma {key}", 0.0) + t
            t_default, _ = time_cycled(lambda w, x=x, s=s: w4a16_mma_gemv(x, w, s, None, 128), packed, size)
            total[f"M={m} mma default"] = total.get(f"M={m} mma default", 0.0) + t_default
            if len(bulk_options) > 1:  # the defaults with bulk copies (PAGEDLM_CUDA_W4A16_BULK=1)
                t_bulk, _ = time_cycled(lambda w, x=x, s=s: w4a16_mma_gemv(x, w, s, None, 128, bulk=True), packed,
                                        size)
                total[f"M={m} mma default bulk"] = total.get(f"M={m} mma default bulk", 0.0) + t_bulk
                line.append(f"bulk {t_bulk * 1e3:.1f} us")
            t, key = min(timings)
            line.append(f"mma default {t_default * 1e3:.1f} us ({size / t_default / 1e6:.0f} GB/s), "
                        f"best {key} {t * 1e3:.1f} us ({size / t / 1e6:.0f} GB/s)")
            print("  ".join(line), flush=True)
    print("sum over the four projections (one layer):")
    for key, t in sorted(total.items(), key=lambda item: item[1]):
        print(f"  {key}: {t * 1e3:.1f} us")


#: batch rows past the tensor-core GEMV's 8 (``--sweep-batch``)
BATCH_SWEEP_ROWS = (9, 16, 24, 32, 48, 64, 96, 128)


def sweep_batch(dev: torch.device, gen: torch.Generator) -> None:
    """W4A16 g128 on the mma layout past 8 rows, per row count summed over Llama-3.1-8B's four
    products: the tensor-core GEMV once per 8 rows against the dense chunks + cuBLAS
    (``w4a16_dequant``), beside bf16 ``F.linear``; the crossover is what ``CHUNKED_MAX_ROWS``
    should be."""
    from pagedlm.backends.cuda.kernels.w4a16_dequant import mma_dequantized_matmul
    from pagedlm.backends.cuda.kernels.w4a16_mma import CHUNKED_MAX_ROWS, mma_repack, w4a16_mma_gemv

    weights = []
    for _, n, k in LLAMA_8B:
        qw = pack_rows(torch.randint(0, 16, (k, n), device=dev, generator=gen, dtype=torch.int32), 4)
        s = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
        weights.append((qw, mma_repack(qw), s, torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16)))
    for m in BATCH_SWEEP_ROWS:
        total = {"gemv": 0.0, "dense": 0.0, "bf16": 0.0}
        for qw, packed, s, w in weights:
            x = torch.randn(m, qw.shape[0] * 8, device=dev, generator=gen, dtype=torch.bfloat16)
            ref = wna16_gemm_ref(x.float(), qw, s.float(), None, None, 4, 128)
            for name, fn in (("gemv", lambda w_, x=x, s=s: w4a16_mma_gemv(x, w_, s, None, 128)),
                             ("dense", lambda w_, x=x, s=s: mma_dequantized_matmul(x, w_, s, None, 128))):
                if rel_err(fn(packed), ref) > 2e-2:
                    print(f"M={m} {name} WRONG")
                total[name] += time_cycled(fn, packed, nbytes(qw, s))[0]
            total["bf16"] += time_cycled(lambda w_, x=x: F.linear(x, w_), w, w.numel() * 2)[0]
        best = min(("gemv", "dense"), key=total.get)
        print(f"M={m}: GEMV per 8 rows {total['gemv'] * 1e3:.0f} us, dense + cuBLAS {total['dense'] * 1e3:.0f} us, "
              f"bf16 {total['bf16'] * 1e3:.0f} us a layer; best {best} (CHUNKED_MAX_ROWS is {CHUNKED_MAX_ROWS})",
              flush=True)


FP8_SWEEP_ROWS = (16, 64, 128, 256, 512)


def sweep_fp8(dev: torch.device, gen: torch.Generator, apply: bool, rows: tuple[int, ...] | list[int],
              split_only: bool = False) -> None:
    """The row-wise FP8 GEMM alone (activations already quantized) per row count, summed over the
    projections of one decoder layer that the op routes to the Triton kernel at that count (those
    where cuBLASLt's tiles would leave SMs idle): ``torch._scaled_mm``, the same with the operands
    swapped (``w @ x^T``, transposed back), and the Triton kernel over its tile grid. Prints the
    best tiles per row count and the :data:`ROWWISE_TILES` they make (None where cuBLASLt is
    within 3 %); ``apply`` writes that table into ``fp8_gemm.py``."""
    import re
    from pathlib import Path

    from triton.runtime.errors import OutOfResources

    from pagedlm.backends.cuda.kernels import fp8_gemm

    grid = [(bm, bn, 128, 8, w, st, 1) for bm in (64, 128) for bn in (32, 64, 128, 256) for w in (4, 8)
            for st in (3, 4, 5)]
    # few large tiles split along K (the split count follows the shape: fp8_gemm.split_k)
    grid += [(bm, bn, 128, 8, w, st, sp) for bm in (128, 256) for bn in (64, 128) for w in (4, 8) for st in (3, 4)
             for sp in (2, 4) if not (bm == 256 and w == 4)]
    if split_only:
        grid = [tiles for tiles in grid if tiles[-1] > 1]
    sms = fp8_gemm.num_sms(dev)
    # the row counts not swept keep their entries
    table: dict[int, tuple | None] = {m: t for m, t in fp8_gemm.ROWWISE_TILES.items() if m not in rows}
    for m in rows:
        totals: dict[object, float] = {}
        counts: dict[object, int] = {}
        routed = [(name, n, k) for name, n, k in LLAMA_8B
                  if math.ceil(m / fp8_gemm.CUBLAS_TILE[0]) * math.ceil(n / fp8_gemm.CUBLAS_TILE[1]) < sms]
        if not routed:
            print(f"M={m}: cuBLASLt fills the GPU at every shape")
            continue
        for name, n, k in routed:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            x_q, xs = quantize_rows(x, torch.float8_e4m3fn, None)
            wf = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.float8_e4m3fn)
            ws = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
            ref = torch._scaled_mm(x_q, wf.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16)
            calls: dict[object, Callable[[torch.Tensor], object]] = {
                "scaled_mm": lambda w, x_q=x_q, xs=xs, ws=ws: torch._scaled_mm(
                    x_q, w.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=torch.bfloat16),
                "scaled_mm swapped": lambda w, x_q=x_q, xs=xs, ws=ws: torch._scaled_mm(
                    w, x_q.t(), scale_a=ws.reshape(-1, 1), scale_b=xs.reshape(1, -1),
                    out_dtype=torch.bfloat16).t().contiguous(),
            }
            for tiles in grid:
                calls[tiles] = lambda w, x_q=x_q, xs=xs, ws=ws, t=tiles: fp8_gemm.fp8_rowwise_mm(
                    x_q, xs, w, ws, None, torch.bfloat16, t)
            shape_base = float("nan")
            for key, call in calls.items():
                if isinstance(key, tuple) and key[6] > 1 and fp8_gemm.product_split(m, n, k, key, sms) == 1:
                    # the op leaves a product its split tiles would not split to cuBLASLt
                    totals[key] = totals.get(key, 0.0) + shape_base
                    counts[key] = counts.get(key, 0) + 1
                    continue
                try:
                    if rel_err(call(wf), ref) > 1e-2:
                        print(f"  M={m} {name}: {key} is WRONG")
                        continue
                    t, _ = time_cycled(call, wf, nbytes(wf, ws))
                    if key == "scaled_mm":
                        shape_base = t
                except (OutOfResources, RuntimeError) as e:  # a grid point that does not fit (shared memory)
                    print(f"  M={m} {name}: {key} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                totals[key] = totals.get(key, 0.0) + t
                counts[key] = counts.get(key, 0) + 1
            torch.cuda.empty_cache()
        # only what ran (correctly) at every shape is a candidate for the row count
        complete = {key: t for key, t in totals.items() if counts[key] == len(routed)}
        ranked = sorted(((t, key) for key, t in complete.items() if isinstance(key, tuple)), key=lambda i: i[0])
        base = complete["scaled_mm"]
        print(f"M={m}: {', '.join(name for name, _, _ in routed)}: scaled_mm {base * 1e3:.1f} us, swapped "
              f"{complete.get('scaled_mm swapped', float('nan')) * 1e3:.1f} us; best Triton tiles:")
        for t, key in ranked[:4]:
            print(f"  {t * 1e3:.1f} us (x{base / t:.2f}) {key}")
        table[m] = ranked[0][1] if ranked and ranked[0][0] < 0.97 * base else None
    while table and table[max(table)] is None:  # past the last win, the op's default applies
        table.pop(max(table))
    literal = "{\n" + "".join(f"    {m}: {tiles},\n" for m, tiles in sorted(table.items())) + "}"
    print(f"ROWWISE_TILES = {literal}")
    if apply:
        path = Path(fp8_gemm.__file__)
        source = path.read_text()
        new = re.sub(r"(ROWWISE_TILES: dict\[int, Tiles \| None\] = )\{.*?\n\}", lambda mt: mt.group(1) + literal,
                     source, count=1, flags=re.S)
        path.write_text(new)
        print(f"written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts M (default 1,16,256; with --sweep-fp8 16,64,128,256,512)")
    parser.add_argument("--full", action="store_true", help="every bit width, group size, zero point and act-order")
    parser.add_argument("--sweep-gemv", action="store_true", help="tune the decode GEMV instead (see above)")
    parser.add_argument("--sweep-mma", action="store_true",
                        help="tune the tensor-core W4A16 GEMV instead (rows default 1,4,8)")
    parser.add_argument("--sweep-batch", action="store_true",
                        help="W4A16 past 8 rows: the GEMV per 8 rows against dense chunks + cuBLAS, per row count")
    parser.add_argument("--sweep-fp8", action="store_true",
                        help="tune the row-wise FP8 GEMM's tiles per row count instead (see above)")
    parser.add_argument("--apply", action="store_true", help="with --sweep-fp8: write the table it finds")
    parser.add_argument("--split-only", action="store_true",
                        help="with --sweep-fp8: only the tiles split along K (row counts past the small tiles' wins)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.sweep_gemv:
        sweep_gemv(dev, gen)
        return 0
    if args.sweep_mma:
        sweep_mma(dev, gen, [int(r) for r in (args.rows or "1,4,8").split(",")])
        return 0
    if args.sweep_batch:
        sweep_batch(dev, gen)
        return 0
    if args.sweep_fp8:
        sweep_fp8(dev, gen, args.apply, [int(r) for r in args.rows.split(",")] if args.rows else FP8_SWEEP_ROWS,
                  args.split_only)
        return 0
    rows = [int(r) for r in (args.rows or "1,16,256").split(",")]
    fp8 = torch.cuda.get_device_capability(dev) >= (8, 9)
    results, failures = [], []
    print(f"device: {torch.cuda.get_device_name(dev)}, capability {torch.cuda.get_device_capability(dev)}")

    def record(op: str, label: str, name: str, m: int, n: int, k: int, ms: float, mode: str, weight_bytes: int,
               bf16_ms: float, err: float | None = None, tol: float = 0.0, **extra) -> None:
        gbs = weight_bytes / ms / 1e6
        case = {"op": op, "label": label, "shape": name, "m": m, "n": n, "k": k, "ms": ms, "timing": mode,
                "weight_bytes": weight_bytes, "weight_gb_s": gbs, "bf16_ms": bf16_ms, "speedup": bf16_ms / ms,
                "rel_err": err, **extra}
        results.append(case)
        if err is not None and err > tol:
            failures.append(case)
        bandwidth = f"{gbs:7.0f} GB/s" if weight_bytes else " " * 12
        check = "" if err is None else f"  err {err:.1e}"
        print(f"  {label:<24} {ms * 1e3:9.1f} us  {bandwidth}  x{bf16_ms / ms:5.2f} vs bf16{check}"
              f"{'' if mode == 'graph' else '  (eager)'}")

    for name, n, k in LLAMA_8B:
        w_bf16 = torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            t_bf16, mode = time_cycled(lambda w, x=x: F.linear(x, w), w_bf16, nbytes(w_bf16))
            print(f"{name} N={n} K={k} M={m}: bf16 {t_bf16 * 1e3:.1f} us, {nbytes(w_bf16) / t_bf16 / 1e6:.0f} GB/s")
            results.append({"op": "bf16", "label": "bf16", "shape": name, "m": m, "n": n, "k": k, "ms": t_bf16,
                            "timing": mode, "weight_bytes": nbytes(w_bf16),
                            "weight_gb_s": nbytes(w_bf16) / t_bf16 / 1e6})
            for bits, group, zeros, act_order in wna16_cases(args.full):
                g = k if group == -1 else group
                q = torch.randint(0, 1 << bits, (k, n), device=dev, generator=gen, dtype=torch.int32)
                qw = pack_rows(q, bits)
                s = (torch.rand(k // g, n, device=dev, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
                z = torch.randint(0, 1 << bits, (k // g, n), device=dev, generator=gen, dtype=torch.int32) \
                    if zeros else None
                gi = (torch.arange(k, device=dev) // g)[torch.randperm(k, device=dev, generator=gen)].to(torch.int32) \
                    if act_order else None
                packed = wna16_repack(qw, s, z, gi, bits, g)  # the layout the op reads (the engine's)
                err = rel_err(wna16_gemm(x, packed, s, z, gi, bits, g),
                              wna16_gemm_ref(x.float(), qw, s.float(), z, gi, bits, g))
                size = nbytes(qw, s, z, gi)
                t, mode = time_cycled(lambda w, x=x, a=(s, z, gi, bits, g): wna16_gemm(x, w, *a), packed, size)
                label = f"w{bits}a16 g{group}{' zp' if zeros else ''}{' act-order' if act_order else ''}"
                record("wna16_gemm", label, name, m, n, k, t, mode, size, t_bf16, err, 2e-2, bits=bits,
                       group=group, zeros=zeros, act_order=act_order)
            if fp8:
                wf = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.float8_e4m3fn)
                wsc = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
                for static in (False, True):
                    xs = (x.float().abs().amax() / 448).reshape(1) if static else None
                    err = rel_err(fp8_scaled_mm(x, wf, wsc, xs), fp8_scaled_mm_ref(x, wf, wsc, xs))
                    t, mode = time_cycled(lambda w, x=x, a=(wsc, xs): fp8_scaled_mm(x, w, *a), wf, nbytes(wf, wsc))
                    record("fp8_scaled_mm", f"fp8 {'static' if static else 'dynamic'}", name, m, n, k, t, mode,
                           nbytes(wf, wsc), t_bf16, err, 3e-2, static=static)
                t, mode = time_per_call(lambda i, x=x: quantize_rows(x, torch.float8_e4m3fn, None), 1)
                record("quantize_rows", "  of which act. quant", name, m, n, k, t, mode, 0, t_bf16)
            wi = torch.randint(-128, 128, (n, k), device=dev, generator=gen, dtype=torch.int8)
            wsc = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
            err = rel_err(int8_scaled_mm(x, wi, wsc, None), int8_scaled_mm_ref(x, wi, wsc, None))
            t, mode = time_cycled(lambda w, x=x, a=(wsc, None): int8_scaled_mm(x, w, *a), wi, nbytes(wi, wsc))
            record("int8_scaled_mm", "int8 dynamic", name, m, n, k, t, mode, nbytes(wi, wsc), t_bf16, err, 2e-2)
            torch.cuda.empty_cache()

    print("\none decoder layer's linears (qkv + o + gate_up + down), per row count:")
    for m in rows:
        per_op: dict[str, float] = {}
        for r in results:
            if r["m"] == m and r["op"] != "quantize_rows":
                per_op[r["label"]] = per_op.get(r["label"], 0.0) + r["ms"]
        base = per_op.pop("bf16")
        print(f"  M={m}: bf16 {base * 1e3:.0f} us; " +
              "; ".join(f"{op} {t * 1e3:.0f} us (x{base / t:.2f})" for op, t in per_op.items()))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "results": results}, f, indent=1)
    print(f"{len(results) - len(failures)} results, {len(failures)} failed the reference check")
    for case in failures:
        print("  FAILED:", case)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
