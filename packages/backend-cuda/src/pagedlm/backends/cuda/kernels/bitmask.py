"""The ``apply_token_bitmask`` op: a step's grammar bitmask applied to its logits in one launch.

Core's torch reference unpacks every bit into a byte-per-token temporary (``[R, V]`` uint8, then a
bool mask) in four launches; here program ``(r, block)`` loads ``BLOCK // 32`` words of bitmask row
``r`` and stores ``-inf`` over the blocked tokens of logits row ``logit_rows[r]`` directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch

__all__ = ["apply_token_bitmask"]

#: tokens per program (128 words of the bitmask)
BLOCK = 4096


@triton.jit(do_not_specialize=["vocab_size", "num_words"])
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_bitmask, vocab_size,
                                num_words, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    block = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r)
    else:
        row = r
    if row >= 0:
        words_at = block * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        words = tl.load(bitmask_ptr + r.to(tl.int64) * stride_bitmask + words_at, mask=words_at < num_words,
                        other=-1)
        blocked = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0  # [BLOCK // 32, 32]
        cols = block * BLOCK + tl.arange(0, BLOCK)
        tl.store(logits_ptr + row.to(tl.int64) * stride_logits + cols, float("-inf"),
                 mask=tl.reshape(blocked, [BLOCK]) & (cols < vocab_size))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: torch.Tensor | None) -> None:
    """See the op's contract in ``pagedlm.core.layers.custom_ops``."""
    num_rows, num_words = bitmask.shape
    vocab_size = logits.shape[-1]
    if num_rows == 0:
        return
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("apply_token_bitmask needs rows with unit stride (logits and bitmask)")
    if logit_rows is None and num_rows != logits.shape[0]:
        raise ValueError(f"apply_token_bitmask: {num_rows} bitmask rows for {logits.shape[0]} logits rows "
                         "and no logit_rows")
    grid = (num_rows, triton.cdiv(min(vocab_size, 32 * num_words), BLOCK))
    launch(_apply_token_bitmask_kernel, grid, logits, bitmask, logit_rows, logits.stride(0), bitmask.stride(0),
           vocab_size, num_words, HAS_ROWS=logit_rows is not None, BLOCK=BLOCK)
