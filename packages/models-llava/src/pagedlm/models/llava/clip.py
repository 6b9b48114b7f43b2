"""CLIP's vision transformer (LLaVA's vision tower): ``pixel_values [B, 3, H, W] -> [B, 1 + P, hidden]``.

Images are independent sequences of equal length, so attention is plain bidirectional SDPA over
``[B, heads, 1 + P, head_dim]`` (no KV cache, no paged metadata). Weights are replicated on every
tensor-parallel rank (the tower is small next to the language model). Only the layers up to the
one whose output the model reads are built (LLaVA reads the second to last).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vision_activation(name: str):
    """HF's activation names used by CLIP/LLaVA configs -> a function."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"vision activation {name!r} is not supported (quick_gelu, gelu, gelu_pytorch_tanh)")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.patch_size = int(config.patch_size)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, kernel_size=self.patch_size,
                                         stride=self.patch_size, bias=False)
        num_positions = (int(config.image_size) // self.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W] -> [B, 1 + P, hidden]`` (class token first)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings = torch.cat([cls, patches], dim=1)
        if embeddings.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels give {embeddings.shape[1] - 1} "
                             f"patches; this tower takes {self.position_embedding.num_embeddings - 1}")
        return embeddings + self.position_embedding.weight[None]


class CLIPAttention(nn.Module):
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
        """``[B, S, hidden] -> [B, S, hidden]``, every position attending to every other."""
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = vision_activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = CLIPMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Embeddings, ``pre_layrnorm`` (HF's spelling) and the first ``num_layers`` encoder layers;
    ``forward`` returns the hidden states after each of them (index 0: before the first layer),
    as HF's ``hidden_states``."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states
