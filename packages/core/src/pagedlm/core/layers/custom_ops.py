"""Device-specific replacements for small ops (an extension point for platforms).

Core layers and the sampler compute in plain torch; that is the reference. A platform may
register a faster implementation of an op for its device type (pagedlm-backend-cuda registers
fused Triton kernels for ``"cuda"``); core then calls it for tensors on that device and keeps the
torch path for every other device. A replacement must keep the contract written next to each
name below, including dtype rounding (HF-parity tests compare greedy tokens).

- ``"rms_norm"``: ``fn(x [..., N], weight [N], eps) -> [..., N]``
- ``"fused_add_rms_norm"``: ``fn(x, residual, weight, eps) -> (norm(x + residual), x + residual)``
- ``"rotary_embedding"``: ``fn(positions [T], query [T, Hq*D], key [T, Hk*D] | None, cos_sin_cache
  [max_pos, rotary_dim] float32, head_size, rotary_dim, is_neox_style) -> (query, key)``, new tensors
- ``"silu_and_mul"``: ``fn(x [..., 2I]) -> [..., I]``
- ``"qk_norm_rotary_embedding"``: ``fn(positions, query, key, q_weight [D], k_weight [D], eps,
  cos_sin_cache, head_size, rotary_dim, is_neox_style) -> (query, key)``: every ``D``-sized head
  of query and key RMS-normalised (``rms_norm`` of each head with its weight), then rotated
  (``rotary_embedding``); new tensors
- ``"gumbel_sample"``: ``fn(logits [B, V], temperature [B] float32, seed, offset) -> [B] int64``:
  row ``i`` drawn from ``softmax(logits[i] / temperature[i])`` (logits in any float dtype, divided
  in float32; ``-inf`` entries never drawn unless the whole row is ``-inf``) with noise that is a
  function of ``(seed, offset)`` alone (equal ints, equal draws; no host sync); rows with
  temperature below 1e-5 (greedy, 0.0 in ``SamplingMetadata``) get the argmax (lowest index wins
  ties), as ``torch.argmax``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OP_NAMES", "clear_op_impls", "get_op_impl", "register_op_impl"]

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "qk_norm_rotary_embedding",
    "gumbel_sample",
)

_IMPLS: dict[tuple[str, str], Callable[..., Any]] = {}


def register_op_impl(name: str, device_type: str, fn: Callable[..., Any]) -> None:
    """Use ``fn`` for op ``name`` on tensors whose ``device.type`` is ``device_type``."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown layer op {name!r}; known: {', '.join(OP_NAMES)}")
    _IMPLS[(name, device_type)] = fn


def get_op_impl(name: str, device_type: str) -> Callable[..., Any] | None:
    """The registered replacement, or None (use the torch reference)."""
    return _IMPLS.get((name, device_type))


def clear_op_impls(device_type: str | None = None) -> None:
    """Forget registered replacements (all, or those of one device type); for tests."""
    for key in [k for k in _IMPLS if device_type is None or k[1] == device_type]:
        del _IMPLS[key]
