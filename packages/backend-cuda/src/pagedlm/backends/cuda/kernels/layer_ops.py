"""Fused Triton versions of the small layer ops core computes in plain torch.

In eager torch an RMSNorm is ~8 kernels, a rotary embedding ~15 and SiLU-and-mul 2; one decoder
layer of a 0.6B model then launches ~60 tiny memory-bound kernels, which dominates a decode step
even inside a CUDA graph. Each op here is one kernel.

Every op repeats the rounding steps of core's torch version (= HF transformers') in the same
order: bf16/fp16 results are rounded where torch rounds them (sum of residual and input, the
normalised value before the weight multiply, each rotary product), so greedy outputs keep
matching HF. Registered for platform ``cuda`` by the backend's ``pagedlm_register_ops``
(:mod:`pagedlm.backends.cuda.plugin`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlm.backends.cuda.kernels.launch import launch, pdl_options, pdl_wait

#: float8_e4m3fn's largest value, the clamp of an FP8 KV cache (as kv_cache_fp8.FP8_MAX)
_FP8_MAX = tl.constexpr(float(torch.finfo(torch.float8_e4m3fn).max))

__all__ = [
    "fused_add_rms_norm",
    "norm_launch_shape",
    "qk_norm_rotary_embedding",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_write_kv",
    "silu_and_mul",
]


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, inner, stride_x0, stride_x1, stride_r, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row per program. Row ``r`` of ``x`` is at ``(r // inner) * stride_x0 + (r % inner) *
    stride_x1`` (so a ``[T, H, D]`` view of a fused projection needs no copy); outputs are
    contiguous ``[rows, N]``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # the weight is constant: read before the wait, its latency overlaps the previous kernel's tail
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    x_off = (row // inner) * stride_x0 + (row % inner) * stride_x1
    x = tl.load(x_ptr + x_off + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like torch's add
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    normed = (h * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int]:
    """``(rows, inner, stride0, stride1)`` addressing every last-dim row of ``x`` (up to 3-D)."""
    if x.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    flat = x.reshape(-1, x.shape[-1])
    return flat.shape[0], 1, flat.stride(0), 0


def norm_launch_shape(n: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of a program normalising one row of ``n`` values.

    NOTE: the FP8-quantizing norm (:mod:`.norm_quant`) launches with the same shape, so its sum of
    squares is reduced in the same order and its normalised values are this kernel's bits."""
    block = triton.next_power_of_2(n)
    return block, max(1, min(8, block // 256))


def _launch_norm(x, residual, weight, eps):
    n = x.shape[-1]
    rows, inner, s0, s1 = _rows_view(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if residual is not None:
        residual = residual.reshape(rows, n)
    if rows:
        block, num_warps = norm_launch_shape(n)
        launch(
            _rms_norm_kernel, (rows,),
            x if x.dim() <= 3 else x.reshape(-1, n), residual if residual is not None else x, weight, out, summed,
            inner, s0, s1, residual.stride(0) if residual is not None else 0, float(eps),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps, **pdl_options(x.device),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., N]`` (last dim contiguous) -> normalised ``[..., N]`` contiguous."""
    return _launch_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, both ``[..., N]``, in one pass."""
    return _launch_norm(x, residual, weight, eps)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, row_in, row_out, cos, sin, heads, w_ptr, eps, scale_ptr,
    HEAD_SIZE: tl.constexpr, ROT_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, NEOX: tl.constexpr, QK_NORM: tl.constexpr, FP8_OUT: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < heads) & (i < ROT_DIM // 2)
    if NEOX:  # pairs (i, i + rot/2)
        first = h * HEAD_SIZE + i
        second = first + ROT_DIM // 2
    else:  # GPT-J pairs (2i, 2i + 1)
        first = h * HEAD_SIZE + 2 * i
        second = first + 1
    x1 = tl.load(x_ptr + row_in + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row_in + second, mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    if PASS_PAD > 0:
        j = tl.arange(0, PASS_PAD)[None, :]
        pmask = (h < heads) & (j < HEAD_SIZE - ROT_DIM)
        rest = h * HEAD_SIZE + ROT_DIM + j
        xp = tl.load(x_ptr + row_in + rest, mask=pmask, other=0.0)
    if QK_NORM:
        # Per-head RMSNorm first, rounded as _rms_norm_kernel (and HF) round: normalise in
        # float32, cast to the dtype, multiply by the weight, cast again.
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if PASS_PAD > 0:
            xpf = xp.to(tl.float32)
            sum_sq += tl.sum(xpf * xpf, 1)
        inv = tl.math.rsqrt(sum_sq / HEAD_SIZE + eps)[:, None]
        w1 = tl.load(w_ptr + (first - h * HEAD_SIZE), mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + (second - h * HEAD_SIZE), mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if PASS_PAD > 0:
            wp = tl.load(w_ptr + ROT_DIM + j, mask=j < HEAD_SIZE - ROT_DIM, other=0.0).to(tl.float32)
            xp = (wp * (xpf * inv).to(dt).to(tl.float32)).to(dt)
    # torch computes x1*cos - x2*sin in the activation dtype: round each product, then the sum
    o1 = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    if FP8_OUT:  # into an FP8 KV cache: write_kv_fp8's numerics on the rotated values
        s = tl.load(scale_ptr)
        o1 = _fp8_cache_value(o1, s)
        o2 = _fp8_cache_value(o2, s)
        if PASS_PAD > 0:
            xp = _fp8_cache_value(xp, s)
    tl.store(out_ptr + row_out + first, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row_out + second, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if PASS_PAD > 0:  # features past rotary_dim pass through
        tl.store(out_ptr + row_out + rest, xp.to(out_ptr.dtype.element_ty), mask=pmask)


@triton.jit
def _fp8_cache_value(x, scale):
    x = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(x, -_FP8_MAX), _FP8_MAX)


# NOTE: num_slots is a step's token count: specialised on its value (== 1, divisible by 16), a
# step of another count would compile a variant after start-up (tests/cuda/test_kernel_precompile.py)
@triton.jit(do_not_specialize=["num_slots"])
def _rotary_kernel(
    pos_ptr, cos_sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, stride_q, stride_k, num_q_heads, num_k_heads,
    q_w_ptr, k_w_ptr, eps, v_ptr, stride_v, v_out_ptr, slot_ptr, num_slots, k_scale_ptr, v_scale_ptr,
    HEAD_SIZE: tl.constexpr, ROT_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr, NEOX: tl.constexpr, HAS_KEY: tl.constexpr, QK_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr, FP8_KV: tl.constexpr, HEAD_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One token per program: rotate all its query heads and key heads (after a per-head
    RMSNorm with ``QK_NORM``). With ``WRITE_KV`` the rotated key and the value go straight into
    the cache slot of ``slot_ptr`` (as :func:`.paged_attention.write_kv_cache`, or
    :func:`.kv_cache_fp8.write_kv_fp8` with ``FP8_KV``) and nothing else is written for them;
    tokens past ``num_slots`` or at a negative slot store no key or value."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cmask = i < ROT_DIM // 2
    dt = q_ptr.dtype.element_ty
    # the cos/sin table is float32; torch casts the gathered rows to the activation dtype first
    cos = tl.load(cos_sin_ptr + pos * ROT_DIM + i, mask=cmask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * ROT_DIM + ROT_DIM // 2 + i, mask=cmask, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token * stride_q, token * num_q_heads * HEAD_SIZE, cos, sin, num_q_heads,
                  q_w_ptr, eps, k_scale_ptr, HEAD_SIZE, ROT_DIM, HEADS_PAD, HALF_PAD, PASS_PAD, NEOX, QK_NORM, False)
    if WRITE_KV:
        slot = tl.load(slot_ptr + token, mask=token < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            row_kv = slot * num_k_heads * HEAD_SIZE
            _rotate_heads(k_ptr, k_out_ptr, token * stride_k, row_kv, cos, sin, num_k_heads, k_w_ptr, eps,
                          k_scale_ptr, HEAD_SIZE, ROT_DIM, HEADS_PAD, HALF_PAD, PASS_PAD, NEOX, QK_NORM, FP8_KV)
            h = tl.arange(0, HEADS_PAD)[:, None]
            d = tl.arange(0, HEAD_PAD)[None, :]
            vmask = (h < num_k_heads) & (d < HEAD_SIZE)
            v = tl.load(v_ptr + token * stride_v + h * HEAD_SIZE + d, mask=vmask)
            if FP8_KV:
                v = _fp8_cache_value(v, tl.load(v_scale_ptr))
            tl.store(v_out_ptr + row_kv + h * HEAD_SIZE + d, v.to(v_out_ptr.dtype.element_ty), mask=vmask)
    elif HAS_KEY:
        _rotate_heads(k_ptr, k_out_ptr, token * stride_k, token * num_k_heads * HEAD_SIZE, cos, sin, num_k_heads,
                      k_w_ptr, eps, k_scale_ptr, HEAD_SIZE, ROT_DIM, HEADS_PAD, HALF_PAD, PASS_PAD, NEOX, QK_NORM,
                      False)


def _launch_rotary(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style, qk_norm_weights,
                   eps, q_out, k_out, value=None, value_cache=None, slot_mapping=None, kv_scales=None):
    """One launch of :func:`_rotary_kernel`; with ``value`` (and its cache and slots) ``k_out`` is
    the key cache and the kernel writes K/V (``WRITE_KV``). Unused pointers get stand-ins."""
    num_q = query.shape[1] // head_size
    num_k = key.shape[1] // head_size if key is not None else 0
    assert query.stride(-1) == 1 and (key is None or key.stride(-1) == 1)
    assert value is None or value.stride(-1) == 1
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    norm_weights = qk_norm_weights if qk_norm_weights is not None else (query, query)
    write_kv = value is not None
    slots = slot_mapping if write_kv else positions
    k_scale, v_scale = kv_scales if kv_scales is not None else (cache, cache)
    launch(
        _rotary_kernel, (query.shape[0],),
        positions.reshape(-1), cache.contiguous(), query, key if key is not None else query, q_out,
        k_out if k_out is not None else q_out, query.stride(0), key.stride(0) if key is not None else 0,
        num_q, num_k, norm_weights[0], norm_weights[1], float(eps),
        value if write_kv else query, value.stride(0) if write_kv else 0, value_cache if write_kv else query,
        slots, slots.shape[0], k_scale, v_scale,
        HEAD_SIZE=head_size, ROT_DIM=rotary_dim, HEADS_PAD=triton.next_power_of_2(max(num_q, num_k)),
        HALF_PAD=triton.next_power_of_2(max(1, rotary_dim // 2)),
        PASS_PAD=triton.next_power_of_2(head_size - rotary_dim) if head_size > rotary_dim else 0,
        NEOX=is_neox_style, HAS_KEY=key is not None, QK_NORM=qk_norm_weights is not None,
        WRITE_KV=write_kv, FP8_KV=kv_scales is not None, HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        num_warps=4, **pdl_options(query.device),
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    qk_norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary embedding of flat tokens; same contract as ``RotaryEmbedding.forward``. With
    ``qk_norm_weights`` (query and key norm weights), each head is RMS-normalised first.

    Args:
        positions: ``[T]`` int64
        query: ``[T, Hq * head_size]`` (row stride free, last dim contiguous)
        key: ``[T, Hk * head_size]`` or None
        cos_sin_cache: ``[max_position, rotary_dim]`` float32, cos then sin
    Returns:
        new contiguous ``(query, key)`` of the same shapes
    """
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device) if key is not None else None
    if query.shape[0]:
        _launch_rotary(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style, qk_norm_weights,
                       eps, q_out, k_out)
    return q_out, k_out


def rotary_embedding_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`rotary_embedding`, then the K/V-cache write of the rotated key and the value, in one
    launch: the rotated key is never materialised.

    Args:
        query: ``[T, Hq * D]``; key, value: ``[T, Hk * D]`` (row strides free, last dim contiguous)
        key_cache, value_cache: ``[num_blocks, block_size, Hk, D]`` contiguous (slot ``s`` at
            ``s * Hk * D``), in the model dtype, or float8_e4m3fn with ``kv_scales`` (``k_scale``,
            ``v_scale``: ``[1]`` float32; stored = value / scale clamped to +-448)
        slot_mapping: ``[T0]`` int64, ``T0 <= T``: the cache slot of each of the first ``T0``
            tokens; negative slots and later tokens store nothing
    Returns:
        the rotated query, a new contiguous ``[T, Hq * D]`` tensor
    """
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0]:
        _launch_rotary(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style, qk_norm_weights,
                       eps, q_out, key_cache, value=value, value_cache=value_cache, slot_mapping=slot_mapping,
                       kv_scales=kv_scales)
    return q_out


def qk_norm_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of query and key (weights ``[head_size]``), then rotary, in one launch:
    the contract of ``RotaryEmbedding.forward_qk_norm`` (Qwen3's attention)."""
    q, k = rotary_embedding(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style,
                            qk_norm_weights=(q_weight, k_weight), eps=eps)
    assert k is not None
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu rounds to the dtype first
    tl.store(out_ptr + token * inter + cols, (act * up).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]`` as ``[T, I]``."""
    if x.dim() != 2:
        return silu_and_mul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], x.shape[-1] // 2)
    num_tokens, width = x.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens:
        assert x.stride(-1) == 1
        block = min(1024, triton.next_power_of_2(inter))
        grid = (num_tokens, triton.cdiv(inter, block))
        launch(_silu_and_mul_kernel, grid, x, out, x.stride(0), inter, BLOCK=block, num_warps=4,
               **pdl_options(x.device))
    return out
