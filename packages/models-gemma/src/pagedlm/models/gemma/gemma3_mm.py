"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): SigLIP -> average-pool projector ->
the Gemma 3 language model of :mod:`pagedlm.models.gemma.gemma3`.

An image is ``mm_tokens_per_image`` soft tokens (256 in the published models) between
``<start_of_image>`` and ``<end_of_image>``; its encoder output replaces the soft tokens' (scaled)
embeddings. As in HF transformers, an image's soft tokens attend to each other in both
directions (causal attention elsewhere, the sliding window still applying): the processor sets
``bidirectional_item_attention``, so the runner gives the attention backend the images' spans and
the scheduler computes each image in one step.

Checkpoint names: ``vision_tower.vision_model.*``, ``multi_modal_projector.*``,
``language_model.model.*`` (HF's saved layout) or transformers 5's in-memory
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``model.language_model.*``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedlm.core.config import VllmConfig
from pagedlm.core.layers import GemmaRMSNorm
from pagedlm.core.layers.vision import VisionEncoder
from pagedlm.core.model_loader import load_weights_by_name
from pagedlm.models.gemma.gemma3 import Gemma3ForCausalLM

_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        patch = int(config.patch_size)
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((int(config.image_size) // patch) ** 2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W] -> [B, P, hidden]`` (no class token)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} pixels give {patches.shape[1]} patches; "
                             f"this tower takes {self.position_embedding.num_embeddings}")
        return patches + self.position_embedding.weight[None]


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head: ``[B, 3, H, W] -> [B, P, hidden]``
    (the last layer's output after ``post_layernorm``, HF's ``last_hidden_state``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = VisionEncoder(config, int(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    """``[B, P, vision_hidden] -> [B, mm_tokens_per_image, text_hidden]``: average-pool the patch
    grid to ``sqrt(mm_tokens_per_image)`` per side, Gemma RMS norm, project."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.patches_per_side = int(vision.image_size) // int(vision.patch_size)
        tokens_per_side = int(round(int(config.mm_tokens_per_image) ** 0.5))
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        b, _, hidden = vision_outputs.shape
        grid = vision_outputs.transpose(1, 2).reshape(b, hidden, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(vision_outputs)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        # NOTE: the multimodal config's own flag (default: tied) decides, as in HF transformers
        if getattr(hf_config, "tie_word_embeddings", True) and not self.tied:
            self.tied = True
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.vision_tower = SiglipVisionTower(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    def embed_multimodal(self, modality: str, *, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``pixel_values [B, 3, H, W]`` -> B tensors ``[mm_tokens_per_image, text_hidden]``."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r}")
        return list(self.multi_modal_projector(self.vision_tower(pixel_values)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []

        def language(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                for old, new in _RENAMES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
                if name.startswith("vision_tower.") and name.endswith("position_ids"):
                    continue
                if name.startswith(_VISION_PARTS):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(language(weights))
        return loaded | load_weights_by_name(self, vision)
