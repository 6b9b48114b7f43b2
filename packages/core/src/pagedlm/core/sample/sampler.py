"""The sampler: turns the last-position logits of a mixed batch into one token per row, on the
logits' device (CPU or CUDA alike), every row with its own parameters.

Pipeline for logits ``[B, V]``:

1. raw logprobs (only if some row wants them): ``log_softmax`` of the incoming logits in float32,
   before any processing — the model's own distribution, as vLLM returns by default.
2. ``process_logits``: float32, logit bias, min-tokens masking, the custom logits processors
   that may change the argmax (``SamplingMetadata.logitsprocs``, vLLM's order), penalties.
   Skipped when no row has a bias, min-tokens or penalty and no such processor is configured: it
   would only make a float32 copy, which neither step 3 nor the fused sampler needs.
3. greedy rows: ``argmax`` of the processed logits (lowest index wins ties).
4. random rows: divide by temperature, min-p, the argmax-invariant custom processors, top-k,
   top-p, then the Gumbel-max draw ``argmax(logits - log q)`` with ``q ~ Exponential(1)`` (so
   ``-log q`` is Gumbel), which draws exactly from ``softmax(logits)`` without computing it: the
   exponential race ``argmax(probs / q)`` in log space.

   Fused path: where a platform registers ``"gumbel_sample"`` (see ``pagedlm.core.layers.
   custom_ops``) for the platform the sampler is built for, a batch with random rows, no min-p/top-k/top-p, no
   seeded random row and no argmax-invariant custom processor is sampled by that one op instead:
   temperature, noise and argmax (greedy rows included) in one pass over the logits in their own
   dtype (already processed by step 2 when there was anything to process). An all-greedy batch
   goes through the op too where it exists: its argmax is the same ids, spread over many programs.

Reproducibility contract: every random row consumes exactly one ``Exponential`` draw of ``V``
values per call. Seeded rows draw theirs with their own generator, so a seeded request gives the
same tokens whatever else is in the batch and wherever its row is; unseeded rows share one batch
draw from the default generator. Greedy rows never touch their generator. On the fused path
(never taken with a seeded random row) the unseeded rows instead draw from the op's own
counter-based RNG, keyed by one 62-bit integer taken per call from torch's default CPU
generator: reproducible under ``torch.manual_seed``, but not the same tokens as the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.core.layers.custom_ops import LayerOp, bound_op
from pagedlm.core.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from pagedlm.core.sample.metadata import SamplingMetadata
from pagedlm.core.sample.penalties import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)

_SAMPLING_EPS = 1e-5
#: the fused op's per-call seed is drawn from ``[0, 2**62)``
_FUSED_SEED_RANGE = 2**62


@dataclass
class SamplerOutput:
    """Attributes:
    sampled_token_ids: ``[B]`` int64 on the logits' device.
    logprobs_tensors: logprobs of the raw distribution (``[B, k+1]``, column 0 the sampled
        token), or ``None`` when no row asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per row of ``logits`` ``[B, V]`` according to ``SamplingMetadata``."""

    def __init__(self) -> None:
        super().__init__()
        # the platform's fused sampler, if it registered one (layers.custom_ops); bound once
        self._gumbel_sample_op = bound_op("gumbel_sample")

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
        md = sampling_metadata
        if md.num_rows != logits.shape[0]:
            raise ValueError(f"logits have {logits.shape[0]} rows but the sampling metadata {md.num_rows}")

        raw_logprobs = None
        if md.max_num_logprobs is not None:
            # Taken before any processing: logprobs describe the model, not the sampling knobs.
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)

        if logits.shape[0] == 0:
            sampled = torch.empty(0, dtype=torch.int64, device=logits.device)
        elif _needs_processing(md):
            sampled = sample(process_logits(logits, md), md, self._gumbel_sample_op)
        else:
            sampled = sample(logits, md, self._gumbel_sample_op)

        logprobs_tensors = None
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            logprobs_tensors = compute_topk_logprobs(raw_logprobs, md.max_num_logprobs, sampled).with_explicit_ids(
                raw_logprobs, md.logprob_token_ids)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Logits ``[B, V]`` (any float dtype) -> processed float32 logits ``[B, V]``: logit bias,
    then min-tokens masking, then the custom processors that may change the argmax, then
    repetition/frequency/presence penalties. Never modifies the input tensor."""
    has_bias = any(md.logit_bias)
    procs = md.logitsprocs if md.logitsprocs is not None and md.logitsprocs.non_argmax_invariant else None
    # Bias, whitelists, min-tokens and custom processors write in place; copy only then (``.to``
    # copies anyway from bf16/fp16).
    out = logits.to(torch.float32, copy=bool(has_bias or md.allowed_token_ids or md.min_tokens or procs))
    if has_bias:
        out = apply_logit_bias(out, md.logit_bias)
    if md.allowed_token_ids:
        out = apply_allowed_token_ids(out, md.allowed_token_ids)
    if md.min_tokens:
        out = apply_min_tokens(out, md.output_token_ids, md.min_tokens)
    if procs is not None:
        out = procs.apply_non_argmax_invariant(out)
    if not md.no_penalties:
        out = apply_penalties(
            out,
            md.prompt_token_ids,
            md.output_token_ids,
            md.presence_penalties,
            md.frequency_penalties,
            md.repetition_penalties,
        )
    return out


