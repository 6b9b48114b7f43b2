"""The worker's side of structured outputs: a step's grammar bitmask applied to its logits.

The scheduler sends one bitmask row per sampling request that has a live grammar
(``SchedulerOutput.grammar_bitmask``, ``int32 [R, ceil(V/32)]``, and
``structured_output_request_ids``: req_id -> row). Tokens whose bit is clear get ``-inf``, on the
logits' device, before the sampler runs (outside any captured graph: the sampler is not in one).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedlm.core.platforms import HOST

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def apply_grammar_bitmask(logits: torch.Tensor, sample_req_ids: list[str], row_of: dict[str, int],
                          bitmask: np.ndarray,
                          to_device: Callable[[np.ndarray], torch.Tensor] | None = None) -> None:
    """Mask ``logits`` ``[S, V]`` in place: logits row ``i`` (request ``sample_req_ids[i]``) keeps
    only the tokens allowed by its bitmask row ``row_of[req_id]``; rows of other requests are
    left alone. ``bitmask`` ``int32 [R, W]`` with ``32 * W >= V``; ``to_device`` (the runner's
    staging copy) brings host rows to the logits' device without waiting for it."""
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    for i, req_id in enumerate(sample_req_ids):
        row = row_of.get(req_id)
        if row is not None:
            logit_rows.append(i)
            mask_rows.append(row)
    if not logit_rows:
        return
    device = logits.device
    vocab = logits.shape[-1]
    # NOTE: the scheduler numbers rows in step order, so usually every row is taken as it is
    host = bitmask if mask_rows == list(range(len(bitmask))) else bitmask[mask_rows]
    if device.type == HOST.type:
        words = torch.from_numpy(np.ascontiguousarray(host))
    elif to_device is not None:
        words = to_device(host)
    else:
        words = torch.from_numpy(np.ascontiguousarray(host)).pin_memory().to(device, non_blocking=True)
    # NOTE: little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit
    # first. Unpacking bytes, not words, keeps the temporary at one byte per token.
    as_bytes = words.view(torch.uint8)  # [R, 4W]
    allowed = (as_bytes.unsqueeze(-1) >> _bit_shifts(device)) & 1  # [R, 4W, 8]
    blocked = allowed.view(len(mask_rows), -1)[:, :vocab] == 0  # [R, V]
    if len(logit_rows) == logits.shape[0]:  # every row has a grammar: no gather/scatter
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(logit_rows, device=device)
    logits[index] = logits[index].masked_fill(blocked, float("-inf"))
