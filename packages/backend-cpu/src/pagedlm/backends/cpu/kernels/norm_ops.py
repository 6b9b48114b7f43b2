"""The CPU platform's norm and rotary ops (``norm_rope.c``, built with the GGUF kernels).

Each op is one C call where core's torch code runs 8-12 small ops (on a decode row of 640 values
the torch dispatch of each costs more than its arithmetic: Gemma 3 270M runs 108 norms a token).
The results are bit for bit core's torch references (contracts in
``pagedlm.core.layers.custom_ops``): the C sum of squares walks the values in the order of
torch's vectorised reduction, whose width is found once, at first use, by comparing with torch
on random rows. Where no width matches (another torch, another CPU), or for inputs the kernel does
not take (float16, other devices, a weight in another dtype), the op runs core's torch code.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedlm.backends.cpu.kernels.gguf_ops import kernel_library
from pagedlm.backends.cpu.kernels.graph import launch
from pagedlm.core.layers.layernorm import gemma_rms_norm_reference, rms_norm_reference
from pagedlm.core.layers.rotary import rotary_reference
from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

__all__ = ["fused_add_rms_norm", "gemma_fused_add_rms_norm", "gemma_qk_norm_rotary_embedding", "gemma_rms_norm",
           "kernels_reproduce_torch", "qk_norm_rotary_embedding", "reduction_lanes", "rms_norm", "rotary_embedding"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_NONE, _LLAMA, _GEMMA = 0, 1, 2
_NEOX = 64
#: row lengths of the width check: short rows take torch's scalar path, long ones its levels
_CHECK_SIZES = (5, 64, 100, 256, 640, 1000, 2048, 5120)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The kernels with torch's reduction width set, or None where no width reproduces torch."""
    lib = kernel_library()
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.pagedlm_rms_norm.argtypes = [c_int, ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, c_float, c_int]
    lib.pagedlm_rms_norm.restype = c_int
    lib.pagedlm_qk_norm_rope.argtypes = [c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr,
                                         c_float, ptr, ptr, c_int]
    lib.pagedlm_qk_norm_rope.restype = c_int
    lib.pagedlm_torch_order_sum.argtypes = [ptr, i64, c_int]
    lib.pagedlm_torch_order_sum.restype = c_float
    lanes = reduction_lanes(lib)
    if lanes is None:
        logger.warning("the CPU norm kernels do not reproduce torch %s's sums here; RMSNorm and rotary run "
                       "torch's ops", torch.__version__)
        return None
    lib.pagedlm_norm_set_lanes(lanes)
    return lib


def reduction_lanes(lib: ctypes.CDLL) -> int | None:
    """The vector width (in floats) of torch's sum on this CPU: the one at which the C sum gives
    torch's result on every check row, or None."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=gen) * (10.0 ** torch.randint(-2, 3, (1,), generator=gen).item())
            for n in _CHECK_SIZES for _ in range(8)]
    for lanes in (8, 16, 4):
        if all(lib.pagedlm_torch_order_sum(r.data_ptr(), r.numel(), lanes) == r.sum().item() for r in rows):
            return lanes
    return None


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """``(rows, row stride)`` of ``x`` read as rows of its last dimension, or None when its layout
    has no single row stride."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:  # the decode and prefill shape: no view needed
        return x.shape[0], x.stride(0)
    n = x.shape[-1]
    if x.dim() == 1:
        return 1, n
    try:
        flat = x.view(-1, n)
    except RuntimeError:  # the leading dimensions do not merge (a [T, H, D] view of a fused output)
        return None
    return flat.shape[0], flat.stride(0)


