"""FP8 activations quantized by the op that produces them (norm, SiLU-and-mul) instead of by the
linear layer that consumes them: the same bytes, so the same tokens and logprobs.

On the CPU core's torch references run; the CUDA kernels are checked against the unfused ones in
tests/cuda/test_norm_quant_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.layers import RMSNorm, SiluAndMul
from pagedlm.core.layers.activation import silu_and_mul_fp8_quant_reference, silu_and_mul_reference
from pagedlm.core.layers.causal_lm import PreNormDecoderLayer
from pagedlm.core.layers.layernorm import (
    fused_add_rms_norm_fp8_quant_reference,
    rms_norm_fp8_quant_reference,
    rms_norm_reference,
)
from pagedlm.core.layers.mlp import GatedMLP
from pagedlm.core.layers.quantization.utils import QuantizedActivation, quantize_fp8_per_token

DTYPES = [torch.bfloat16, torch.float16]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _rows(dtype: torch.dtype, t: int = 7, n: int = 96, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=gen) * torch.rand(t, 1, generator=gen) * 8
    x[0] = 0.0  # an all-zero row: the scale's 1e-12 floor
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_core_references_are_the_unfused_composition(dtype):
    x, residual = _rows(dtype), _rows(dtype, seed=1)
    weight = (torch.rand(96, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)

    q, s = rms_norm_fp8_quant_reference(x, weight, 1e-6)
    ref_q, ref_s = quantize_fp8_per_token(rms_norm_reference(x, weight, 1e-6))
    assert torch.equal(_bytes(q), _bytes(ref_q)) and torch.equal(s, ref_s) and s.shape == (7, 1)

    q, s, summed = fused_add_rms_norm_fp8_quant_reference(x, residual, weight, 1e-6)
    ref_q, ref_s = quantize_fp8_per_token(rms_norm_reference(x + residual, weight, 1e-6))
    assert torch.equal(_bytes(q), _bytes(ref_q)) and torch.equal(s, ref_s) and torch.equal(summed, x + residual)

    q, s = silu_and_mul_fp8_quant_reference(x)
    ref_q, ref_s = quantize_fp8_per_token(silu_and_mul_reference(x))
    assert torch.equal(_bytes(q), _bytes(ref_q)) and torch.equal(s, ref_s) and q.shape == (7, 48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_return_what_the_fp8_linear_would_quantize(dtype):
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    x, residual = _rows(dtype), _rows(dtype, seed=1)

    qa = norm(x, quant_fp8=True)
    assert isinstance(qa, QuantizedActivation) and qa.dtype == dtype
    ref_q, ref_s = quantize_fp8_per_token(norm(x))
    assert torch.equal(_bytes(qa.x_q), _bytes(ref_q)) and torch.equal(qa.scale, ref_s)

    qa, summed = norm(x, residual, quant_fp8=True)
    ref_normed, ref_summed = norm(x, residual)
    ref_q, ref_s = quantize_fp8_per_token(ref_normed)
    assert torch.equal(_bytes(qa.x_q), _bytes(ref_q)) and torch.equal(qa.scale, ref_s)
    assert torch.equal(summed, ref_summed)

    act = SiluAndMul()
    qa = act(x, quant_fp8=True)
    ref_q, ref_s = quantize_fp8_per_token(act(x))
    assert torch.equal(_bytes(qa.x_q), _bytes(ref_q)) and torch.equal(qa.scale, ref_s)


def test_layers_quantize_the_platforms_unfused_op_when_it_has_no_fused_one():
    """The contract of the fused ops: the unfused op's output (the platform's, here a stand-in)
    quantized per token."""
    from pagedlm.core.layers import custom_ops

    def shifted_norm(x, weight, eps):
        return rms_norm_reference(x, weight, eps) + 1

    def shifted_add_norm(x, residual, weight, eps):
        return shifted_norm(x + residual, weight, eps), x + residual

    with custom_ops.use_ops({"rms_norm": shifted_norm, "fused_add_rms_norm": shifted_add_norm,
                             "silu_and_mul": lambda x: silu_and_mul_reference(x) + 1}):
        norm, act = RMSNorm(96), SiluAndMul()
    x, residual = _rows(torch.bfloat16), _rows(torch.bfloat16, seed=1)
    cases = ((norm(x, quant_fp8=True), norm(x)), (norm(x, residual, quant_fp8=True)[0], norm(x, residual)[0]),
             (act(x, quant_fp8=True), act(x)))
    for qa, expected in cases:
        ref_q, ref_s = quantize_fp8_per_token(expected)
        assert torch.equal(_bytes(qa.x_q), _bytes(ref_q)) and torch.equal(qa.scale, ref_s)


def test_linear_takes_quantized_input_only_with_a_matching_gemm():
    """fp8_scaled_mm and fp8_quantized_mm must both be the platform's (whose contract makes them
    agree) or both core's; static input scales, int8 and weight-only never take one."""
    from pagedlm.core.layers import custom_ops
    from pagedlm.core.layers.quantization.schemes import W8A8LinearMethod

    def dynamic_fp8():
        return W8A8LinearMethod(kind="fp8", per_channel=True, static_input=False)

    def unused(*args):
        raise AssertionError("not called")

    assert dynamic_fp8().accepts_fp8_activations
    for ops in ({"fp8_scaled_mm": unused}, {"fp8_quantized_mm": unused}):
        with custom_ops.use_ops(ops):
            assert not dynamic_fp8().accepts_fp8_activations
    with custom_ops.use_ops({"fp8_scaled_mm": unused, "fp8_quantized_mm": unused}):
        assert dynamic_fp8().accepts_fp8_activations
    for method in (W8A8LinearMethod(kind="fp8", per_channel=False, static_input=True),
                   W8A8LinearMethod(kind="int8", per_channel=True, static_input=False),
                   W8A8LinearMethod(kind="fp8", per_channel=True, static_input=False, act_quant=False)):
        assert not method.accepts_fp8_activations


