"""Rotary position embeddings with the scaling variants HF transformers defines.

:func:`get_rope` reads the base frequency and scaling from an HF text config in either layout:

- transformers >= 5: ``config.rope_parameters = {"rope_type": ..., "rope_theta": ..., "factor": ...}``
  (possibly one such dict per layer type, selected with ``layer_type=``);
- older: ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict (``"rope_type"``
  or the older key ``"type"``).

Supported ``rope_type``: ``default``, ``linear``, ``llama3``, ``dynamic``, ``yarn``.

The cos/sin table for every position is computed once, in float32 on the CPU (so every device
sees identical values), and indexed by position in :meth:`RotaryEmbedding.forward`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedlm.core.layers.custom_ops import bound_op
from pagedlm.core.layers.layernorm import GemmaRMSNorm, RMSNorm
from pagedlm.core.platforms.interface import HOST

__all__ = ["PendingRotary", "RotaryEmbedding", "get_rope", "rope_parameters", "rotary_reference"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
            is_neox_style: bool) -> torch.Tensor:
    """``x [T, heads * head_size]``, ``cos``/``sin [T, 1, rotary_dim / 2]`` -> same shape as x."""
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_size)
    rot = x[..., :rotary_dim]
    if is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    # HF writes q*cos + rotate_half(q)*sin; with rotate_half = [-x2, x1] this is the same
    # sequence of rounded float ops, so bf16 results agree bit for bit.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        out = torch.cat((o1, o2), dim=-1)
    else:
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    if rotary_dim < head_size:
        out = torch.cat((out, x[..., rotary_dim:]), dim=-1)
    return out.reshape(num_tokens, -1)


def rotary_reference(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``rotary_embedding`` op in torch (its contract in layers.custom_ops): what
    :class:`RotaryEmbedding` runs when the platform registered no kernel."""
    cos_sin = cos_sin_cache.index_select(0, positions.flatten())
    cos, sin = cos_sin.to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
    q = _rotate(query, cos, sin, head_size, rotary_dim, is_neox_style)
    k = _rotate(key, cos, sin, head_size, rotary_dim, is_neox_style) if key is not None else None
    return q, k


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of every head by a position-dependent angle.

    ``is_neox_style=True`` pairs feature ``i`` with ``i + rotary_dim/2`` (HF's ``rotate_half``);
    ``False`` pairs ``2i`` with ``2i + 1`` (GPT-J). Features past ``rotary_dim`` pass through.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        is_neox_style: bool = True,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and <= head_size={head_size}")
        if inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"inv_freq has shape {tuple(inv_freq.shape)}, expected ({rotary_dim // 2},)")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        self.attention_scaling = attention_scaling
        # NOTE: float32 regardless of the model dtype; forward casts the gathered rows to the
        # activation dtype, exactly where HF casts its cos/sin.
        positions = torch.arange(max_position, dtype=torch.float32, device=HOST)
        freqs = positions[:, None] * inv_freq.to(device=HOST, dtype=torch.float32)[None, :]
        cos = freqs.cos() * attention_scaling
        sin = freqs.sin() * attention_scaling
        #: ``[max_position, rotary_dim]``: cos in the first half of the columns, sin in the second
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", torch.cat([cos, sin], dim=-1).to(torch.get_default_device()), persistent=False
        )
        # the platform's kernels, if it registered them (layers.custom_ops); bound once, at build
        self._rotary_op = bound_op("rotary_embedding")
        self._qk_norm_rotary_op = bound_op("qk_norm_rotary_embedding")
        self._gemma_qk_norm_rotary_op = bound_op("gemma_qk_norm_rotary_embedding")

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate query and key.

        Args:
            positions: ``[T]`` int64, the position of each flat token in its sequence
            query: ``[T, num_heads * head_size]``
            key: ``[T, num_kv_heads * head_size]`` or None
        Returns:
            ``(query, key)`` rotated, new tensors of the same shapes and dtypes.
        """
        if self._rotary_op is not None:
            return self._rotary_op(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim,
                                   self.is_neox_style)
        return rotary_reference(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim,
                                self.is_neox_style)

    def forward_qk_norm(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS-normalise every head of query and key (``q_norm``/``k_norm``: ``RMSNorm`` or
        ``GemmaRMSNorm`` over ``head_size``), then rotate them, as Qwen3 and Gemma 3 do: ``[T, H *
        D]`` and ``[T, Hkv * D]`` in, new tensors out. A platform may do both in one kernel
        (``qk_norm_rotary_embedding``, ``gemma_qk_norm_rotary_embedding``)."""
        eps = q_norm.variance_epsilon
        fused = self._gemma_qk_norm_rotary_op if isinstance(q_norm, GemmaRMSNorm) else self._qk_norm_rotary_op
        if fused is not None and eps == k_norm.variance_epsilon and type(q_norm) is type(k_norm):
            return fused(positions, query, key, q_norm.weight, k_norm.weight, eps, self.cos_sin_cache, self.head_size,
                         self.rotary_dim, self.is_neox_style)
        num_tokens = query.shape[0]
        query = q_norm(query.reshape(num_tokens, -1, self.head_size)).reshape(num_tokens, -1)
        key = k_norm(key.reshape(num_tokens, -1, self.head_size)).reshape(num_tokens, -1)
        q, k = self.forward(positions, query, key)
        assert k is not None
        return q, k

    def pending(self, positions: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> PendingRotary:
        """This rotary for ``positions`` (after the per-head ``q_norm``/``k_norm``), to pass to
        ``Attention.forward(..., rotary=)`` instead of applying it here."""
        return PendingRotary(self, positions, q_norm, k_norm)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"neox={self.is_neox_style}, attention_scaling={self.attention_scaling}"
        )


