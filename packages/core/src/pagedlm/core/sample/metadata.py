"""``SamplingMetadata``: the per-step, per-row sampling parameters of a batch, as device tensors.

The model runner builds one of these every step for the B rows (requests) it samples. Row ``i``
of every tensor/list belongs to the same request. Scalars (``all_greedy``, ``no_penalties``, ...)
let the sampler skip whole stages without looking at the tensors (which would force a device
sync on CUDA).

Conventions (chosen so that a row's "off" value is a no-op for the batched math):

- ``temperature == 0.0`` marks a greedy row.
- ``top_p == 1.0`` is off; ``top_p`` is ``None`` when no row uses it.
- ``top_k == 0`` is off (``SamplingParams`` spells it ``-1``; ``build_sampling_metadata``
  converts); values above the vocabulary size act as off too. ``None`` when no row uses it.
- ``min_p == 0.0`` is off; ``None`` when no row uses it.
- penalties: presence/frequency ``0.0`` and repetition ``1.0`` are off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedlm.core.platforms.interface import HOST
from pagedlm.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.core.sample.logits_processor import LogitsProcessorsStep

_SAMPLING_EPS = 1e-5
_NONE = torch.empty(0, dtype=torch.float32)


@dataclass
class SamplingMetadata:
    """Sampling parameters of the B rows of one step.

    Attributes:
        temperature: ``[B]`` float32; ``0.0`` marks a greedy row.
        random_temperature: ``[B]`` float32, what the random path divides by: ``temperature``
            with greedy rows at ``1.0`` (their draw is discarded).
        all_greedy: every row is greedy (no random draw is made at all).
        all_random: no row is greedy (greedy argmax is skipped).
        top_p: ``[B]`` float32 or ``None`` when no row uses it (``1.0`` = off).
        top_k: ``[B]`` int64 or ``None`` when no row uses it (``0`` = off).
        min_p: ``[B]`` float32 or ``None`` when no row uses it (``0.0`` = off).
        generators: row index -> per-request ``torch.Generator`` (seeded requests only).
        max_num_logprobs: largest ``logprobs`` of any row; ``None`` when no row wants logprobs.
        no_penalties: no row has a presence/frequency/repetition penalty.
        presence_penalties: ``[B]`` float32 (empty when ``no_penalties``).
        frequency_penalties: ``[B]`` float32 (empty when ``no_penalties``).
        repetition_penalties: ``[B]`` float32 (empty when ``no_penalties``).
        prompt_token_ids: ``[B, max_prompt_len]`` int64 padded with ``vocab_size``; ``None``
            when ``no_penalties``.
        output_token_ids: per row, the tokens generated so far (host lists: they grow every
            step and are only turned into a tensor when penalties need them).
        min_tokens: row -> ``(min_tokens, ids)``; ``ids`` (eos + stop_token_ids) are forbidden
            while ``len(output_token_ids[row]) < min_tokens``. Rows without the constraint are
            absent.
        logit_bias: per row, ``{token_id: bias}`` added to the logits, or ``None``.
        allowed_token_ids: row -> the only ids it may sample (rows without a whitelist are absent).
        logprob_token_ids: row -> the ids whose logprobs it returns in place of its top-k
            (rows without them are absent).
    """

    temperature: torch.Tensor
    random_temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    min_tokens: dict[int, tuple[int, set[int]]]
    logit_bias: list[dict[int, float] | None]
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    #: largest top-k of any row (``None`` when no row uses top-k): lets the sampler use
    #: ``torch.topk`` instead of sorting the vocabulary
    max_top_k: int | None = None
    #: the custom logits processors (``LLM(logits_processors=...)``) for these rows; None when
    #: none is configured. The model runner sets it.
    logitsprocs: LogitsProcessorsStep | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    *,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[list[int]],
    vocab_size: int,
    device: torch.device | str = HOST,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    """Builds the metadata of one step from each row's ``SamplingParams`` (a convenience for the
    model runner and for tests; the runner may also keep persistent batch tensors instead).

    Args:
        params: one ``SamplingParams`` per row (B rows).
        prompt_token_ids: per row, the prompt token ids (used only for the repetition penalty).
        output_token_ids: per row, the tokens generated so far. The lists are kept by reference,
            so a runner that appends to them sees the metadata follow.
        vocab_size: the logits' vocabulary size; pads ``prompt_token_ids``.
        device: where the tensors live (the logits' device).
        generators: row -> generator of seeded rows (on ``device``); the caller owns them so
            that a request's stream continues across steps.
    """
    num_rows = len(params)
    if len(prompt_token_ids) != num_rows or len(output_token_ids) != num_rows:
        raise ValueError(
            f"got {num_rows} SamplingParams but {len(prompt_token_ids)} prompts and "
            f"{len(output_token_ids)} outputs; they must match row for row"
        )
    device = torch.device(device)

    def f32(values: list[float]) -> torch.Tensor:
        return _to_device(values, torch.float32, device)

    temps = [0.0 if p.temperature < _SAMPLING_EPS else float(p.temperature) for p in params]
    greedy = [t == 0.0 for t in temps]
    # Greedy rows ignore top-k/top-p/min-p (their draw is discarded), so they never force a stage on.
    top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy, strict=True)]
    top_k = [
        0 if g or p.top_k < 0 or p.top_k >= vocab_size else int(p.top_k) for p, g in zip(params, greedy, strict=True)
    ]
    min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy, strict=True)]

    presence = [float(p.presence_penalty) for p in params]
    frequency = [float(p.frequency_penalty) for p in params]
    repetition = [float(p.repetition_penalty) for p in params]
    no_penalties = all(
        abs(pr) < _SAMPLING_EPS and abs(fr) < _SAMPLING_EPS and abs(rp - 1.0) < _SAMPLING_EPS
        for pr, fr, rp in zip(presence, frequency, repetition, strict=True)
    )

    prompt_tensor = None
    if not no_penalties:
        max_len = max((len(p) for p in prompt_token_ids), default=0)
        padded = [list(p) + [vocab_size] * (max_len - len(p)) for p in prompt_token_ids]
        prompt_tensor = _to_device(padded, torch.int64, device).reshape(num_rows, max_len)

    min_tokens: dict[int, tuple[int, set[int]]] = {}
    for row, p in enumerate(params):
        if p.min_tokens > 0 and p.all_stop_token_ids:
            min_tokens[row] = (p.min_tokens, set(p.all_stop_token_ids))

    logprobs = [p.num_logprob_columns for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=f32(temps),
        random_temperature=f32([t if t > 0.0 else 1.0 for t in temps]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if all(v == 1.0 for v in top_p) else f32(top_p),
        top_k=None if all(v == 0 for v in top_k) else _to_device(top_k, torch.int64, device),
        min_p=None if all(v == 0.0 for v in min_p) else f32(min_p),
        generators=dict(generators or {}),
        max_num_logprobs=max(logprobs) if logprobs else None,
        no_penalties=no_penalties,
        # NOTE: unused without penalties; skipping them saves three host-to-device copies.
        presence_penalties=_NONE if no_penalties else f32(presence),
        frequency_penalties=_NONE if no_penalties else f32(frequency),
        repetition_penalties=_NONE if no_penalties else f32(repetition),
        prompt_token_ids=prompt_tensor,
        output_token_ids=list(output_token_ids),
        min_tokens=min_tokens,
        logit_bias=[{int(k): float(v) for k, v in p.logit_bias.items()} if p.logit_bias else None for p in params],
        allowed_token_ids={row: p.allowed_token_ids for row, p in enumerate(params) if p.allowed_token_ids},
        logprob_token_ids={row: p.logprob_token_ids for row, p in enumerate(params)
                           if p.logprob_token_ids and p.logprobs is not None},
        max_top_k=max(top_k) if any(top_k) else None,
    )


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting for the device.

    ``torch.tensor(values, device="cuda")`` is a blocking copy: the host waits until the GPU has
    finished the forward pass queued before it, so nothing the host does afterwards overlaps
    with it. A non-blocking copy from pageable memory is staged by the driver at once and queued
    in stream order, so the metadata is built while the forward runs.
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # no copy for a host device
