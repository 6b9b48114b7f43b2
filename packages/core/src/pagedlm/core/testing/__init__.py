"""Test helpers for pagedlm and its plugins: tiny checkpoints, a tokenizer, an HF conformance check
and the backend conformance kit (``run_conformance``; see :mod:`pagedlm.core.testing.conformance`).

Public and stable, so that third-party backends and model packages can test themselves the way
the built-in ones are tested::

    from pagedlm.core.testing import make_tiny_checkpoint, assert_greedy_matches_hf

    model_dir = make_tiny_checkpoint(tmp_path / "llama", "llama")
    assert_greedy_matches_hf(model_dir, [[1, 17, 42, 99]], max_new_tokens=16)

Importing this package is cheap: transformers is loaded only when a helper runs, and torch (which
the conformance kit needs) only when one of the kit's names is first used.
"""

from typing import Any

from pagedlm.core.testing.checkpoints import (
    ARCHITECTURES,
    HF_CLASSES,
    MOE_ARCHITECTURES,
    Arch,
    make_dummy_config_dir,
    make_tiny_checkpoint,
    top2_gaps,
)
from pagedlm.core.testing.gguf_reference import GEMMA3_270M_PROMPTS, hf_gguf_greedy, load_hf_gguf_model
from pagedlm.core.testing.hf_reference import (
    HFGreedyResult,
    assert_greedy_matches_hf,
    compare_greedy,
    engine_greedy,
    hf_greedy,
)
from pagedlm.core.testing.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    build_bpe_tokenizer,
)

#: the conformance kit's public names, imported on first access (they import torch)
_CONFORMANCE_NAMES = ("CheckResult", "ConformanceReport", "assert_conformance", "run_conformance")


def __getattr__(name: str) -> Any:
    if name in _CONFORMANCE_NAMES:
        from pagedlm.core.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ARCHITECTURES",
    "Arch",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "CheckResult",
    "ConformanceReport",
    "EOS_ID",
    "GEMMA3_270M_PROMPTS",
    "HFGreedyResult",
    "HF_CLASSES",
    "MOE_ARCHITECTURES",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "assert_conformance",
    "assert_greedy_matches_hf",
    "build_bpe_tokenizer",
    "compare_greedy",
    "engine_greedy",
    "hf_gguf_greedy",
    "hf_greedy",
    "load_hf_gguf_model",
    "make_dummy_config_dir",
    "make_tiny_checkpoint",
    "run_conformance",
    "top2_gaps",
]
