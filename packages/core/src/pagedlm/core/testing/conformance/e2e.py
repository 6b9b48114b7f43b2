"""End-to-end check: greedy tokens of the engine on the backend equal HF transformers'.

One tiny random checkpoint per architecture in ``ARCHITECTURES`` (Llama, Mistral, Qwen2, Qwen3,
Gemma 3, Qwen3-MoE, Mixtral: every attention and op variant the model families use), float32, prompts that share
prefixes (the prefix cache serves them) and one longer than Gemma 3's window.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from pagedlm.core.testing.conformance.report import CheckResult

TIE_TOL = 1e-4  # HF top-2 logit gap under which either token is right (float rounding)


def e2e_prompts(quick: bool) -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(4, 500) for _ in range(70)]
    prompts = [base[:40], base[:40] + [rng.randrange(4, 500) for _ in range(9)], base[:5],
               [rng.randrange(4, 500) for _ in range(3)]]
    if not quick:
        prompts += [base[:70], [rng.randrange(4, 500) for _ in range(101)]]
    return prompts


def check_e2e(device: str, attention_backend: str, *, quick: bool,
              llm_kwargs: dict[str, Any] | None = None) -> list[CheckResult]:
    """One result per architecture; ``llm_kwargs`` go to ``LLM(...)`` (e.g. a block count)."""
    from pagedlm.core.testing import ARCHITECTURES, make_tiny_checkpoint

    max_new = 8 if quick else 16
    prompts = e2e_prompts(quick)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedlm-conformance-") as root:
        for arch in ARCHITECTURES:
            name = f"{arch} float32 greedy vs HF ({len(prompts)} prompts x {max_new} tokens)"
            try:
                model_dir = make_tiny_checkpoint(Path(root) / arch, arch)
                mismatches, forgiven = _compare(model_dir, prompts, max_new, device, attention_backend,
                                                llm_kwargs or {})
            except Exception as e:  # noqa: BLE001 - a crash is this backend's failure
                results.append(CheckResult("e2e", name, "FAIL", detail=f"raised {type(e).__name__}: {e}"))
                continue
            detail = f"{mismatches} prompts differ, {forgiven} near-ties forgiven (tie_tol={TIE_TOL:g})"
            results.append(CheckResult("e2e", name, "FAIL" if mismatches else "PASS", float(mismatches),
                                       "0 may differ", detail, metric="mismatched_prompts"))
    return results


def _compare(model_dir: str, prompts: list[list[int]], max_new: int, device: str, attention_backend: str,
             llm_kwargs: dict[str, Any]) -> tuple[int, int]:
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.testing import compare_greedy, hf_greedy

    reference = hf_greedy(model_dir, prompts, max_new)
    kwargs = {"num_gpu_blocks_override": 64, **llm_kwargs}
    llm = LLM(model=model_dir, dtype="float32", device=device, attention_backend=attention_backend, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return compare_greedy([list(o.outputs[0].token_ids) for o in outs], reference, TIE_TOL)
