"""Vectorized dequantization of GGUF tensor data with torch.

Each quantized ggml type stores a row as consecutive fixed-size *blocks* (32 values for the
legacy ``Q4_0``/``Q5_0``/``Q8_0`` family, 256 for the ``*_K`` "k-quants"), each block holding
packed small integers plus one or more float16 scales. A whole tensor is viewed as
``[num_blocks, type_size]`` bytes and decoded with a handful of tensor-wide operations (no Python
loop over blocks), in chunks so a 262k x 640 embedding never needs more than one small chunk of float32
scratch beyond its output.

The arithmetic follows ggml's reference dequantizers operation by operation (e.g. ``(d * sc) * q
- (dmin * m)`` in float32 for ``Q4_K``), so results are bit-identical to ``gguf.quants.dequantize``
(tests check this) and HF transformers sees the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

__all__ = ["SUPPORTED_TYPES", "dequantize"]

#: values decoded per chunk: 8 MiB of float32 scratch, small enough that the allocator reuses it
#: from chunk to chunk instead of mapping (and page-faulting) fresh memory every time
_CHUNK_VALUES = 1 << 21


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """``[N, 1]`` float32 from the little-endian float16 at byte ``start`` of each block."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: all low nibbles, then all high nibbles (ggml's order
    for 32-value blocks: byte ``j`` holds values ``j`` and ``j + n``)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 16 bytes of 4-bit values; x = (q - 8) * d
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return _half(b, 0) * q.to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | 16 bytes of 4-bit values; x = q * d + m
    q = _nibbles(b[:, 4:20]).to(torch.float32)
    return _half(b, 0) * q + _half(b, 2)


