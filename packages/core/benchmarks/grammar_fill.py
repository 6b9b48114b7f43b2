"""xgrammar's host cost per step at a batch's size, on this machine's CPU: filling the bitmask
rows and accepting the sampled tokens, one call per row against the batched calls on 1-16 threads.

    python packages/core/benchmarks/grammar_fill.py [--rows 256] [--steps 24]

The grammar is ``pagedlm bench throughput --structured-output-schema int-array``'s (a JSON array of
129 integers in [0, 999]) over a 151,936-token byte-level BPE vocabulary (Qwen's size), the matchers
advanced by random allowed tokens; medians over ``--steps`` steps. The engine's fill picks its
thread count from what a row costs (``structured_output/xgrammar_backend.py``); this shows where
the threads stop paying on a given host.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np


def _batched(threads: int) -> str:
    return f"batched, {threads} thread{'s' if threads > 1 else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedlm.core.testing.tokenizer import build_bpe_tokenizer

    vocab = 151936
    with tempfile.TemporaryDirectory() as out:
        build_bpe_tokenizer(out, vocab_size=vocab, style="qwen2")
        tokenizer = AutoTokenizer.from_pretrained(out)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": 129, "maxItems": 129}
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    matchers = [xgr.GrammarMatcher(grammar, terminate_without_stop_token=True) for _ in range(args.rows)]
    bitmask = xgr.allocate_token_bitmask(args.rows, vocab).numpy()
    batched = {k: xgr.BatchGrammarMatcher(max_threads=k) for k in (1, 2, 4, 8, 16)}
    rng = np.random.default_rng(0)
    fill: dict[str, list[float]] = {"per row": [], **{_batched(k): [] for k in batched}}
    accept: dict[str, list[float]] = {"per row": [], _batched(1): []}

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for step in range(args.steps):
        fill["per row"].append(timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)]))
        for k, b in batched.items():
            fill[_batched(k)].append(timed(lambda b=b: b.batch_fill_next_token_bitmask(matchers, bitmask)))
        tokens = [int(rng.choice(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])))
                  for row in bitmask]
        if step % 2:
            accept["per row"].append(timed(lambda tokens=tokens: [m.accept_token(t) for m, t in zip(matchers, tokens)]))
        else:
            accept[_batched(1)].append(timed(lambda tokens=tokens: batched[1].batch_accept_token(matchers, tokens)))
    for title, table in ((f"fill {args.rows} rows", fill), (f"accept {args.rows} tokens", accept)):
        print(title + ", median ms:")
        for label, seconds in table.items():
            print(f"  {label:<22} {1e3 * float(np.median(seconds)):7.3f}")


if __name__ == "__main__":
    main()
