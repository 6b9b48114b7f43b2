"""Vision-transformer blocks the vision towers of multimodal models share (CLIP, SigLIP).

Images are independent sequences of equal length, so attention is plain bidirectional SDPA over
``[B, heads, S, head_dim]``: no KV cache, no paged metadata, every platform. The layers are plain
``torch.nn`` modules, replicated on every tensor-parallel rank (a tower is small next to the
language model); their parameter names are HF's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's activation names in vision and projector configs -> a function."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"vision activation {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")


class VisionAttention(nn.Module):
    """``[B, S, hidden] -> [B, S, hidden]``, every position attending to every other."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = int(config.num_attention_heads)
        self.head_dim = hidden // self.num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = vision_activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))`` (CLIP's and SigLIP's)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """``num_layers`` encoder layers under HF's name ``encoder.layers``."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))
