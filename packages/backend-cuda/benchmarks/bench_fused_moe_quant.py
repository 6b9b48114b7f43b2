"""The quantized ``fused_experts`` ops (FP8, W4A16 group 128) on a GPU against the bf16 op: their
time per token count, their distance to core's torch references, and at decode (64 tokens) the
quantized expert bytes read per second as a fraction of the measured copy bandwidth.

    python packages/backend-cuda/benchmarks/bench_fused_moe_quant.py [--shape qwen3-30b-a3b] [--output-json q.json]

Experts and routing as in ``bench_fused_moe.py`` (random weights, softmax top-k of random logits);
FP8 weights per output channel (``amax / 448``), int4 weights symmetric in groups of 128.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
from bench_fused_moe import SHAPES, copy_bandwidth, make_experts, make_tokens, time_op

from pagedlm.backends.cuda.kernels.fused_moe import fused_experts
from pagedlm.backends.cuda.kernels.fused_moe_quant import fused_experts_fp8, fused_experts_wna16
from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_fp8 as fp8_reference
from pagedlm.core.layers.fused_moe.quantized_reference import fused_experts_wna16 as wna16_reference
from pagedlm.core.layers.quantization.utils import pack_cols

TOKENS = [1, 16, 64, 256, 1024, 4096]
GROUP = 128


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
    return (w.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def int4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    grouped = w.float().reshape(e, n, k // GROUP, GROUP)
    scale = (grouped.abs().amax(-1) / 7.5).clamp(min=1e-10)
    q = torch.round(grouped / scale.unsqueeze(-1) + 8).clamp(0, 15).to(torch.int32).reshape(e * n, k)
    return pack_cols(q, 4).reshape(e, n, -1), scale.to(w.dtype)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float().cpu() - want.float()).norm() / want.float().norm().clamp(min=1e-12))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    experts, top_k, hidden, inter = SHAPES[args.shape]
    w13, w2 = make_experts(args.shape, torch.bfloat16)
    q13, s13 = fp8_experts(w13)
    q2, s2 = fp8_experts(w2)
    p13, g13 = int4_experts(w13)
    p2, g2 = int4_experts(w2)
    ops = {
        "bf16": lambda x, w, i: fused_experts(x, w13, w2, w, i),
        "fp8": lambda x, w, i: fused_experts_fp8(x, q13, q2, s13, s2, w, i),
        "w4a16": lambda x, w, i: fused_experts_wna16(x, p13, p2, g13, g2, None, None, w, i, None, 4, GROUP),
    }
    bytes_per_expert = {"bf16": 3 * hidden * inter * 2, "fp8": 3 * hidden * inter,
                        "w4a16": 3 * hidden * inter // 2 + 3 * hidden * inter // GROUP * 2}
    bw = copy_bandwidth()
    print(f"GPU: {torch.cuda.get_device_name()}, {args.shape}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for tokens in args.tokens:
        x, weights, ids = make_tokens(args.shape, tokens, torch.bfloat16, seed=tokens)
        hit = int(torch.unique(ids).numel())
        row = {"tokens": tokens, "experts_hit": hit}
        for name, op in ops.items():
            ms = time_op(partial(op, x, weights, ids))
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_hit_of_copy_bw"] = hit * bytes_per_expert[name] / (ms * 1e-3) / bw
        if tokens <= 256:  # the references dequantize on the CPU
            cpu = [t.cpu() for t in (x, weights, ids)]
            row["fp8_rel_err"] = rel_err(ops["fp8"](x, weights, ids),
                                         fp8_reference(cpu[0], q13.cpu(), q2.cpu(), s13.cpu(), s2.cpu(), *cpu[1:]))
            row["w4a16_rel_err"] = rel_err(ops["w4a16"](x, weights, ids),
                                           wna16_reference(cpu[0], p13.cpu(), p2.cpu(), g13.cpu(), g2.cpu(), None, None,
                                                           *cpu[1:], None, 4, GROUP))
        rows.append(row)
        print(f"  T={tokens:5d}  bf16 {row['bf16_us']:8.1f} us  fp8 {row['fp8_us']:8.1f} us "
              f"({row['fp8_hit_of_copy_bw']:.0%} bw)  w4a16 {row['w4a16_us']:8.1f} us "
              f"({row['w4a16_hit_of_copy_bw']:.0%} bw)"
              + (f"  rel err fp8 {row['fp8_rel_err']:.1e} w4a16 {row['w4a16_rel_err']:.1e}" if "fp8_rel_err" in row
                 else ""), flush=True)
    ok = all(r.get("fp8_rel_err", 0) < 2e-2 and r.get("w4a16_rel_err", 0) < 1e-2 for r in rows)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"shape": args.shape, "copy_bw": bw, "rows": rows, "all_ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
