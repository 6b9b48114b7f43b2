"""Verification of draft tokens against the target model, keeping the target distribution exactly.

Request ``i`` of a step has ``d_i >= 0`` drafts and ``d_i + 1`` rows of target logits: row ``j``
scores the token after draft ``j`` (row 0: after the last verified token). Each row is processed
as the plain sampler would (logit bias, min-tokens, penalties with the drafts before it counted
as output, temperature, min-p, top-k, top-p), giving the target distribution ``p_j`` of that
position. Then, draft by draft:

* greedy rows: the draft is accepted while it equals ``argmax p_j``; the first row that differs
  (or the row after the last draft) gives ``argmax p_j``: the longest matching prefix plus the
  target's next token, token-identical to decoding without speculation;
* random rows: every draft is deterministic (an n-gram copy, a greedy draft model: probability 1
  on the draft token), so draft ``x`` is accepted with probability ``p_j(x)``; the first rejected
  row draws from the residual ``p_j`` without ``x`` (renormalised), and a request whose drafts were
  all accepted draws its bonus token from ``p_{d}``. Each output token is then distributed exactly
  as ``p_j``: ``P(x) = p_j(x)`` and ``P(y) = (1 - p_j(x)) p_j(y) / (1 - p_j(x)) = p_j(y)``.

Seeded requests draw from their own generator in a fixed order (``d_i`` uniforms, then one
vocabulary-sized exponential draw for the last token), so they reproduce run to run whatever
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.core.sample import build_sampling_metadata, compute_topk_logprobs, process_logits
from pagedlm.core.sample.logprobs import LogprobsLists
from pagedlm.core.sample.sampler import apply_min_p, apply_top_k_top_p, gumbel_max
from pagedlm.core.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5



@dataclass
class VerifyRequest:
    """One sampling request of the step, as the verifier needs it."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    draft_token_ids: Sequence[int]
    generator: torch.Generator | None


