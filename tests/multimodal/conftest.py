"""A tiny random LLaVA checkpoint (built once per session), images, and HF's model on it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pagedlm.core.testing.multimodal import make_tiny_llava_checkpoint

    return make_tiny_llava_checkpoint(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def hf_llava(tiny_llava):
    from pagedlm.core.testing.multimodal import load_hf_llava

    return load_hf_llava(tiny_llava)
