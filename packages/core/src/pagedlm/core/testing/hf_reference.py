"""HF transformers as the reference: greedy tokens, top-2 gaps and logprobs, and a conformance check.

Correctness of a model, backend or engine change is judged against transformers running the same
checkpoint in float32 on the CPU. Greedy decoding should match token for token; the only excuse is
a near-tie, where HF's two best logits are so close that float rounding may legitimately pick either.
After a forgiven tie the sequences continue from different tokens, so the rest is not compared.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HFGreedyResult:
    """What HF transformers generated greedily for one prompt.

    ``logprobs[s]`` is the full log-softmax row (float32, ``[vocab]``) from which step ``s`` was
    chosen and ``top2_gaps[s]`` the gap between its two largest logits. ``prompt_logprobs[i]`` is the
    log-softmax row at prompt position ``i``, i.e. the distribution of prompt token ``i + 1``
    (``[len(prompt) - 1, vocab]``; vLLM reports position 0 as None).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    top2_gaps: list[float]
    logprobs: Any  # torch.Tensor [num_steps, vocab]
    prompt_logprobs: Any  # torch.Tensor [len(prompt) - 1, vocab]
    extra: dict[str, Any] = field(default_factory=dict)

    def token_logprobs(self) -> list[float]:
        """Logprob of each generated token."""
        return [float(self.logprobs[s, t]) for s, t in enumerate(self.token_ids)]

    def top_logprobs(self, step: int, k: int) -> dict[int, float]:
        """The ``k`` most likely tokens at ``step`` and their logprobs, best first."""
        values, ids = self.logprobs[step].topk(k)
        return {int(i): float(v) for i, v in zip(ids, values)}


def _load_hf_model(model_dir: str | os.PathLike[str]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    # Typed as Any: transformers' decorator-wrapped from_pretrained confuses type checkers.
    auto: Any = AutoModelForCausalLM
    # Eager attention is the plainest formulation, which is what a reference should be.
    model = auto.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    return model.to("cpu").eval()


def engine_greedy(model_dir: str | os.PathLike[str], prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int,
                  **llm_kwargs: Any) -> list[list[int]]:
    """pagedlm's greedy tokens for each prompt (``ignore_eos``, as :func:`hf_greedy`), from an
    ``LLM(model=model_dir, **llm_kwargs)`` built and shut down here: one engine's tokens to
    compare with another's (a device, a quantized cache)."""
    from pagedlm.core import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **llm_kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                            SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def hf_greedy(
    model_dir: str | os.PathLike[str],
    prompt_token_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    prepare: Callable[[Any], Any] | None = None,
) -> list[HFGreedyResult]:
    """Greedy-decode each prompt with HF transformers (float32, CPU), one prompt at a time.

    One prompt at a time with no padding, so nothing but the model itself decides the logits. EOS
    does not stop generation (compare with ``ignore_eos=True``). ``use_cache=False`` recomputes
    the whole sequence every step, for a reference that does not rely on HF's KV cache.
    ``prepare(model)`` runs on the loaded model first (e.g. hooks that quantize activations the
    way a checkpoint format's GPU kernels do, where HF's CPU path leaves them alone).
    """
    import torch

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    model = _load_hf_model(model_dir)
    if prepare is not None:
        prepare(model)
    vocab = model.config.vocab_size
    # transformers 5.x renamed past_key_values to cache (the old name warns); 4.x knows only the old one.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    results = []
    with torch.inference_mode():
        for prompt in prompt_token_ids:
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError("empty prompt: HF needs at least one token to condition on")
            if max(prompt) >= vocab or min(prompt) < 0:
                raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {prompt}")
            out = model(input_ids=torch.tensor([prompt]), use_cache=use_cache)
            logits = out.logits[0].float()
            prompt_logprobs = torch.log_softmax(logits[:-1], dim=-1)
            past = out[cache_arg] if use_cache else None
            last = logits[-1]
            tokens: list[int] = []
            gaps: list[float] = []
            rows = []
            for step in range(max_new_tokens):
                top = last.topk(2).values
                gaps.append(float(top[0] - top[1]))
                rows.append(torch.log_softmax(last, dim=-1))
                token = int(last.argmax())
                tokens.append(token)
                if step + 1 == max_new_tokens:
                    break
                if use_cache:
                    out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_arg: past})
                    past = out[cache_arg]
                else:
                    out = model(input_ids=torch.tensor([prompt + tokens]), use_cache=False)
                last = out.logits[0, -1].float()
            results.append(
                HFGreedyResult(
                    prompt_token_ids=prompt,
                    token_ids=tokens,
                    top2_gaps=gaps,
                    logprobs=torch.stack(rows),
                    prompt_logprobs=prompt_logprobs,
                )
            )
    return results


