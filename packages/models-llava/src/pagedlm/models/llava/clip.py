"""CLIP's vision transformer (LLaVA's vision tower): ``pixel_values [B, 3, H, W] -> [B, 1 + P, hidden]``.

The encoder layers are core's shared ViT blocks (``pagedlm.core.layers.vision``: SDPA attention,
replicated weights). Only the layers up to the one whose output the model reads are built
(LLaVA reads the second to last).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedlm.core.layers.vision import VisionEncoder


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


class CLIPVisionTower(nn.Module):
    """Embeddings, ``pre_layrnorm`` (HF's spelling) and the first ``num_layers`` encoder layers;
    ``forward`` returns the hidden states after each of them (index 0: before the first layer),
    as HF's ``hidden_states``."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states
