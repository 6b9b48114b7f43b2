"""The ``apply_token_bitmask`` kernel (``kernels/bitmask.py``) against core's torch reference:
rows in step order and through ``logit_rows`` (out of order, skipped rows), vocabularies that
end inside a word and inside a block, every logits dtype; and core's ``apply_grammar_bitmask``
with the kernel as its op. Runs under ``TRITON_INTERPRET=1`` too."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedlm.core.structured_output.bitmask import apply_grammar_bitmask, apply_token_bitmask_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]


def kernel(*args):
    from pagedlm.backends.cuda.kernels.bitmask import apply_token_bitmask

    return apply_token_bitmask(*args)


def random_bitmask(rows: int, vocab: int, seed: int, extra_words: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32) + extra_words
    return rng.integers(-2**31, 2**31 - 1, size=(rows, words), dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [100, 4096, 5000, 151936])
def test_rows_in_order(device, dtype, vocab):
    rows = 3 if INTERPRET and vocab > 5000 else 6
    bitmask = torch.from_numpy(random_bitmask(rows, vocab, vocab)).to(device)
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, None)
    got = logits.clone()
    kernel(got, bitmask, None)
    assert torch.equal(got, expected)
    assert torch.isinf(got).any() and torch.isfinite(got).any()


def test_logit_rows_map_out_of_order_and_skip(device):
    vocab = 5000
    bitmask = torch.from_numpy(random_bitmask(4, vocab, 1, extra_words=3)).to(device)  # wider than the vocab
    logits = torch.randn(7, vocab, device=device)
    rows = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=device)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, rows)
    got = logits.clone()
    kernel(got, bitmask, rows)
    assert torch.equal(got, expected)
    untouched = [1, 2, 4, 6]
    assert torch.equal(got[untouched], logits[untouched])
    # bitmask row 3 went to logits row 3, row 0 to row 5
    blocked_3 = torch.isinf(got[3])
    bits = ((bitmask[3].view(torch.uint8).unsqueeze(-1) >> torch.arange(8, device=device, dtype=torch.uint8)) & 1)
    assert torch.equal(blocked_3, bits.reshape(-1)[:vocab] == 0)


def test_apply_grammar_bitmask_takes_the_op(device):
    """Core's entry point with the op, a sampling row without a grammar and a mask row whose
    request does not sample in the step: the same logits as the reference path."""
    vocab = 3000
    bitmask = random_bitmask(3, vocab, 2)
    logits = torch.randn(4, vocab, device=device)
    row_of = {"a": 2, "c": 0, "z": 1}  # z does not sample here
    expected = logits.clone()
    apply_grammar_bitmask(expected, ["a", "b", "c", "d"], row_of, bitmask)
    got = logits.clone()
    apply_grammar_bitmask(got, ["a", "b", "c", "d"], row_of, bitmask, op=kernel)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 3]], logits[[1, 3]]) and torch.isinf(got[[0, 2]]).any()