@dataclass
class _Divergence:
    index: int  # which prompt
    step: int  # first step where the two differ (or where the shorter one ends)
    forgiven: bool
    ours: list[int]
    ref: HFGreedyResult

    def describe(self) -> str:
        s, ref = self.step, self.ref
        lo = max(0, s - 4)
        head = (
            f"prompt {self.index} (len {len(ref.prompt_token_ids)}): first difference at step {s} "
            f"of {len(ref.token_ids)}"
        )
        if s >= len(self.ours) or s >= len(ref.token_ids):
            detail = f"lengths differ: ours {len(self.ours)} tokens, HF {len(ref.token_ids)}"
        else:
            ours_tok, hf_tok = self.ours[s], ref.token_ids[s]
            ours_lp = float(ref.logprobs[s, ours_tok]) if 0 <= ours_tok < ref.logprobs.shape[-1] else float("nan")
            detail = (
                f"ours {ours_tok}, HF {hf_tok} (HF top-2 gap {ref.top2_gaps[s]:.3g}, "
                f"HF logprob of HF's token {float(ref.logprobs[s, hf_tok]):.4f}, of ours {ours_lp:.4f})"
            )
        return (
            f"  {head}: {detail}\n"
            f"    ours[{lo}:{s + 3}] = {self.ours[lo : s + 3]}\n"
            f"    HF  [{lo}:{s + 3}] = {ref.token_ids[lo : s + 3]}"
        )


def _divergences(ours: Sequence[Sequence[int]], ref: Sequence[HFGreedyResult], tie_tol: float) -> list[_Divergence]:
    if len(ours) != len(ref):
        raise ValueError(f"got {len(ours)} outputs for {len(ref)} reference results")
    found = []
    for i, (seq, r) in enumerate(zip(ours, ref)):
        seq = [int(t) for t in seq]
        n = min(len(seq), len(r.token_ids))
        step = next((s for s in range(n) if seq[s] != r.token_ids[s]), None)
        if step is not None:
            found.append(_Divergence(i, step, r.top2_gaps[step] < tie_tol, seq, r))
        elif len(seq) != len(r.token_ids):
            found.append(_Divergence(i, n, False, seq, r))  # a length difference is never a tie
    return found


def compare_greedy(
    ours: Sequence[Sequence[int]], ref: Sequence[HFGreedyResult], tie_tol: float = 1e-4
) -> tuple[int, int]:
    """Compare greedy outputs with HF's: returns ``(mismatches, forgiven_near_ties)``.

    Per prompt only the first difference counts. It is forgiven when HF's top-2 logit gap at that
    step is below ``tie_tol``; the sequences are not compared after it either way. Different
    lengths with an identical common part count as a mismatch.
    """
    divs = _divergences(ours, ref, tie_tol)
    forgiven = sum(d.forgiven for d in divs)
    return len(divs) - forgiven, forgiven


