"""Quantized GEMMs on a GPU: each kernel against dequantize-then-matmul, and its speed against bf16.

    python packages/backend-cuda/benchmarks/bench_quant.py [--output-json quant.json] [--quick]

For every shape (decode rows 1..16, prefill rows 128..4096, Llama-3.1-8B's projections) and
format (W4A16 / W8A16 with group sizes 32, 64, 128 and per channel, symmetric and with zero
points, act-order g_idx; FP8 dynamic and static; INT8 dynamic), it checks the op against core's
torch reference (the op contract: dequantize, then matmul in float32) and times it with CUDA
events against ``x @ W`` in bf16 (median of 50 runs after 10 warm-up runs). Exits non-zero when a
result is off by more than the tolerance. Prints one line per case and writes everything to JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pagedlm.backends.cuda.kernels.quant_gemm import fp8_scaled_mm, int8_scaled_mm, wna16_gemm
from pagedlm.core.layers.quantization.utils import (
    fp8_scaled_mm_ref,
    int8_scaled_mm_ref,
    pack_rows,
    wna16_gemm_ref,
)

#: (N, K) of Llama-3.1-8B's linear layers: qkv, o, gate_up, down
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
ROWS = [1, 4, 16, 128, 1024, 4096]


def timed(fn, warmup: int = 10, iters: int = 50) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def wna16_cases(quick: bool):
    groups = [128] if quick else [32, 64, 128, -1]
    for bits in (4, 8):
        for group in groups:
            for zeros, act_order in ((False, False), (True, False), (False, True)):
                if act_order and group == -1:
                    continue
                yield bits, group, zeros, act_order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quick", action="store_true", help="group 128 only, fewer row counts")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [1, 16, 1024] if args.quick else ROWS
    results, failures = [], []
    print(f"device: {torch.cuda.get_device_name(dev)}, capability {torch.cuda.get_device_capability(dev)}")
    for n, k in LLAMA_8B:
        w_bf16 = torch.randn(k, n, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
            t_bf16 = timed(lambda x=x, w=w_bf16: x @ w)
            for bits, group, zeros, act_order in wna16_cases(args.quick):
                g = k if group == -1 else group
                q = torch.randint(0, 1 << bits, (k, n), device=dev, generator=gen, dtype=torch.int32)
                qw = pack_rows(q, bits)
                s = (torch.rand(k // g, n, device=dev, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
                z = torch.randint(0, 1 << bits, (k // g, n), device=dev, generator=gen, dtype=torch.int32) \
                    if zeros else None
                gi = (torch.arange(k, device=dev) // g)[torch.randperm(k, device=dev, generator=gen)].to(torch.int32) \
                    if act_order else None
                out = wna16_gemm(x, qw, s, z, gi, bits, g)
                err = rel_err(out, wna16_gemm_ref(x.float(), qw, s.float(), z, gi, bits, g))
                t = timed(lambda a=(x, qw, s, z, gi, bits, g): wna16_gemm(*a))
                case = {"op": "wna16_gemm", "bits": bits, "group": group, "zeros": zeros, "act_order": act_order,
                        "m": m, "n": n, "k": k, "rel_err": err, "ms": t, "bf16_ms": t_bf16, "speedup": t_bf16 / t}
                results.append(case)
                if err > 2e-2:
                    failures.append(case)
                print(f"wna16 int{bits} g{group:<4} zp={int(zeros)} act={int(act_order)} m={m:<5} n={n:<6} k={k:<6} "
                      f"err {err:.1e}  {t:.3f} ms  (bf16 {t_bf16:.3f} ms, x{t_bf16 / t:.2f})")
            if torch.cuda.get_device_capability(dev) >= (8, 9):
                wf = (torch.randn(n, k, device=dev, generator=gen) * 0.05).to(torch.float8_e4m3fn)
                ws = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
                for static in (False, True):
                    xs = (x.float().abs().amax() / 448).reshape(1) if static else None
                    err = rel_err(fp8_scaled_mm(x, wf, ws, xs), fp8_scaled_mm_ref(x, wf, ws, xs))
                    t = timed(lambda a=(x, wf, ws, xs): fp8_scaled_mm(*a))
                    case = {"op": "fp8_scaled_mm", "static": static, "m": m, "n": n, "k": k, "rel_err": err,
                            "ms": t, "bf16_ms": t_bf16, "speedup": t_bf16 / t}
                    results.append(case)
                    if err > 3e-2:
                        failures.append(case)
                    print(f"fp8 {'static ' if static else 'dynamic'} m={m:<5} n={n:<6} k={k:<6} err {err:.1e}  "
                          f"{t:.3f} ms  (bf16 {t_bf16:.3f} ms, x{t_bf16 / t:.2f})")
            wi = torch.randint(-128, 128, (n, k), device=dev, generator=gen, dtype=torch.int8)
            ws = torch.rand(n, device=dev, generator=gen) * 0.01 + 1e-3
            err = rel_err(int8_scaled_mm(x, wi, ws, None), int8_scaled_mm_ref(x, wi, ws, None))
            t = timed(lambda a=(x, wi, ws, None): int8_scaled_mm(*a))
            case = {"op": "int8_scaled_mm", "m": m, "n": n, "k": k, "rel_err": err, "ms": t, "bf16_ms": t_bf16,
                    "speedup": t_bf16 / t}
            results.append(case)
            if err > 2e-2:
                failures.append(case)
            print(f"int8 dynamic m={m:<5} n={n:<6} k={k:<6} err {err:.1e}  {t:.3f} ms  (bf16 {t_bf16:.3f} ms, "
                  f"x{t_bf16 / t:.2f})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "results": results}, f, indent=1)
    print(f"{len(results) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
