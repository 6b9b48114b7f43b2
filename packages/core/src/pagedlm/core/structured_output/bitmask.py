"""The worker's side of structured outputs: a step's grammar bitmask applied to its logits.

The scheduler sends one bitmask row per sampling request that has a live grammar
(``SchedulerOutput.grammar_bitmask``, ``int32 [R, ceil(V/32)]``, and
``structured_output_request_ids``: req_id -> row). Tokens whose bit is clear get ``-inf``, on the
logits' device, before the sampler runs (outside any captured graph: the sampler is not in one).
A platform may register the ``apply_token_bitmask`` op (one kernel); the torch code here is its
reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedlm.core.layers.custom_ops import LayerOp
from pagedlm.core.platforms import HOST

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  logit_rows: torch.Tensor | None) -> None:
    """The ``apply_token_bitmask`` op in torch (``layers.custom_ops`` has the contract)."""
    vocab = logits.shape[-1]
    if logit_rows is not None:
        keep = logit_rows >= 0
        bitmask, logit_rows = bitmask[keep], logit_rows[keep].long()
        if not len(logit_rows):
            return
    # NOTE: little-endian words: byte k of word w holds tokens 32w + 8k .. 32w + 8k + 7, lowest bit
    # first. Unpacking bytes, not words, keeps the temporary at one byte per token.
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    allowed = (as_bytes.unsqueeze(-1) >> _bit_shifts(logits.device)) & 1  # [R, 4W, 8]
    blocked = allowed.view(len(bitmask), -1)[:, :vocab] == 0  # [R, V]
    if logit_rows is None:
        logits.masked_fill_(blocked, float("-inf"))
        return
    logits[logit_rows] = logits[logit_rows].masked_fill(blocked, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, sample_req_ids: list[str], row_of: dict[str, int],
                          bitmask: np.ndarray,
                          to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
                          op: LayerOp | None = None) -> None:
    """Mask ``logits`` ``[S, V]`` in place: logits row ``i`` (request ``sample_req_ids[i]``) keeps
    only the tokens allowed by its bitmask row ``row_of[req_id]``; rows of other requests are
    left alone. ``bitmask`` ``int32 [R, W]`` with ``32 * W >= V``; ``to_device`` (the runner's
    staging copy) brings host arrays to the logits' device without waiting for it; ``op`` is
    the platform's ``apply_token_bitmask`` (None: the torch reference)."""
    if not row_of:
        return
    logit_rows = np.full(len(bitmask), -1, dtype=np.int32)
    in_order = len(sample_req_ids) == len(bitmask)
    for i, req_id in enumerate(sample_req_ids):
        row = row_of.get(req_id)
        if row is not None:
            logit_rows[row] = i
            in_order = in_order and row == i
        else:
            in_order = False
    if not (logit_rows >= 0).any():
        return
    device = logits.device

    def on_device(array: np.ndarray) -> torch.Tensor:
        if device.type == HOST.type:
            return torch.from_numpy(np.ascontiguousarray(array))
        if to_device is not None:
            return to_device(array)
        return torch.from_numpy(np.ascontiguousarray(array)).pin_memory().to(device, non_blocking=True)

    # NOTE: the scheduler numbers rows in step order, so usually the rows match one to one
    words = on_device(bitmask)
    rows = None if in_order else on_device(logit_rows)
    (op or apply_token_bitmask_reference)(logits, words, rows)
