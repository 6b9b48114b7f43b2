"""The FP8 KV cache on CUDA: writing keys and values as float8_e4m3fn with per-tensor scales.

``kv_cache_dtype="fp8"`` stores ``value / scale`` clamped to +-448 in float8_e4m3fn; the layer's
``k_scale`` / ``v_scale`` (``[1]`` float32, from the checkpoint or 1.0) are on the attention impl
(``impl.k_scale``, ``impl.v_scale``, ``impl.kv_cache_dtype``). The CPU backend implements it
fully (pagedlm.backends.cpu.attention) and is the reference.

The ``triton`` backend writes this step's K/V with :func:`write_kv_fp8` and its attention
kernel rescales each loaded key and value tile to the query's dtype (``FP8_KV``); softmax and
accumulation are unchanged.

``tests/cuda/test_quant_kernels.py`` checks :func:`write_kv_fp8` against the CPU backend's write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait

__all__ = ["write_kv_fp8"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def _write_kv_fp8_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    FMAX: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per token: its ``[Hkv, D]`` key and value divided by their scales, clamped and
    stored as float8 in the cache slot (negative slots are padding)."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, HEAD_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
        dst = slot * (NUM_KV_HEADS * HEAD_SIZE) + h * HEAD_SIZE + d
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask).to(tl.float32) / k_scale
        k = tl.minimum(tl.maximum(k, -FMAX), FMAX)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask).to(tl.float32) / v_scale
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_fp8(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """``key``/``value`` ``[T, Hkv, D]`` into float8 caches viewed as ``[num_slots, Hkv, D]`` (any
    layout whose slot ``s`` starts at ``s * Hkv * D``) at ``slot_mapping [T]``."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    launch(
        _write_kv_fp8_kernel, (num_tokens,),
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        FMAX=FP8_MAX, **pdl_options(key.device),
    )