def _fusions(model) -> list[tuple[bool, ...]]:
    return [(*layer._fp8_fusion, layer.mlp._fuse_down_quant) for layer in model.modules()
            if isinstance(layer, PreNormDecoderLayer)]


def _set_fusion(model, on: bool) -> None:
    """The test's off switch: overrides the decision each layer cached at its first forward."""
    for module in model.modules():
        if isinstance(module, PreNormDecoderLayer):
            module._fp8_fusion = (on, on)
        elif isinstance(module, GatedMLP):
            module._fuse_down_quant = on


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    prompts = [{"prompt_token_ids": [1, 5 + i, 40 + 3 * i, 7, 99 - i, 200 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        seq = out.outputs[0]
        result.append((list(seq.token_ids), [lp[t].logprob for t, lp in zip(seq.token_ids, seq.logprobs)]))
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_online_fp8_gives_the_same_tokens_and_logprobs_fused_or_not(arch, tiny_checkpoint_factory):
    llm = LLM(model=tiny_checkpoint_factory(arch), dtype="bfloat16", device="cpu", quantization="fp8")
    fused = _generate(llm)
    model = llm.llm_engine.core.executor.worker.model_runner.model
    fusions = _fusions(model)  # decided at the first forward
    assert fusions and all(f == (True, True, True) for f in fusions), fusions
    _set_fusion(model, False)
    assert _generate(llm) == fused


def test_float32_models_keep_the_unfused_path(tiny_checkpoint_factory):
    llm = LLM(model=tiny_checkpoint_factory("llama"), dtype="float32", device="cpu", quantization="fp8")
    _generate(llm)
    model = llm.llm_engine.core.executor.worker.model_runner.model
    fusions = _fusions(model)
    assert fusions and all(f == (False, False, False) for f in fusions), fusions
