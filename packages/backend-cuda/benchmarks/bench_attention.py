"""Decode paged-attention kernel alone: bytes of K/V read over kernel time, against the copy
bandwidth measured on the same GPU, for a few launch configurations; plus one prefill shape.

    python packages/backend-cuda/benchmarks/bench_attention.py [--batch 256] [--context 1024] [--kv-cache-dtype fp8]

Prints a table and writes ``--output-json``. Shapes default to Qwen3-0.6B's attention (16 query
heads, 8 kv heads, head size 128), bf16, block size 16, block ids randomly permuted
(Llama-3.1-8B's: ``--heads 32``). ``--kv-cache-dtype fp8`` reads a float8_e4m3fn cache (the FP8
KV cache; bytes counted at one per value), so its bandwidth compares with bf16's directly; its
grid adds 8-row tiles (``BLOCK_M`` 8: an H100 ran 256 x 768 5 % faster at ``BLOCK_M`` 8,
``BLOCK_N`` 32, 2 warps, 2 stages than at the defaults, 2026-12-06), with 16 keys and one warp
too (the same H100 shape's best after the nineteenth session's loop, 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton.testing

from pagedlm.backends.cuda.kernels.paged_attention import choose_num_splits, paged_attention
from pagedlm.core.bench.workloads import NANO


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling), as
    the platform measures it for ``pagedlm bench latency``."""
    from pagedlm.backends.cuda.platform import CudaPlatform

    return float(CudaPlatform().copy_bandwidth_bytes_per_s(torch.device("cuda")) or 0.0)


#: set by main from --kv-cache-dtype: the cache's dtype, and paged_attention's scale arguments
KV_DTYPE: torch.dtype | None = None
KV_SCALES: dict[str, torch.Tensor] = {}


def make_batch(batch, context, heads, kv_heads, head, block_size, dtype, query_len=1, contexts=None):
    """``contexts`` (a list of ``batch`` lengths) makes a ragged batch; ``context`` is then the longest."""
    blocks_per = -(-context // block_size)
    num_blocks = batch * blocks_per + 8
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, dtype=dtype, device="cuda").to(KV_DTYPE or dtype)
    perm = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per].to(torch.int32)
    block_table = perm.view(batch, blocks_per).contiguous()
    if contexts is None:
        contexts = [context] * batch
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, (batch + 1) * query_len, query_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch * query_len, heads, head, dtype=dtype, device="cuda")
    return cache, block_table, seq_lens, qsl, query


def nano_contexts(batch: int, gen: torch.Generator) -> list[int]:
    """Context lengths of a nano decode step with ``batch`` requests left: nano's prompts and
    outputs are uniform in ``[min_len, max_len]``, so ``batch`` of its ``num_prompts`` are left at
    about step ``min_len + (max_output_len - min_len) (1 - batch / num_prompts)``."""
    lo, hi, n = NANO["min_len"], NANO["max_output_len"], NANO["num_prompts"]
    step = lo + int((hi - lo) * (1 - batch / n))
    return (torch.randint(lo, NANO["max_input_len"] + 1, (batch,), generator=gen) + step).tolist()


def ragged_decode(args, dtype, bw: float, num_sms: int) -> dict:
    """nano-like ragged decode batches: every split count, with and without the longest-first
    order, and the split count the metadata builder picks (graphs capture with ``max_model_len``)."""
    gen = torch.Generator().manual_seed(0)
    table = {}
    for batch in args.ragged_batches:
        contexts = nano_contexts(batch, gen)
        cache, bt, seq_lens, qsl, query = make_batch(batch, max(contexts), args.heads, args.kv_heads, args.head_size,
                                                     args.block_size, dtype, contexts=contexts)
        order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
        out = torch.empty_like(query)
        kv_bytes = 2 * sum(contexts) * args.kv_heads * args.head_size * cache.element_size()
        picked = choose_num_splits(batch, args.kv_heads, args.max_model_len, num_sms)
        row = {"picked_splits": picked}
        for ns, ordered in [(1, False), (1, True), (2, True), (4, True), (8, True), (16, True)]:
            kwargs = dict(block_table=bt, seq_lens=seq_lens, query_start_loc=qsl, num_reqs=batch, num_tokens=batch,
                          max_query_len=1, scale=args.head_size**-0.5, num_splits=ns,
                          req_order=order if ordered else None, **KV_SCALES)
            # replayed from a CUDA graph, as the engine runs decode steps: timing launches from Python
            # would measure the host's launch overhead for the small batches
            ms = triton.testing.do_bench_cudagraph(
                partial(paged_attention, out, query, cache[0], cache[1], **kwargs), rep=40, return_mode="median")
            row[f"s{ns}{'o' if ordered else ''}"] = round(ms * 1e3, 1)  # microseconds
        row["best"] = min((k for k in row if k.startswith("s")), key=lambda k: row[k])
        row["best_of_copy_bw"] = round(kv_bytes / (row[row["best"]] * 1e-6) / bw, 3)
        table[batch] = row
        print(f"  batch {batch:3d}: {row}")
    return table