def _new(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of x's shape and dtype (empty_like is the cheapest call when x is)."""
    return torch.empty_like(x) if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          style: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The kernel's result, or None where it does not take these tensors."""
    lib = _lib()
    dt = _DTYPES.get(x.dtype)
    wdt = _DTYPES.get(weight.dtype)
    if (lib is None or dt is None or wdt is None or not x.is_cpu or not weight.is_cpu or x.numel() == 0
            or (style == _LLAMA and wdt != dt) or not weight.is_contiguous()):
        return None
    if residual is not None and (residual.dtype != x.dtype or not residual.is_cpu or residual.shape != x.shape):
        return None
    xr = _rows(x)
    rr = _rows(residual) if residual is not None else None
    if xr is None or (residual is not None and rr is None):
        return None
    out = _new(x)
    summed = _new(x) if residual is not None else None
    rc = launch(
        lib.pagedlm_rms_norm,
        dt | wdt << 2 | style << 4, x.data_ptr(), xr[1], residual.data_ptr() if rr else None, rr[1] if rr else 0,
        summed.data_ptr() if summed is not None else None, out.data_ptr(), xr[0], x.shape[-1], weight.data_ptr(),
        eps, torch.get_num_threads())
    return (out, summed) if rc == 0 else None


def kernels_reproduce_torch() -> bool:
    """Whether the ops run the C kernels here (else core's torch code)."""
    return _lib() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``rms_norm`` op (HF's LlamaRMSNorm)."""
    done = _norm(x, None, weight, eps, _LLAMA)
    return done[0] if done is not None else rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``fused_add_rms_norm`` op: ``(rms_norm(x + residual), x + residual)``."""
    done = _norm(x, residual, weight, eps, _LLAMA)
    if done is not None:
        return done[0], done[1]  # type: ignore[return-value]
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``gemma_rms_norm`` op (HF's Gemma3RMSNorm, ``1 + weight`` in float32)."""
    done = _norm(x, None, weight, eps, _GEMMA)
    return done[0] if done is not None else gemma_rms_norm_reference(x, weight, eps)


def gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``gemma_fused_add_rms_norm`` op."""
    done = _norm(x, residual, weight, eps, _GEMMA)
    if done is not None:
        return done[0], done[1]  # type: ignore[return-value]
    summed = x + residual
    return gemma_rms_norm_reference(summed, weight, eps), summed


def _rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, weights: tuple | None,
          eps: float, cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int, neox: bool,
          style: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The kernel's result, or None where it does not take these tensors."""
    lib = _lib()
    dt = _DTYPES.get(query.dtype)
    if (lib is None or dt is None or not query.is_cpu or query.dim() != 2 or query.stride(-1) != 1
            or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_cpu or not cos_sin_cache.is_contiguous()):
        return None
    if key is not None and (key.dtype != query.dtype or not key.is_cpu or key.dim() != 2 or key.stride(-1) != 1):
        return None
    q_w, k_w = weights if weights is not None else (None, None)
    wdt = 0
    if weights is not None:
        wdt = _DTYPES.get(q_w.dtype, -1)
        if (k_w.dtype != q_w.dtype or wdt < 0 or (style == _LLAMA and wdt != dt) or not q_w.is_cpu
                or not k_w.is_cpu or not q_w.is_contiguous() or not k_w.is_contiguous()):
            return None
    pos = positions.reshape(-1)
    if pos.dtype != torch.int64 or not pos.is_contiguous():
        pos = pos.to(torch.int64).contiguous()
    num_tokens = query.shape[0]
    if pos.numel() != num_tokens:
        return None
    q_out = _new(query)
    k_out = _new(key) if key is not None else None
    rc = launch(
        lib.pagedlm_qk_norm_rope,
        dt | wdt << 2 | style << 4 | (_NEOX if neox else 0), pos.data_ptr(), num_tokens, cos_sin_cache.shape[0],
        query.data_ptr(), query.stride(0), query.shape[1] // head_size,
        key.data_ptr() if key is not None else None, key.stride(0) if key is not None else 0,
        key.shape[1] // head_size if key is not None else 0, head_size, rotary_dim, cos_sin_cache.data_ptr(),
        q_w.data_ptr() if q_w is not None else None, k_w.data_ptr() if k_w is not None else None, eps,
        q_out.data_ptr(), k_out.data_ptr() if k_out is not None else None, torch.get_num_threads())
    if rc == -3:
        raise IndexError(f"rotary embedding: a position is outside [0, {cos_sin_cache.shape[0]}) "
                         f"(positions {int(pos.min())}..{int(pos.max())})")
    return (q_out, k_out) if rc == 0 else None


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``rotary_embedding`` op."""
    done = _rope(positions, query, key, None, 0.0, cos_sin_cache, head_size, rotary_dim, is_neox_style, _NONE)
    if done is not None:
        return done
    return rotary_reference(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)


def _qk_norm_reference(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, head_size, rotary_dim,
                       is_neox_style, norm) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = query.shape[0]
    q = norm(query.reshape(num_tokens, -1, head_size), q_weight, eps).reshape(num_tokens, -1)
    k = norm(key.reshape(num_tokens, -1, head_size), k_weight, eps).reshape(num_tokens, -1)
    q, k_out = rotary_reference(positions, q, k, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    assert k_out is not None
    return q, k_out


def qk_norm_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                             cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                             is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``qk_norm_rotary_embedding`` op (Qwen3's per-head norms, then rotary)."""
    done = _rope(positions, query, key, (q_weight, k_weight), eps, cos_sin_cache, head_size, rotary_dim,
                 is_neox_style, _LLAMA)
    if done is not None:
        return done  # type: ignore[return-value]
    return _qk_norm_reference(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, head_size, rotary_dim,
                              is_neox_style, rms_norm_reference)


def gemma_qk_norm_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                   q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                                   cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                                   is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``gemma_qk_norm_rotary_embedding`` op (Gemma 3's per-head norms, then rotary)."""
    done = _rope(positions, query, key, (q_weight, k_weight), eps, cos_sin_cache, head_size, rotary_dim,
                 is_neox_style, _GEMMA)
    if done is not None:
        return done  # type: ignore[return-value]
    return _qk_norm_reference(positions, query, key, q_weight, k_weight, eps, cos_sin_cache, head_size, rotary_dim,
                              is_neox_style, gemma_rms_norm_reference)