class PendingRotary(NamedTuple):
    """A rotary embedding bound to one step's positions (and Qwen3's per-head q/k norms), given to
    :class:`~pagedlm.core.attention.layer.Attention` unapplied: a backend whose impl declares
    ``fuses_rotary`` rotates the query and key and writes the key and value into its KV cache in
    one kernel (the rotated key is never materialised); otherwise the layer calls :meth:`apply`.

    ``attn(q, k, v, rotary=self.rotary_emb.pending(positions))`` is what
    ``q, k = self.rotary_emb(positions, q, k); attn(q, k, v)`` computes."""

    rotary: RotaryEmbedding
    positions: torch.Tensor
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused path: ``(query, key)`` normalised (with q/k norms) and rotated."""
        if self.q_norm is None:
            q, k = self.rotary(self.positions, query, key)
            assert k is not None
            return q, k
        return self.rotary.forward_qk_norm(self.positions, query, key, self.q_norm, self.k_norm)

    @property
    def fusable(self) -> bool:
        """Whether a backend's fused kernel computes :meth:`apply` exactly: the plain rotary of
        this module (no subclass), with no q/k norm or with two ``RMSNorm`` of one ``eps``
        (Gemma's norms round differently)."""
        if type(self.rotary) is not RotaryEmbedding:
            return False
        if self.q_norm is None:
            return self.k_norm is None
        return (type(self.q_norm) is RMSNorm and type(self.k_norm) is RMSNorm
                and self.q_norm.variance_epsilon == self.k_norm.variance_epsilon)

    @property
    def qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(q_norm.weight, k_norm.weight)`` (``[head_size]``), or None without q/k norms."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight

    @property
    def eps(self) -> float:
        """The q/k norms' epsilon (0.0 without them)."""
        return float(self.q_norm.variance_epsilon) if self.q_norm is not None else 0.0


# -- reading the config ----------------------------------------------------------------------------


def rope_parameters(hf_text_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a config as one flat dict with at least ``rope_type``, ``rope_theta``
    and ``partial_rotary_factor``, whichever layout the config uses."""
    cfg = hf_text_config
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif "rope_theta" not in params and "rope_type" not in params and any(
            isinstance(v, dict) for v in params.values()
        ):
            raise ValueError(
                f"rope_parameters has one entry per layer type ({sorted(params)}); pass layer_type="
            )
        out = dict(params)
        out.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    else:
        out = dict(getattr(cfg, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(cfg, "rope_theta", None) or 10000.0
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = getattr(cfg, "partial_rotary_factor", None) or 1.0
    return out


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """``[rotary_dim / 2]`` float32: ``base ** (-2i / rotary_dim)``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=HOST).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(base: float, rotary_dim: int, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""
    inv_freq = _default_inv_freq(base, rotary_dim)
    factor = float(p["factor"])
    low_ff = float(p["low_freq_factor"])
    high_ff = float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > old_ctx / low_ff
    short_wave = wavelen < old_ctx / high_ff
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(long_wave, inv_freq / factor, inv_freq)
    return torch.where(~long_wave & ~short_wave, blended, out)


def _yarn_inv_freq(base: float, rotary_dim: int, max_position: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, and scale attention."""
    orig = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_position / orig
    factor = float(factor)

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the feature index whose wavelength completes num_rotations turns over orig positions
        return rotary_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    max_position: int,
    hf_text_config: Any,
    is_neox_style: bool = True,
    *,
    layer_type: str | None = None,
) -> RotaryEmbedding:
    """The rotary embedding an HF config describes, for heads of ``head_size``.

    ``max_position`` bounds the positions (the cache holds that many rows; pass the config's
    ``max_position_embeddings``). Identical requests return the same module, so all layers
    of a model share one cos/sin table.
    """
    p = rope_parameters(hf_text_config, layer_type)
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    rotary_dim = int(head_size * float(p["partial_rotary_factor"]))
    key = (
        head_size,
        rotary_dim,
        max_position,
        is_neox_style,
        str(torch.get_default_device()),
        # NOTE: a module built for another platform's ops must not be shared (layers.custom_ops)
        bound_op("rotary_embedding"),
        bound_op("qk_norm_rotary_embedding"),
        tuple(sorted((k, repr(v)) for k, v in p.items())),
    )
    cached = _ROPE_CACHE.get(key)
    if cached is not None:
        return cached

    scaling = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(base, rotary_dim)
    elif rope_type == "linear":
        inv_freq = _default_inv_freq(base, rotary_dim) / float(p["factor"])
    elif rope_type == "dynamic":
        # NOTE: HF's dynamic NTK rescales the base only once a sequence grows past
        # max_position_embeddings; below that it is the default rope. max_model_len never
        # exceeds max_position_embeddings, so positions here never reach the rescaled regime.
        inv_freq = _default_inv_freq(base, rotary_dim)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(base, rotary_dim, p)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn_inv_freq(base, rotary_dim, max_position, p)
    else:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported: default, linear, dynamic, llama3, yarn"
        )
    rope = RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, is_neox_style, scaling)
    _ROPE_CACHE[key] = rope
    return rope
