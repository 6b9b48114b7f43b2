"""Time the CPU GGUF matmul at Gemma 3 270M's shapes (after the Q5_0 -> Q8_0 repack).

    python packages/backend-cpu/benchmarks/bench_gguf_kernels.py --rows 1 32 1024 [--build avx2]

Random blocks with finite scales (the kernels' speed does not depend on the values); per shape the
best of ``--repeats`` calls, in ms and GFLOP/s (2 * M * N * K).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pagedlm.backends.cpu.kernels import gguf_ops

# (name, ggml type, N, K, calls per decode step); Gemma 3 270M Q4_K_M: 18 layers, ffn_down half Q6_K
SHAPES = [
    ("qkv Q8_0", 8, 1536, 640, 18),
    ("o Q4_K", 12, 640, 1024, 18),
    ("gate_up Q8_0", 8, 4096, 640, 18),
    ("down Q6_K", 14, 640, 2048, 9),
    ("down Q4_K", 12, 640, 2048, 9),
    ("lm_head Q8_0", 8, 262144, 640, 1),
]
_BLOCK = {8: (32, 34, [0]), 12: (256, 144, [0, 2]), 14: (256, 210, [208])}


def random_weight(qtype: int, n: int, k: int) -> torch.Tensor:
    values, size, halves = _BLOCK[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
    for start in halves:
        scales = rng.uniform(-0.05, 0.05, size=len(raw)).astype(np.float16)
        raw[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default="", help="substring of the shape names to run")
    p.add_argument("--int8-activations", action="store_true")
    p.add_argument("--build", choices=list(gguf_ops.BUILDS), help="a build other than this CPU's best")
    args = p.parse_args()
    if args.build:
        library = gguf_ops._library(args.build)
        gguf_ops.kernel_library = lambda: library
    print(f"threads {torch.get_num_threads()}, build {args.build or gguf_ops.available_builds()[0]}")
    for m in args.rows:
        total = 0.0
        for name, qtype, n, k, calls in SHAPES:
            if args.only not in name:
                continue
            w = random_weight(qtype, n, k)
            x = torch.randn(m, k)
            gguf_ops.gguf_mul_mat(x, w, qtype, n, args.int8_activations)
            best = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                gguf_ops.gguf_mul_mat(x, w, qtype, n, args.int8_activations)
                best = min(best, time.perf_counter() - t)
            total += best * calls
            rate = 2 * m * n * k / best / 1e9
            print(f"M={m:5d} {name:14s} N={n:6d} K={k:5d}  {best * 1e3:8.3f} ms  {rate:7.1f} GFLOP/s")
        print(f"M={m:5d} sum over one forward's calls: {total * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
