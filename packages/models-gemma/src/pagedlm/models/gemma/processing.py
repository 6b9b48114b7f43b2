"""Gemma 3's multimodal input processor: ``<start_of_image>`` placeholders, expanded by HF's
``Gemma3Processor`` into ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens +
``<end_of_image>\\n\\n``; the soft tokens attend to each other in both directions."""

from __future__ import annotations

from typing import Any

from pagedlm.core.multimodal.processing import BaseMultiModalProcessor


class Gemma3MultiModalProcessor(BaseMultiModalProcessor):
    placeholder_str = {"image": "<start_of_image>"}
    bidirectional_item_attention = True

    @property
    def image_token_id(self) -> int:
        return int(self.hf_config.image_token_index)

    @property
    def placeholder_token_id(self) -> int:
        return int(self.hf_config.boi_token_index)

    def num_image_tokens(self) -> int:
        return int(self.hf_config.mm_tokens_per_image)

    def expanded_placeholder_ids(self) -> list[int]:
        """HF's full image sequence, tokenized (its newlines depend on the tokenizer)."""
        processor = self.hf_processor
        return list(processor.tokenizer(processor.full_image_sequence, add_special_tokens=False).input_ids)

    def hf_images(self, images: list[Any]) -> Any:
        return [images]  # Gemma3Processor takes a list of images per prompt

    def default_image_processor(self) -> Any:
        from transformers import Gemma3ImageProcessor

        size = int(self.hf_config.vision_config.image_size)
        return Gemma3ImageProcessor(size={"height": size, "width": size})
