"""Fixtures of the serving-surface tests: a tiny sentence-transformers embedding checkpoint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_st_qwen3(tiny_checkpoint_factory, tmp_path_factory) -> str:
    """A tiny random Qwen3 saved as a sentence-transformers model: mean pooling, then Normalize."""
    from pagedlm.core.testing.sentence_transformers import make_sentence_transformers_checkpoint

    base = tiny_checkpoint_factory("qwen3")
    return make_sentence_transformers_checkpoint(base, str(tmp_path_factory.mktemp("st-qwen3")), pooling="mean")