def main() -> None:
    global KV_DTYPE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096, help="what graphs capture the split count with")
    p.add_argument("--ragged-batches", type=int, nargs="*",
                   default=[256, 224, 192, 160, 128, 96, 64, 48, 32, 24, 16, 8, 4, 1])
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    dtype = torch.bfloat16
    if args.kv_cache_dtype == "fp8":
        KV_DTYPE = torch.float8_e4m3fn
        KV_SCALES.update(k_scale=torch.tensor([0.05], device="cuda"), v_scale=torch.tensor([0.02], device="cuda"))
    bw = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cache, bt, seq_lens, qsl, query = make_batch(args.batch, args.context, args.heads, args.kv_heads,
                                                 args.head_size, args.block_size, dtype)
    out = torch.empty_like(query)
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_size * cache.element_size()
    rows = []
    # an FP8 cache's decode loop (transposed, rows on the MMA's N side) also takes 8-row tiles
    block_ms = (16, 8) if KV_DTYPE is not None else (16,)
    # (8-row tiles also at one warp and 16 keys: the H100's best at 256 x 768, 2026-12-07)
    configs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
               for m in block_ms for n in ((16, 32, 64, 128) if m == 8 else (32, 64, 128))
               for w in ((1, 2, 4, 8) if m == 8 else (2, 4, 8)) for s in (2, 3)]
    for cfg in configs:
        def run(cfg=cfg):
            paged_attention(out, query, cache[0], cache[1], block_table=bt, seq_lens=seq_lens, query_start_loc=qsl,
                            num_reqs=args.batch, num_tokens=args.batch, max_query_len=1,
                            scale=args.head_size**-0.5, config=cfg, **KV_SCALES)
        try:
            ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is a result
            rows.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        rows.append({**cfg, "ms": ms, "TB/s": kv_bytes / (ms * 1e-3) / 1e12, "of_copy_bw": kv_bytes / (ms * 1e-3) / bw})
    # small batches use split-KV; report one such shape with the default config
    small = {}
    for batch in (1, 8, 32):
        c2, bt2, sl2, q2s, qu2 = make_batch(batch, 8192, args.heads, args.kv_heads, args.head_size,
                                             args.block_size, dtype)
        o2 = torch.empty_like(qu2)
        for ns in sorted({1, choose_num_splits(batch, args.kv_heads, 8192, num_sms)}):
            def run_split(ns=ns, o2=o2, qu2=qu2, c2=c2, bt2=bt2, sl2=sl2, q2s=q2s, batch=batch):
                paged_attention(o2, qu2, c2[0], c2[1], block_table=bt2, seq_lens=sl2, query_start_loc=q2s,
                                num_reqs=batch, num_tokens=batch, max_query_len=1, scale=args.head_size**-0.5,
                                num_splits=ns, **KV_SCALES)
            ms = triton.testing.do_bench(run_split, warmup=25, rep=200, return_mode="median")
            b = 2 * batch * 8192 * args.kv_heads * args.head_size * c2.element_size()
            small[f"batch{batch}_ctx8192_splits{ns}"] = {"ms": ms, "TB/s": b / (ms * 1e-3) / 1e12}
    # one prefill shape: 16 prompts x 512 new tokens, no cache
    c3, bt3, sl3, q3s, qu3 = make_batch(16, 512, args.heads, args.kv_heads, args.head_size, args.block_size, dtype,
                                        query_len=512)
    o3 = torch.empty_like(qu3)
    ms = triton.testing.do_bench(
        lambda: paged_attention(o3, qu3, c3[0], c3[1], block_table=bt3, seq_lens=sl3, query_start_loc=q3s, num_reqs=16,
                                num_tokens=16 * 512, max_query_len=512, scale=args.head_size**-0.5, **KV_SCALES),
        warmup=25, rep=200, return_mode="median")
    flops = 16 * args.heads * (512 * 512 / 2) * args.head_size * 4  # causal: half the QK^T and PV work
    prefill = {"ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12}
    print("ragged nano-like decode batches (microseconds; sN = N splits, o = longest first):")
    ragged = ragged_decode(args, dtype, bw, num_sms)
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    print(f"decode batch={args.batch} context={args.context} K/V bytes={kv_bytes / 2**30:.2f} GiB")
    for r in rows:
        print("  ", r)
    print("best:", best)
    print("split-KV:", json.dumps(small))
    print("prefill 16x512:", prefill)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"copy_bw": bw, "decode": rows, "best": best, "split": small, "prefill": prefill,
                       "ragged": ragged, "args": vars(args), "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
