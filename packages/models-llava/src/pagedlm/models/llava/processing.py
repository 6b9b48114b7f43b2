"""LLaVA-1.5's multimodal input processor: ``<image>`` placeholders, one run per image."""

from __future__ import annotations

from typing import Any

from pagedlm.core.multimodal.processing import BaseMultiModalProcessor


class LlavaMultiModalProcessor(BaseMultiModalProcessor):
    placeholder_str = {"image": "<image>"}

    @property
    def image_token_id(self) -> int:
        cfg = self.hf_config
        token = getattr(cfg, "image_token_id", None)
        return int(token if token is not None else cfg.image_token_index)

    def num_image_tokens(self) -> int:
        """One per patch of the (resized, cropped) image, plus CLIP's class token when the
        ``"full"`` feature strategy keeps it (HF's ``LlavaProcessor`` expansion)."""
        vision = self.hf_config.vision_config
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        return patches + (1 if self.hf_config.vision_feature_select_strategy == "full" else 0)

    def default_image_processor(self) -> Any:
        """CLIP's preprocessing at the vision tower's size (what llava-1.5's checkpoints ship)."""
        from transformers import CLIPImageProcessor

        size = int(self.hf_config.vision_config.image_size)
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