def _needs_processing(md: SamplingMetadata) -> bool:
    """Whether ``process_logits`` does more than a float32 copy for this batch."""
    return (any(md.logit_bias) or bool(md.allowed_token_ids) or bool(md.min_tokens) or not md.no_penalties
            or (md.logitsprocs is not None and md.logitsprocs.non_argmax_invariant))


def sample(logits: torch.Tensor, md: SamplingMetadata, gumbel_sample: LayerOp | None = None) -> torch.Tensor:
    """Logits ``[B, V]`` -> sampled ids ``[B]`` int64. Does not modify ``logits``.

    ``gumbel_sample``: a platform's implementation of that op (``layers.custom_ops``), used for
    batches it can take; None: torch only.

    ``logits`` are the output of ``process_logits`` (float32), or the raw logits in any float
    dtype when there was nothing to process: argmax and the fused op read them as they are, and
    the torch random path casts them to float32 first, as ``process_logits`` would have.
    """
    if md.all_greedy:
        # NOTE: same ids as on a float32 copy: the cast is exact and keeps the order and ties.
        if gumbel_sample is not None:
            # The op takes the argmax of rows at temperature 0 (lowest index on ties, as
            # torch.argmax) over many programs per row; torch reduces a single row in one.
            return gumbel_sample(logits, md.temperature, 0, 0)
        return greedy(logits)
    generators = _random_generators(md)
    # Argmax-invariant custom processors run after the temperature, which the fused op applies.
    late_procs = md.logitsprocs if md.logitsprocs is not None and md.logitsprocs.argmax_invariant else None
    fusable = not generators and md.min_p is None and md.top_k is None and md.top_p is None and late_procs is None
    if gumbel_sample is not None and fusable:
        # Greedy rows have temperature 0.0, for which the op takes the argmax. The key comes
        # from the default CPU generator: no device sync, and torch.manual_seed replays it.
        return gumbel_sample(logits, md.temperature, int(torch.randint(_FUSED_SEED_RANGE, (1,)).item()), 0)

    logits = logits.to(torch.float32)  # no copy for processed logits
    greedy_tokens = None
    if not md.all_random:
        greedy_tokens = greedy(logits)

    # Greedy rows go through the random path too (batched), with a harmless temperature of 1;
    # their result is discarded below.
    logits = logits / md.random_temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if late_procs is not None:
        logits = late_procs.apply_argmax_invariant(logits)  # a new tensor (the division made it)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, max_top_k=md.max_top_k)
    random_tokens = gumbel_max(logits, generators)
    if greedy_tokens is None:
        return random_tokens
    return torch.where(md.temperature < _SAMPLING_EPS, greedy_tokens, random_tokens)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` ``[B, V]`` (lowest index on ties, NaN wins), ``[B]`` int64.

    NOTE: ``max(dim).indices`` gives ``argmax``'s ids (same tie and NaN rule) and is 3x faster on
    the CPU: torch 2.13's argmax does not vectorise the reduction (Gemma's 262,144-token rows at
    batch 32: 10.4 ms against 3.1 ms, a twentieth of a decode step).
    """
    return logits.max(dim=-1).indices


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below ``min_p * max_prob`` of their row.

    ``logits`` ``[B, V]`` float32 (already temperature-scaled), ``min_p`` ``[B]`` (0 = off: no
    probability is below 0). Returns new logits.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p.to(logits.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


#: largest k for which top-k alone uses ``torch.topk`` instead of a full sort of the vocabulary
TOPK_WITHOUT_SORT_MAX = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Masks everything outside each row's top-k tokens, then outside its top-p nucleus.

    With top-k alone and ``max_top_k`` (the largest k of any row, known on the host) at most
    ``TOPK_WITHOUT_SORT_MAX``, the k-th largest logit of each row comes from one ``topk`` of
    ``max_top_k`` columns instead of a sort of the whole vocabulary (same result).

    Args:
        logits: ``[B, V]`` float32 (temperature-scaled). Not modified.
        top_k: ``[B]`` int64, ``0`` (or anything ``>= V``) = off; or ``None``.
        top_p: ``[B]`` float32, ``1.0`` = off; or ``None``.

    Returns:
        New logits ``[B, V]`` with masked entries at ``-inf``. Tokens tied with the k-th largest
        logit are all kept. The top token of a row always survives top-p.
    """
    vocab_size = logits.shape[-1]
    neg_inf = float("-inf")
    if top_p is None and top_k is not None and max_top_k is not None and 0 < max_top_k <= TOPK_WITHOUT_SORT_MAX \
            and max_top_k < vocab_size:
        k = top_k.to(device=logits.device, dtype=torch.int64)
        largest = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
        kth_largest = largest.gather(1, (k.clamp(1, max_top_k) - 1).unsqueeze(1))  # [B, 1]
        off = ((k <= 0) | (k >= vocab_size)).unsqueeze(1)  # rows without top-k keep everything
        return logits.masked_fill((logits < kth_largest) & ~off, neg_inf)
    # One ascending sort serves both filters: the k-th largest is at column V - k, and the
    # nucleus is a suffix of the sorted row.
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [B, V] each
    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [B, 1]
        if top_p is None:
            # No need to scatter back: the threshold applies to the unsorted row directly.
            return logits.masked_fill(logits < kth_largest, neg_inf)
        sorted_logits.masked_fill_(sorted_logits < kth_largest, neg_inf)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending -> ends near 1
        # Drop the low-probability prefix whose total mass is <= 1 - p; the rest is the nucleus.
        drop = cumulative <= (1.0 - top_p.to(logits.device)).unsqueeze(1)
        drop[:, -1] = False  # rounding must never empty a row
        sorted_logits.masked_fill_(drop, neg_inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def gumbel_max(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draws one token per row from ``softmax(logits)`` (``logits`` ``[B, V]`` float32, masked
    entries ``-inf``) as ``argmax(logits - log q)``, ``q`` i.i.d. Exponential(1) — equivalent to
    multinomial sampling, without a host sync, a softmax or a cumsum.

    Rows in ``generators`` draw their ``q`` row (``V`` values) with their own generator; the other
    rows share one draw from the default generator. Returns ``[B]`` int64.
    """
    num_rows, vocab_size = logits.shape
    q = torch.empty_like(logits)
    if len(generators) < num_rows:
        q.exponential_()
    # A loop over seeded rows only (not the vocabulary): each generator must produce its own
    # row regardless of its position in the batch.
    same_device: dict[torch.device, bool] = {}  # per generator device, not per row (hot loop)
    for row, generator in generators.items():
        gen_device = generator.device
        same = same_device.get(gen_device)
        if same is None:
            same = same_device[gen_device] = _same_device(gen_device, q.device)
        if same:
            q[row].exponential_(generator=generator)
        else:
            # E.g. a CPU generator with CUDA logits: draw where the generator lives, then copy.
            draw = torch.empty(vocab_size, dtype=q.dtype, device=generator.device)
            q[row].copy_(draw.exponential_(generator=generator))
    # An exact 0 from the draw would give -inf + inf = NaN on a masked token, and argmax favours NaN.
    q.clamp_min_(torch.finfo(q.dtype).tiny).log_()
    return torch.sub(logits, q, out=q).argmax(dim=-1)


def _random_generators(md: SamplingMetadata) -> dict[int, torch.Generator]:
    """The generators of the rows that really sample, so greedy rows never advance theirs."""
    if not md.generators or md.all_random:
        return md.generators
    rows = list(md.generators)
    # Mixed batch with seeded rows: a small host read of those rows' temperatures is needed.
    temps = md.temperature[rows].tolist()
    return {row: md.generators[row] for row, t in zip(rows, temps, strict=True) if t >= _SAMPLING_EPS}


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device: an empty tensor's device has the index filled in.
    if a.type != b.type:
        return False
    return torch.empty(0, device=a).device == torch.empty(0, device=b).device
