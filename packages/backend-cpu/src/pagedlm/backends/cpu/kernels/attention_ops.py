"""The ``cpu_paged`` backend's decode attention in C (``attention_decode.c``, built with the GGUF kernels)."""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedlm.backends.cpu.kernels.gguf_ops import kernel_library
from pagedlm.backends.cpu.kernels.graph import launch

__all__ = ["decode_attention"]


@functools.cache
def _kernel():
    fn = kernel_library().pagedlm_attn_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, i64,
                   ctypes.c_float, ptr, i64, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def decode_attention(query: torch.Tensor, q_rows: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, block_size: int, query_pos: torch.Tensor, sliding_window: int | None,
                     scale: float, out: torch.Tensor, out_rows: torch.Tensor,
                     new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One query token per request, attended in place on float32 caches; writes ``out`` rows.

    ``query`` ``[T, H, D]`` (rows ``q_rows`` ``[R]``), caches ``[slots, Hkv, D]`` contiguous,
    ``block_table`` ``[R, max_blocks]`` int32 (request r's context position s is in slot
    ``block_table[r, s // block_size] * block_size + s % block_size``) and ``query_pos`` ``[R]``
    int64 (the query's position; it sees the positions up to it, the last ``sliding_window`` of
    them with a window), ``out`` ``[T, H, D]`` contiguous (rows ``out_rows``). ``new = (key [T,
    Hkv, D], value, slot_mapping [T])``: the rows ``q_rows`` of this step's keys and values are
    written into the caches first (slots < 0 skipped). Every tensor float32 / int64 on the CPU
    (the block table int32, rows contiguous), each head a contiguous ``D`` floats.
    """
    q_rows, out_rows, query_pos = (t.contiguous() for t in (q_rows, out_rows, query_pos))
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        block_table = block_table.to(torch.int32).contiguous()
    num_reqs, num_heads, head_size = q_rows.shape[0], query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    k_new, v_new, slots = new if new is not None else (None, None, None)
    rc = launch(
        _kernel(), query.data_ptr(), query.stride(0), q_rows.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        k_new.data_ptr() if k_new is not None else None, k_new.stride(0) if k_new is not None else 0,
        v_new.data_ptr() if v_new is not None else None, v_new.stride(0) if v_new is not None else 0,
        slots.data_ptr() if slots is not None else None, block_table.data_ptr(), block_table.stride(0), block_size,
        query_pos.data_ptr(), sliding_window or 0, num_reqs, num_heads, num_kv_heads, head_size, scale,
        out.data_ptr(), out.stride(0), out_rows.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("decode attention: no scratch memory")
