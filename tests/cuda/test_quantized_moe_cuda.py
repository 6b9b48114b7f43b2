"""Quantized experts end to end on the CUDA backend (GPU only): the tiny Qwen3-MoE and Mixtral
checkpoints with compressed-tensors W4A16 / FP8 experts (the rest of the model unquantized).

W4A16 (fp32 activations): HF's greedy tokens on the decompressed weights, as on the CPU. FP8: the
CPU engine's tokens (core's references), the FP8 kernels agreeing with them up to an activation
that lands on an FP8 rounding boundary; at most one prompt may differ.
"""

from __future__ import annotations

import os
import random

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(INTERPRET, reason="end to end on a GPU only")]
MAX_NEW = 12


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, 500) for _ in range(n)] for n in (40, 3, 17, 64)]


def _tokens(model_dir: str, device: str, **kw) -> list[list[int]]:
    from pagedlm.core.testing import engine_greedy

    return engine_greedy(model_dir, prompts(), MAX_NEW, dtype="float32", device=device, **kw)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_w4a16_experts_match_hf(arch, tiny_checkpoint_factory, tmp_path, device):
    pytest.importorskip("compressed_tensors")
    from pagedlm.core import LLM
    from pagedlm.core.testing import assert_greedy_matches_hf, hf_greedy
    from pagedlm.core.testing.quantized_moe import make_quantized_experts_checkpoint

    model_dir, reference = make_quantized_experts_checkpoint(tiny_checkpoint_factory(arch), tmp_path / "q", "W4A16",
                                                             group_size=32)
    llm = LLM(model=model_dir, dtype="float32", device="cuda")
    forgiven = assert_greedy_matches_hf(model_dir, prompts(), MAX_NEW, llm=llm,
                                        reference=hf_greedy(reference, prompts(), MAX_NEW), logprobs=5,
                                        logprob_atol=1e-3)
    assert forgiven <= 1


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_experts_give_the_cpu_engines_tokens(arch, tiny_checkpoint_factory, tmp_path, device):
    pytest.importorskip("compressed_tensors")
    from pagedlm.core.testing.quantized_moe import make_quantized_experts_checkpoint

    ct, _ = make_quantized_experts_checkpoint(tiny_checkpoint_factory(arch), tmp_path / "q", "FP8_DYNAMIC")
    cpu, gpu = _tokens(ct, "cpu"), _tokens(ct, "cuda")
    assert sum(a != b for a, b in zip(cpu, gpu)) <= 1, (cpu, gpu)
