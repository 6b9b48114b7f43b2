"""pagedlm-backend-cuda's hook implementations.

NOTE: only hook implementations and class-path strings live here; triton and every CUDA-only
module are imported later, once the CUDA platform has been selected.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl


def cuda_is_available() -> bool:
    """Cheap probe: ``torch.cuda.is_available()`` on a CUDA build of torch, never raising.

    It neither imports triton nor creates a CUDA context, so calling it before forking worker
    processes is safe. A broken driver or a CPU-only torch build reads as "not available", and
    so does a ROCm build: it answers ``torch.cuda`` calls too, but AMD GPUs are another platform's
    (``torch.version.hip`` is set there).
    """
    try:
        import torch

        return torch.version.hip is None and bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - any probe failure means "not available"
        return False


@hookimpl
def pagedlm_register_platforms(register: Callable[..., None]) -> None:
    # Priority 10: beats the CPU platform (0) for device="auto" whenever a GPU is usable.
    register("cuda", "pagedlm.backends.cuda.platform:CudaPlatform", is_available=cuda_is_available, priority=10)


@hookimpl
def pagedlm_register_attention_backends(register: Callable[[str, str], None]) -> None:
    # Class paths only: triton (and flash_attn) are imported when a backend is resolved.
    register("triton", "pagedlm.backends.cuda.triton_attn:TritonAttentionBackend")
    register("flash_attn", "pagedlm.backends.cuda.flash_attn:FlashAttentionBackend")


_LAYER_OPS = "pagedlm.backends.cuda.kernels.layer_ops"


@hookimpl
def pagedlm_register_ops(register: Callable[..., None]) -> None:
    # One Triton kernel each, imported only when a model is built on the CUDA platform.
    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "qk_norm_rotary_embedding", "silu_and_mul"):
        register(op, "cuda", f"{_LAYER_OPS}:{op}")
    register("gumbel_sample", "cuda", "pagedlm.backends.cuda.kernels.sampling:gumbel_sample")
    register("apply_token_bitmask", "cuda", "pagedlm.backends.cuda.kernels.bitmask:apply_token_bitmask")
    # Full-precision linears at decode (kernels/dense_gemv.py): a Triton GEMV for the shapes its
    # table lists, F.linear for the others.
    register("unquantized_gemm", "cuda", "pagedlm.backends.cuda.kernels.dense_gemv:unquantized_gemm")
    # Quantized GEMMs (kernels/quant_gemm.py): W4A16 on tensor cores (CUDA C++ through NVRTC, its own weight
    # layout from wna16_repack), Triton W4A16/W8A16, torch._scaled_mm FP8, torch._int_mm INT8.
    for op in ("wna16_gemm", "wna16_repack", "fp8_scaled_mm", "int8_scaled_mm", "fp8_quantized_mm"):
        register(op, "cuda", f"pagedlm.backends.cuda.kernels.quant_gemm:{op}")
    # The FP8 linear layers' per-token quantization fused into the ops producing their inputs
    # (kernels/norm_quant.py): the same bytes as the unfused op followed by quant_act.quantize_rows.
    for op in ("rms_norm_fp8_quant", "fused_add_rms_norm_fp8_quant", "silu_and_mul_fp8_quant"):
        register(op, "cuda", f"pagedlm.backends.cuda.kernels.norm_quant:{op}")
    # Block-wise FP8 (kernels/fp8_block.py): group-quantized activations, a block-scaled FP8 GEMM.
    register("fp8_block_scaled_mm", "cuda", "pagedlm.backends.cuda.kernels.fp8_block:fp8_block_scaled_mm")
    register("fused_experts", "cuda", "pagedlm.backends.cuda.kernels.fused_moe:fused_experts")
    register("fused_experts_fp8", "cuda", "pagedlm.backends.cuda.kernels.fused_moe_quant:fused_experts_fp8")
    register("fused_experts_wna16", "cuda", "pagedlm.backends.cuda.kernels.fused_moe_quant:fused_experts_wna16")
    # The batched LoRA update (kernels/lora.py): grouped shrink/expand over the step's slots.
    for op in ("lora_shrink", "lora_expand"):
        register(op, "cuda", f"pagedlm.backends.cuda.kernels.lora:{op}")