def _compare_logprobs(outputs: Sequence[Any], ref: Sequence[HFGreedyResult], atol: float) -> list[str]:
    """Check each returned top-k logprob against HF's, up to each sequence's first difference."""
    problems = []
    for i, (out, r) in enumerate(zip(outputs, ref)):
        if out.logprobs is None:
            problems.append(f"  prompt {i}: no logprobs returned although they were requested")
            continue
        for s, (ours_tok, hf_tok) in enumerate(zip(out.token_ids, r.token_ids)):
            if ours_tok != hf_tok or s >= len(out.logprobs):
                break
            for tok, lp in out.logprobs[s].items():
                value = lp.logprob if hasattr(lp, "logprob") else float(lp)
                expected = float(r.logprobs[s, tok])
                if abs(value - expected) > atol:
                    problems.append(
                        f"  prompt {i} step {s} token {tok}: logprob ours {value:.6f}, HF {expected:.6f} "
                        f"(|diff| {abs(value - expected):.2e} > {atol:g})"
                    )
    return problems


def assert_greedy_matches_hf(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int] | str],
    max_new_tokens: int,
    *,
    tie_tol: float = 1e-4,
    logprobs: int | None = None,
    logprob_atol: float = 1e-3,
    llm: Any = None,
    reference: Sequence[HFGreedyResult] | None = None,
    **llm_kwargs: Any,
) -> int:
    """Conformance check: pagedlm's greedy output on ``model_dir`` equals HF transformers'.

    Builds ``pagedlm.core.LLM(model=model_dir, dtype="float32", device="cpu", **llm_kwargs)``
    (``llm_kwargs`` may override dtype and device, e.g. ``device="cuda"`` for a GPU backend; a
    tolerant ``tie_tol`` then suits) unless ``llm`` is given, generates greedily with
    ``ignore_eos=True`` and compares with :func:`hf_greedy` (or ``reference``, to reuse one).
    String prompts are tokenized with the checkpoint's tokenizer. With ``logprobs=k`` the top-k
    logprobs must also agree with HF's within ``logprob_atol``.

    Raises AssertionError listing every prompt whose output differs beyond a near-tie.
    Returns the number of forgiven near-ties, so a test can report it.
    """
    from pagedlm.core.sampling_params import SamplingParams

    token_prompts = _tokenize_prompts(model_dir, prompts)
    if reference is None:
        reference = hf_greedy(model_dir, token_prompts, max_new_tokens)
    owned = llm is None
    if owned:
        from pagedlm.core import LLM

        llm = LLM(model=str(model_dir), **{"dtype": "float32", "device": "cpu", **llm_kwargs})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=logprobs)
        results = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    finally:
        if owned and hasattr(llm, "shutdown"):
            llm.shutdown()  # release worker processes and memory now, not at garbage collection
    if len(results) != len(token_prompts):
        raise AssertionError(f"LLM.generate returned {len(results)} outputs for {len(token_prompts)} prompts")
    outputs = [r.outputs[0] for r in results]
    ours = [list(o.token_ids) for o in outputs]
    divs = _divergences(ours, reference, tie_tol)
    bad = [d for d in divs if not d.forgiven]
    forgiven = len(divs) - len(bad)
    problems = [d.describe() for d in bad]
    if logprobs is not None:
        problems += _compare_logprobs(outputs, reference, logprob_atol)
    if problems:
        raise AssertionError(
            f"pagedlm differs from HF transformers on {model_dir} "
            f"({len(bad)} of {len(token_prompts)} prompts mismatch, {forgiven} near-ties forgiven "
            f"with tie_tol={tie_tol:g}):\n" + "\n".join(problems)
        )
    return forgiven


def _tokenize_prompts(model_dir: str | os.PathLike[str], prompts: Sequence[Sequence[int] | str]) -> list[list[int]]:
    if not any(isinstance(p, str) for p in prompts):
        return [[int(t) for t in p] for p in prompts]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p).input_ids if isinstance(p, str) else [int(t) for t in p] for p in prompts]