def _fifth_bits(b: torch.Tensor, start: int) -> torch.Tensor:
    """``[N, 32]`` uint8: bit ``j`` of the little-endian u32 at ``start`` (the 5th bit of value j)."""
    qh = b[:, start : start + 4]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    bits = (qh[:, :, None] >> shifts) & 1  # [N, 4 bytes, 8 bits], bit index = 8 * byte + bit
    return bits.reshape(b.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | u32 high bits | 16 bytes of low nibbles; x = (q - 16) * d
    q = (_nibbles(b[:, 6:22]) | (_fifth_bits(b, 2) << 4)).to(torch.int8) - 16
    return _half(b, 0) * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 m | u32 high bits | 16 bytes of low nibbles; x = q * d + m
    q = (_nibbles(b[:, 8:24]) | (_fifth_bits(b, 4) << 4)).to(torch.float32)
    return _half(b, 0) * q + _half(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | 32 int8 values; x = q * d
    # NOTE: in place: this is the embedding's type in most files, the biggest tensor by far
    return b[:, 2:34].contiguous().view(torch.int8).to(torch.float32).mul_(_half(b, 0))


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed in the 12 bytes ``s [N, 12]`` of Q4_K / Q5_K.

    Pairs 0-3 are the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); pairs 4-7 take their low
    4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
    """
    scale = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    minimum = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    return scale.to(torch.float32), minimum.to(torch.float32)


def _k_low_high(qs: torch.Tensor) -> torch.Tensor:
    """``[N, 128]`` bytes -> ``[N, 8, 32]``: four 32-byte chunks, each giving one sub-block of
    low nibbles then one of high nibbles (the k-quant order)."""
    chunks = qs.reshape(qs.shape[0], 4, 32)
    return torch.stack((chunks & 0x0F, chunks >> 4), dim=2).reshape(qs.shape[0], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 dmin | 12 bytes of scales | 128 bytes of nibbles (8 sub-blocks of 32)
    scale, minimum = _k4_scales(b[:, 4:16])
    q = _k_low_high(b[:, 16:144]).to(torch.float32)
    d = (_half(b, 0) * scale)[:, :, None]
    m = (_half(b, 2) * minimum)[:, :, None]
    return (d * q - m).reshape(b.shape[0], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # block: f16 d | f16 dmin | 12 bytes of scales | 32 bytes of 5th bits | 128 bytes of nibbles;
    # bit j of qh[l] is the 5th bit of value l of sub-block j.
    scale, minimum = _k4_scales(b[:, 4:16])
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    high = (b[:, None, 16:48] >> shifts) & 1  # [N, 8, 32]
    q = (_k_low_high(b[:, 48:176]) | (high << 4)).to(torch.float32)
    d = (_half(b, 0) * scale)[:, :, None]
    m = (_half(b, 2) * minimum)[:, :, None]
    return (d * q - m).reshape(b.shape[0], 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # block: 128 bytes low nibbles | 64 bytes of 2-bit highs | 16 int8 scales | f16 d.
    # Each 128-value half: quarter k takes nibbles from ql[0:32] (k = 0, 2) or ql[32:64] (k = 1, 3),
    # low nibbles for k < 2, and bits 2k..2k+1 of qh; value i uses scale i // 16.
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [N, half, first/second 32 bytes, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # [N, half, k, 32], k = 0..3
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    scale = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = (_half(b, 208) * scale)[:, :, None]
    return (d * q).reshape(n, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # block: 16 bytes of (4-bit scale | 4-bit min) | 64 bytes of 2-bit values | f16 d | f16 dmin.
    # Each 128-value half reads one 32-byte group four times at shifts 0, 2, 4, 6.
    n = b.shape[0]
    sc = b[:, 0:16]
    qs = b[:, 16:80].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
    q = ((qs >> shifts) & 3).reshape(n, 16, 16).to(torch.float32)
    d = (_half(b, 80) * (sc & 0x0F).to(torch.float32))[:, :, None]
    m = (_half(b, 82) * (sc >> 4).to(torch.float32))[:, :, None]
    return (d * q - m).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # block: 32 bytes of high-bit masks | 64 bytes of 2-bit values | 12 bytes of 6-bit scales | f16 d.
    # Value l of quarter j in half h: 2 bits at shift 2j of qs[32h + l], minus 4 unless bit 4h + j
    # of hmask[l] is set; 16 signed scales (stored + 32), scale i // 16.
    n = b.shape[0]
    s = b[:, 96:108]
    low = torch.cat((s[:, 0:8] & 0x0F, s[:, 0:8] >> 4), dim=1)  # [N, 16]
    shifts4 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)
    high = ((s[:, None, 8:12] >> shifts4[None, :, None]) & 3).reshape(n, 16)
    scale = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
    qs = b[:, 32:96].reshape(n, 2, 1, 32)
    q = ((qs >> shifts4[None, None, :, None]) & 3).to(torch.int8)  # [N, half, j, 32]
    hbit = (b[:, None, 0:32] >> torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]) & 1
    q = q - 4 * (1 - hbit.reshape(n, 2, 4, 32).to(torch.int8))
    d = (_half(b, 108) * scale)[:, :, None]
    return (d * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, 256)


# ggml type id -> (values per block, bytes per block, decoder)
_QUANTIZED: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    2: (32, 18, _q4_0),
    3: (32, 20, _q4_1),
    6: (32, 22, _q5_0),
    7: (32, 24, _q5_1),
    8: (32, 34, _q8_0),
    10: (256, 84, _q2_k),
    11: (256, 110, _q3_k),
    12: (256, 144, _q4_k),
    13: (256, 176, _q5_k),
    14: (256, 210, _q6_k),
}
_FLOATS: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}

#: ggml type names this module decodes, for error messages
SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


def is_supported(ggml_type: int) -> bool:
    return ggml_type in _QUANTIZED or ggml_type in _FLOATS


def dequantize(
    data: np.ndarray | torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode raw GGUF tensor bytes into a ``shape`` tensor of ``dtype``.

    Args:
        data: ``[nbytes]`` uint8, the tensor's bytes as stored (a view into the file is fine; it
            is never written)
        ggml_type: the ggml type id (``gguf.GGMLQuantizationType``)
        shape: torch-order shape; its last dimension runs along the blocks
        dtype: output dtype; quantized values are decoded in float32 and then cast
    Returns:
        a new contiguous tensor of ``shape`` and ``dtype``
    Raises:
        ValueError for a type not in :data:`SUPPORTED_TYPES` or a byte count that does not match
    """
    raw = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    numel = int(np.prod(shape, dtype=np.int64))
    if ggml_type in _FLOATS:
        src = _FLOATS[ggml_type]
        if raw.numel() != numel * src.itemsize:
            raise ValueError(f"{raw.numel()} bytes cannot hold {numel} values of {src}")
        return raw.view(src).reshape(shape).to(dtype, copy=True)
    if ggml_type not in _QUANTIZED:
        raise ValueError(f"ggml type {ggml_type} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    block_values, block_bytes, decode = _QUANTIZED[ggml_type]
    if numel % block_values or raw.numel() != numel // block_values * block_bytes:
        raise ValueError(
            f"{raw.numel()} bytes do not hold {numel} values in blocks of {block_values} values / {block_bytes} bytes"
        )
    blocks = raw.view(-1, block_bytes)
    out = torch.empty(numel, dtype=dtype, device=raw.device)
    chunk_blocks = max(1, _CHUNK_VALUES // block_values)
    for start in range(0, blocks.shape[0], chunk_blocks):
        chunk = blocks[start : start + chunk_blocks]
        out[start * block_values : (start + chunk.shape[0]) * block_values] = decode(chunk).reshape(-1)
    return out.reshape(shape)
