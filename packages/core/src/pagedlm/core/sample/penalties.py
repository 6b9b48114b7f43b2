"""Logit processors applied before sampling: logit bias, min-tokens masking and the
presence/frequency/repetition penalties.

All functions take float32 logits ``[B, V]`` that the caller owns (the sampler hands them its own
copy), work in place where they can and return the result: always use the return value.
Per-row work is batched: the few host-side loops only gather index lists (one entry per
biased/forbidden token) and never touch the vocabulary dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch


def apply_logit_bias(logits: torch.Tensor, logit_bias: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """Adds each row's ``{token_id: bias}`` to ``logits`` ``[B, V]`` (ids outside ``[0, V)`` are
    ignored: the request was validated against the tokenizer's vocabulary, which may be smaller or
    larger than the padded logits)."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for row, bias in enumerate(logit_bias):
        if not bias:
            continue
        for token_id, value in bias.items():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
                vals.append(value)
    if rows:
        idx = _index_tensors(rows, cols, logits.device)
        logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, allowed_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """Sets every id outside a row's whitelist to ``-inf`` (rows absent from the map keep all
    ids). ``logits``: ``[B, V]``, modified in place."""
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    rows = [row for row, ids in allowed_token_ids.items() for _ in ids]
    cols = [t for ids in allowed_token_ids.values() for t in ids]
    keep.index_put_(_index_tensors(rows, cols, logits.device), torch.tensor(True, device=logits.device))
    unrestricted = [row for row in range(logits.shape[0]) if row not in allowed_token_ids]
    if unrestricted:
        keep[torch.tensor(unrestricted, device=logits.device)] = True
    return logits.masked_fill_(~keep, float("-inf"))


def apply_min_tokens(
    logits: torch.Tensor,
    output_token_ids: Sequence[Sequence[int]],
    min_tokens: dict[int, tuple[int, set[int]]],
) -> torch.Tensor:
    """Sets the forbidden ids of every row whose output is still shorter than its ``min_tokens``
    to ``-inf``, so eos/stop tokens cannot end the request early. ``logits``: ``[B, V]``."""
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for row, (min_toks, stop_ids) in min_tokens.items():
        if len(output_token_ids[row]) >= min_toks:
            continue
        for token_id in stop_ids:
            if 0 <= token_id < vocab_size:
                rows.append(row)
                cols.append(token_id)
    if rows:
        logits.index_put_(_index_tensors(rows, cols, logits.device), torch.tensor(float("-inf"), device=logits.device))
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: Sequence[Sequence[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Applies the three penalties, in the order HF/vLLM do (repetition first).

    - repetition (HF ``RepetitionPenaltyLogitsProcessor`` semantics): for every token seen in the
      prompt or the output, a positive logit is divided by the penalty, a negative one multiplied.
    - frequency: subtracts ``frequency * count`` (count of the token in the OUTPUT only).
    - presence: subtracts ``presence`` once if the token occurs in the OUTPUT.

    Args:
        logits: ``[B, V]`` float32; not modified (the penalized logits are a new tensor).
        prompt_token_ids: ``[B, P]`` int64; ids outside ``[0, V)`` (the ``vocab_size`` padding)
            are ignored. ``None``: no prompt tokens count.
        output_token_ids: per row, the tokens generated so far.
        presence_penalties / frequency_penalties / repetition_penalties: ``[B]`` float32.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    output_counts = output_token_counts(output_token_ids, vocab_size, device)  # [B, V]
    output_mask = output_counts > 0  # [B, V]

    if prompt_token_ids is not None and prompt_token_ids.numel() > 0:
        seen = token_counts(prompt_token_ids.to(device), vocab_size) > 0
        seen |= output_mask
    else:
        seen = output_mask
    # A row with penalty 1.0 gets factor 1.0 everywhere, so the where() below is a no-op for it.
    factor = torch.where(seen, repetition_penalties.to(device).unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)

    logits -= frequency_penalties.to(device).unsqueeze(1) * output_counts
    logits -= presence_penalties.to(device).unsqueeze(1) * output_mask
    return logits


def output_token_counts(
    output_token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Per-row occurrence counts of ragged host lists -> ``[B, V]`` float32 on ``device``.

    The lists are flattened with numpy (several times faster than ``torch.tensor`` on a padded
    list of lists) and cross to the device in one ``[2, N]`` copy of (row, id) pairs.
    """
    num_rows = len(output_token_ids)
    lengths = np.fromiter((len(ids) for ids in output_token_ids), dtype=np.int64, count=num_rows)
    pairs = np.empty((2, int(lengths.sum())), dtype=np.int64)
    pairs[0] = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    pairs[1] = np.fromiter(chain.from_iterable(output_token_ids), dtype=np.int64, count=pairs.shape[1])
    rows, ids = torch.from_numpy(pairs).to(device)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)  # out of range -> dropped bin
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    counts.view(-1).scatter_add_(0, rows * (vocab_size + 1) + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts of ``token_ids`` ``[B, L]`` -> ``[B, V]`` float32.

    Ids outside ``[0, V)`` (padding, or ids of a tokenizer larger than the logits) land in an
    extra bin ``V`` that is dropped, which avoids a boolean-mask gather of variable size.
    """
    num_rows = token_ids.shape[0]
    ids = torch.where((token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _index_tensors(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )
