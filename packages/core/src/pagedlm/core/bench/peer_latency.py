"""``pagedlm bench latency --compare hf llama.cpp``: the same batch through a peer, same run.

* ``hf``: HF transformers' ``model.generate`` (greedy, ``min_new_tokens = max_new_tokens``, so
  every row makes ``--output-len`` tokens) on the same weights and dtype: the model directory, or
  the GGUF file as transformers dequantizes it.
* ``llama.cpp``: llama-cpp-python on the same GGUF file (batch 1 only: its high-level API runs
  one sequence), with as many threads as pagedlm's CPU platform uses, greedy.

Both get the token ids pagedlm gets (no tokenizer in the way) and report what pagedlm's latency
benchmark reports: prefill time (to the first token), decode time per token, end-to-end time and
output tokens/s, medians over ``--num-iters`` iterations after ``--num-iters-warmup`` (the
one-token and whole runs alternate).
Decode per token is ``(time for N tokens - time for the first) / (N - 1)``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

PEERS = ("hf", "llama.cpp")


def _summary(prefill_s: list[float], e2e_s: list[float], batch: int, output_len: int) -> dict[str, Any]:
    e2e, first = statistics.median(e2e_s), statistics.median(prefill_s)
    decode = (e2e - first) / (output_len - 1) if output_len > 1 else float("nan")
    return {"prefill_ms": first * 1e3, "decode_ms_per_token": decode * 1e3, "e2e_ms": e2e * 1e3,
            "output_tokens_per_s": batch * output_len / e2e}


def _timed_pairs(run: Any, output_len: int, iters: int) -> tuple[list[float], list[float]]:
    """``iters`` timings of one token and of ``output_len`` tokens, taken in turn so that a slow
    spell of the machine lands on both kinds alike (not on all of one kind)."""
    first, e2e = [], []
    for _ in range(iters):
        first.append(run(1))
        e2e.append(run(output_len))
    return first, e2e


def hf_generate(prompts: list[list[int]], output_len: int, *, model: str, dummy: bool, dtype: Any, device: str,
                iters: int, warmup: int, seed: int) -> dict[str, Any]:
    """HF ``generate`` over ``prompts`` (equal lengths, so no padding), greedy."""
    import torch

    from pagedlm.core.bench.hf_compare import build_hf_model

    hf = build_hf_model(model, dummy=dummy, dtype=dtype, device=device, attn_implementation="sdpa", seed=seed)
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
        return time.perf_counter() - start

    for _ in range(warmup):
        run(output_len)
    first, e2e = _timed_pairs(run, output_len, iters)
    return {"peer": "hf", "api": "generate", "dtype": str(dtype).removeprefix("torch."),
            **_summary(first, e2e, len(prompts), output_len)}


def llama_cpp(prompts: list[list[int]], output_len: int, *, model: str, iters: int, warmup: int,
              threads: int) -> dict[str, Any]:
    """llama-cpp-python's ``Llama.generate`` on the GGUF file ``model``, one prompt."""
    if len(prompts) != 1:
        return {"peer": "llama.cpp", "error": "llama-cpp-python's Llama runs one sequence: use --batch-size 1"}
    if not (os.path.isfile(model) and model.endswith(".gguf")):
        return {"peer": "llama.cpp", "error": f"llama.cpp reads GGUF files; the model is {model!r}"}
    try:
        import llama_cpp
    except ImportError:
        return {"peer": "llama.cpp", "error": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    prompt = prompts[0]
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(prompt) + output_len + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(512, len(prompt)), verbose=False)

    def run(n: int) -> float:
        start = time.perf_counter()
        for made, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                              reset=True), 1):
            if made == n:
                break
        return time.perf_counter() - start

    for _ in range(warmup):
        run(output_len)
    first, e2e = _timed_pairs(run, output_len, iters)
    version = getattr(llama_cpp, "__version__", "?")
    if hasattr(llm, "close"):
        llm.close()
    return {"peer": "llama.cpp", "api": f"llama-cpp-python {version} Llama.generate", "threads": threads,
            **_summary(first, e2e, 1, output_len)}
