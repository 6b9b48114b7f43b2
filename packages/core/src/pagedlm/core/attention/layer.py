"""``Attention``: the layer models use; the selected backend supplies the implementation."""

from __future__ import annotations

import torch
from torch import nn

from pagedlm.core.distributed.kv_transfer.worker_step import get_active_kv_connector
from pagedlm.core.forward_context import get_build_context, get_forward_context
from pagedlm.core.layers.rotary import PendingRotary


def _kv_scale_param() -> nn.Parameter:
    param = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def load(p: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        p.data.copy_(loaded.reshape(-1)[:1].to(torch.float32))  # a scalar or a one-element tensor

    def dummy(p: torch.Tensor, gen: torch.Generator) -> None:
        p.data.fill_(1.0)

    param.weight_loader = load  # type: ignore[attr-defined]
    param.optional_in_checkpoint = True  # type: ignore[attr-defined]
    param.dummy_init = dummy  # type: ignore[attr-defined]
    return param


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache.

    Built inside ``set_current_vllm_config`` (the model runner does this), it registers itself
    under ``prefix`` so the runner can bind its cache tensor (``self.kv_cache``) after
    allocation. With ``kv_cache_dtype="fp8"`` it holds ``k_scale`` / ``v_scale`` (``[1]`` float32)
    and hands them to the backend's impl (``impl.k_scale``, ``impl.kv_cache_dtype``).
    ``forward`` takes flat ``[T, num_heads * head_size]`` q and
    ``[T, num_kv_heads * head_size]`` k/v and returns ``[T, num_heads * head_size]``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        prefix: str,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        ctx = get_build_context()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix
        self.sliding_window = sliding_window
        self.backend = ctx.attn_backend
        self.impl = ctx.attn_backend.get_impl_cls()(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=self.num_kv_heads,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
        self.kv_cache_dtype = ctx.vllm_config.cache_config.cache_dtype
        if self.kv_cache_dtype != "auto":
            # Per-tensor scales of the FP8 cache (stored = value / scale): the checkpoint's when it has
            # them (``self_attn.k_scale``, compressed-tensors' ``k_proj.output_scale``), else 1.0.
            self.k_scale = _kv_scale_param()
            self.v_scale = _kv_scale_param()
            self.impl.kv_cache_dtype = self.kv_cache_dtype
            self.impl.k_scale, self.impl.v_scale = self.k_scale, self.v_scale
        #: bound by the model runner once the KV cache is allocated
        self.kv_cache: torch.Tensor = torch.empty(0)
        #: the KV-cache group whose block table this layer reads (set by the model runner)
        self.kv_cache_group_id = 0
        if prefix in ctx.attention_layers:
            raise ValueError(f"two attention layers share the prefix {prefix!r}")
        ctx.attention_layers[prefix] = self

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                rotary: PendingRotary | None = None) -> torch.Tensor:
        """With ``rotary``, ``query`` and ``key`` are not rotated yet: a backend that
        ``fuses_rotary`` rotates them while writing K/V, else the rotary is applied here first."""
        num_tokens = query.shape[0]
        metadata = get_forward_context().attn_metadata
        if type(metadata) is list:  # one metadata per KV-cache group
            metadata = metadata[self.kv_cache_group_id]
        fused = {}
        if rotary is not None:
            if metadata is not None and self.impl.fuses_rotary and rotary.fusable:
                fused = {"rotary": rotary}
            else:
                query, key = rotary.apply(query, key)
        connector = get_active_kv_connector()
        if connector is not None:  # KV transfer (kv_transfer_config): layer-by-layer loads
            connector.wait_for_layer_load(self.layer_name)
        out = self.impl.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
            **fused,
        )
        if connector is not None:
            connector.save_kv_layer(self.layer_name, self.kv_cache, metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_size)