def verify(logits: torch.Tensor,
           requests: Sequence[VerifyRequest]) -> tuple[list[list[int]], list[LogprobsLists | None]]:
    """Accepted drafts plus one token per request.

    Args:
        logits: ``[R, V]`` target logits, ``R = sum(d_i + 1)``, request by request.
        requests: the ``B`` requests in row order.

    Returns:
        per request its output tokens (``a_i`` accepted drafts and the target's token: ``a_i + 1``
        tokens), and per request its logprobs (raw distribution, sampled token first and its top
        ``logprobs``), or None where not asked for.
    """
    device = logits.device
    row_counts = [len(r.draft_token_ids) + 1 for r in requests]
    if all(_plain_greedy(r.sampling_params) for r in requests):
        # the common case, cheaply: no sampling metadata, no logits processing (it would change
        # nothing), one argmax copied to the host
        argmax = logits.argmax(dim=-1).tolist()
        starts = [0]
        for rows in row_counts:
            starts.append(starts[-1] + rows)
        tokens = [_longest_match(argmax, start, r.draft_token_ids) for start, r in zip(starts, requests)]
        return tokens, _logprobs(logits, requests, tokens, starts)
    params, prompts, outputs = [], [], []
    for req, rows in zip(requests, row_counts, strict=True):
        for j in range(rows):
            params.append(req.sampling_params)
            prompts.append(req.prompt_token_ids)
            # NOTE: row j's context holds drafts 1..j as output (penalties, min_tokens see them)
            outputs.append(req.output_token_ids + list(req.draft_token_ids[:j]) if j else req.output_token_ids)
    md = build_sampling_metadata(params, prompt_token_ids=prompts, output_token_ids=outputs,
                                 vocab_size=logits.shape[-1], device=device)
    processed = process_logits(logits, md)
    argmax = processed.argmax(dim=-1).tolist()
    starts = [0]
    for rows in row_counts:
        starts.append(starts[-1] + rows)
    drafts_flat = [t for r in requests for t in r.draft_token_ids]
    greedy = [float(r.sampling_params.temperature) < _SAMPLING_EPS for r in requests]

    probs = None
    if not all(greedy):
        x = processed / md.random_temperature.unsqueeze(1)
        if md.min_p is not None:
            x = apply_min_p(x, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            x = apply_top_k_top_p(x, md.top_k, md.top_p, max_top_k=md.max_top_k)
        probs = x.softmax(dim=-1)  # [R, V]

    # Acceptance: uniforms per draft row (seeded requests from their generator, in order).
    draft_probs: list[float] = []
    uniforms: list[float] = []
    if probs is not None and drafts_flat:
        draft_rows = [starts[i] + j for i, r in enumerate(requests) for j in range(len(r.draft_token_ids))]
        draft_probs = probs[torch.tensor(draft_rows, device=device),
                            torch.tensor(drafts_flat, device=device)].tolist()
        shared = torch.rand(len(drafts_flat)).tolist()
        pos = 0
        for req, is_greedy in zip(requests, greedy, strict=True):
            d = len(req.draft_token_ids)
            if d and not is_greedy and req.generator is not None:
                shared[pos : pos + d] = torch.rand(d, generator=req.generator, device=req.generator.device).tolist()
            pos += d
        uniforms = shared

    tokens: list[list[int]] = []
    final_rows: list[int] = []  # row of each random request's drawn token
    rejected: list[int | None] = []  # the draft token the row rejected, None for a bonus row
    random_requests: list[int] = []
    pos = 0
    for i, (req, is_greedy) in enumerate(zip(requests, greedy, strict=True)):
        drafts = req.draft_token_ids
        accepted = 0
        for j, token in enumerate(drafts):
            ok = argmax[starts[i] + j] == token if is_greedy else uniforms[pos + j] < draft_probs[pos + j]
            if not ok:
                break
            accepted += 1
        pos += len(drafts)
        out = list(drafts[:accepted])
        row = starts[i] + accepted
        if is_greedy:
            out.append(argmax[row])
        else:
            random_requests.append(i)
            final_rows.append(row)
            rejected.append(drafts[accepted] if accepted < len(drafts) else None)
        tokens.append(out)

    if random_requests:
        assert probs is not None
        residual = probs[torch.tensor(final_rows, device=device)].clone()  # [S, V]
        for s, token in enumerate(rejected):
            if token is not None:
                residual[s, token] = 0.0
        generators = {s: requests[i].generator for s, i in enumerate(random_requests)
                      if requests[i].generator is not None}
        drawn = gumbel_max(residual.log(), generators).tolist()  # type: ignore[arg-type]
        for s, i in enumerate(random_requests):
            tokens[i].append(drawn[s])

    return tokens, _logprobs(logits, requests, tokens, starts)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the argmax: no logit bias, no whitelist, no active
    ``min_tokens``, no penalties (what ``process_logits`` applies)."""
    return (float(params.temperature) < _SAMPLING_EPS and not params.logit_bias and not params.allowed_token_ids
            and not (params.min_tokens > 0 and params.all_stop_token_ids)
            and abs(float(params.presence_penalty)) < _SAMPLING_EPS
            and abs(float(params.frequency_penalty)) < _SAMPLING_EPS
            and abs(float(params.repetition_penalty) - 1.0) < _SAMPLING_EPS)


def _longest_match(argmax: list[int], start: int, drafts: Sequence[int]) -> list[int]:
    """The drafts equal to the target's argmax (rows from ``start``), then the target's token."""
    accepted = 0
    for j, token in enumerate(drafts):
        if argmax[start + j] != token:
            break
        accepted += 1
    return [*drafts[:accepted], argmax[start + accepted]]


def _logprobs(logits: torch.Tensor, requests: Sequence[VerifyRequest], tokens: list[list[int]],
              starts: list[int]) -> list[LogprobsLists | None]:
    """Raw-distribution logprobs of every output token of the requests that asked for them."""
    wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    result: list[LogprobsLists | None] = [None] * len(requests)
    if not wanted:
        return result
    rows = [starts[i] + j for i in wanted for j in range(len(tokens[i]))]
    targets = torch.tensor([t for i in wanted for t in tokens[i]], device=logits.device)
    k = max(int(requests[i].sampling_params.num_logprob_columns) for i in wanted)
    raw = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), dim=-1)
    explicit, pos = {}, 0
    for i in wanted:
        if requests[i].sampling_params.logprob_token_ids:
            explicit.update({pos + j: requests[i].sampling_params.logprob_token_ids for j in range(len(tokens[i]))})
        pos += len(tokens[i])
    tensors = compute_topk_logprobs(raw, k, targets).with_explicit_ids(raw, explicit)
    ids, lps, ranks = tensors.tolists()
    column_ranks = tensors.column_ranks.tolist() if tensors.column_ranks is not None else None
    pos = 0
    for i in wanted:
        n, ki = len(tokens[i]), int(requests[i].sampling_params.num_logprob_columns)
        row_ranks: list[int | list[int]] = list(ranks[pos : pos + n])
        if column_ranks is not None and requests[i].sampling_params.logprob_token_ids:
            row_ranks = [x[: ki + 1] for x in column_ranks[pos : pos + n]]
        result[i] = ([x[: ki + 1] for x in ids[pos : pos + n]], [x[: ki + 1] for x in lps[pos : pos + n]],
                     row_ranks)
        pos += n
    return result
