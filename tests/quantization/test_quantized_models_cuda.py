"""The tiny quantized checkpoints of ``conftest.py`` end to end on the CUDA backend (GPU only): the
CUDA kernels (the W4A16/W8A16 GEMV and GEMM, ``torch._scaled_mm``, the INT8 GEMM, the FP8 KV
cache) inside whole engine runs, with CUDA graphs, prefix caching and chunked prefill as defaults.

Metrics, as on the CPU (test_quantized_models.py): weight-only formats give HF's greedy tokens on
the same files (near-ties forgiven and counted, at most one); W8A8 layers (block-wise FP8 too)
give the reference op's outputs on their inputs inside an engine run (why not tokens: that test's
docstring); the FP8 KV cache gives the CPU engine's tokens (the same values stored the same way;
an attention output on a rounding boundary may flip: at most one prompt may differ).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_quantized_models import MAX_NEW, W8A8, WEIGHT_ONLY, prompts

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(INTERPRET, reason="end to end on a GPU only")]


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _tokens(model_dir: str, device: str, **kw) -> list[list[int]]:
    from pagedlm.core.testing import engine_greedy

    return engine_greedy(model_dir, prompts(), MAX_NEW, dtype="float32", device=device, **kw)


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_matches_hf_on_cuda(name, quant_checkpoints):
    from pagedlm.core import LLM
    from pagedlm.core.testing import assert_greedy_matches_hf, hf_greedy

    model_dir, reference = quant_checkpoints[name]
    llm = LLM(model=model_dir, dtype="float32", device="cuda")
    try:
        assert llm.vllm_config.quant_config is not None
        forgiven = assert_greedy_matches_hf(model_dir, prompts(), MAX_NEW, llm=llm,
                                            reference=hf_greedy(reference, prompts(), MAX_NEW), logprobs=5,
                                            logprob_atol=1e-3)
    finally:
        llm.shutdown()
    assert forgiven <= 1


@pytest.mark.parametrize("name", [*W8A8, "fp8-block", "fp8-block-native"])
def test_w8a8_layers_of_an_engine_run_match_the_reference_op(name, quant_checkpoints):
    """Every W8A8 layer of an (eager) CUDA engine run, on the input it got there, gives what the
    reference op (core's ``*_scaled_mm_ref``, on the CPU) gives on that input: loaded weights,
    scales and the activation quantization are wired as on the CPU. NOTE: token-level agreement
    with HF is the CPU test's (test_quantized_models.py); on the GPU this tiny model's float32
    noise (~1e-7 against the CPU's kernels) moves a few activations across a rounding boundary,
    which it amplifies to logprob differences of ~0.2-0.6 teacher-forced (H200, 2026-12-04)."""
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.layers.quantization.schemes import Fp8BlockLinearMethod, W8A8LinearMethod
    from pagedlm.core.layers.quantization.utils import (
        fp8_block_scaled_mm_ref,
        fp8_scaled_mm_ref,
        int8_scaled_mm_ref,
    )

    model_dir, _ = quant_checkpoints[name]
    llm = LLM(model=model_dir, dtype="float32", device="cuda", enforce_eager=True)
    seen: dict[str, tuple] = {}
    hooks = []
    try:
        model = llm.llm_engine.core.executor.worker.model_runner.model
        for layer_name, layer in model.named_modules():
            if isinstance(getattr(layer, "quant_method", None), (W8A8LinearMethod, Fp8BlockLinearMethod)):
                def grab(mod, inp, out, layer_name=layer_name):
                    if layer_name not in seen and inp[0].shape[0] > 1:
                        y = out[0] if isinstance(out, tuple) else out
                        seen[layer_name] = (mod, inp[0].detach().cpu().clone(), y.detach().cpu().clone())
                hooks.append(layer.register_forward_hook(grab))
        llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
        llm.shutdown()
    assert len(seen) >= 4  # qkv, o, gate_up, down of every layer
    for layer_name, (mod, x, y) in seen.items():
        method = mod.quant_method
        if isinstance(method, Fp8BlockLinearMethod):
            ref = fp8_block_scaled_mm_ref(x, mod.weight.cpu(), mod.weight_scale.cpu(), method.block_n, method.block_k)
        else:
            ref_op = fp8_scaled_mm_ref if method.kind == "fp8" else int8_scaled_mm_ref
            scale = mod.input_scale.cpu() if mod.input_scale is not None else None
            ref = ref_op(x, mod.weight.cpu(), mod.weight_scale.cpu(), scale, None)
        if getattr(mod, "bias", None) is not None:
            ref = ref + mod.bias.cpu()
        # NOTE: FP8 x FP8 products accumulate in the tensor cores with fewer bits than float32
        # (cuBLASLt promotes to float32 only every few MMAs): 4.5e-4 of the output's range on layer
        # 0's qkv (K = 256; H100, 2026-12-06, both FP8 checkpoints), so those layers get 2e-3; int8
        # accumulates exactly in int32, the block-FP8 kernel promotes after every MMA, and a wiring
        # fault (a scale, a shard) is off by far more
        tol = 2e-3 if isinstance(method, W8A8LinearMethod) and method.kind == "fp8" else 1e-4
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item(),
                                   msg=lambda m, layer_name=layer_name: f"{layer_name}: {m}")


def test_fp8_kv_cache_gives_the_cpu_engines_tokens(quant_base):
    """float32 model, FP8 cache: the CUDA writer's transposed value blocks and every read of them
    (prefill tiles, decode steps, prefix-cache hits) against the CPU backend's FP8 cache."""
    kw = dict(kv_cache_dtype="fp8")
    cpu, gpu = _tokens(quant_base, "cpu", **kw), _tokens(quant_base, "cuda", **kw)
    assert sum(a != b for a, b in zip(cpu, gpu, strict=True)) <= 1, (cpu, gpu)
