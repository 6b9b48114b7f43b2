"""The per-model input processor: images in, placeholder-expanded token ids and features out.

A model package subclasses :class:`BaseMultiModalProcessor` and registers it for its HF
architecture (``pagedlm_register_multimodal_processors``). Image preprocessing and the expansion
of a text prompt's placeholders are HF's own (``AutoProcessor`` of the checkpoint), so the ids
and pixels match what HF transformers feeds its model; a token-id prompt carries one placeholder
token per image, which is expanded here to the count HF's processor would write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pagedlm.core.multimodal.hasher import hash_image, hash_tensor
from pagedlm.core.multimodal.inputs import MultiModalFeature
from pagedlm.core.platforms import HOST

#: vLLM's default ``limit_mm_per_prompt`` for a modality the option does not name
DEFAULT_LIMIT_PER_PROMPT = 999


class BaseMultiModalProcessor:
    """Images of one model family. Subclasses set :attr:`placeholder_str` and implement
    :meth:`num_image_tokens` and :meth:`default_image_processor` from the HF config alone (the
    engine core and the workers size the encoder cache and profile without loading a processor).
    """

    #: modality -> the text a chat template's plain-string content gets per item
    placeholder_str: dict[str, str] = {"image": "<image>"}

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config
        self.hf_config = model_config.hf_config
        self._hf_processor: Any = None
        self._image_processor: Any = None
        limits = dict(getattr(model_config, "limit_mm_per_prompt", None) or {})
        unknown = sorted(set(limits) - self.supported_modalities)
        if unknown:
            raise ValueError(f"limit_mm_per_prompt names modalities {unknown} that "
                             f"{self.architecture} does not take; it takes {sorted(self.supported_modalities)}")
        for modality, limit in limits.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}]={limit!r} must be an integer >= 0")
        self.limits = {m: int(limits.get(m, DEFAULT_LIMIT_PER_PROMPT)) for m in self.supported_modalities}
        # vLLM's processor cache: image hash -> its preprocessed pixels (token-id and chat prompts;
        # a text prompt's images go through HF's processor call whole)
        budget = getattr(model_config, "mm_processor_cache_gb", 4.0)
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0:
            raise ValueError(f"mm_processor_cache_gb={budget!r} must be a number >= 0 (GiB; 0 turns the cache off)")
        self._cache_budget = int(budget * (1 << 30))
        self._pixel_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()
        #: processed images asked for, and how many of them the cache had
        self.cache_queries = 0
        self.cache_hits = 0

    # -- what a subclass says about its model ------------------------------------------------
    @property
    def supported_modalities(self) -> set[str]:
        return set(self.placeholder_str)

    @property
    def architecture(self) -> str:
        return (self.model_config.architectures or ["?"])[0]

    @property
    def image_token_id(self) -> int:
        """The token of an image's run of embeddings (one per encoder output row)."""
        raise NotImplementedError

    @property
    def placeholder_token_id(self) -> int:
        """What a token-id prompt holds once per image (``placeholder_str``'s token)."""
        return self.image_token_id

    def expanded_placeholder_ids(self) -> list[int]:
        """What one placeholder token of a token-id prompt becomes (HF's expansion)."""
        return [self.image_token_id] * self.num_image_tokens()

    #: whether an item's tokens attend to each other in both directions (Gemma 3's images): the
    #: attention backend is told their spans, and the scheduler never ends a chunk inside one
    bidirectional_item_attention: bool = False

    def hf_images(self, images: list[Any]) -> Any:
        """``images`` of one prompt as the HF processor's ``images`` argument."""
        return images

    def num_image_tokens(self) -> int:
        """Placeholder tokens of one image (after HF's resize and crop, every image has them)."""
        raise NotImplementedError

    def default_image_processor(self) -> Any:
        """HF's image processor for a checkpoint that ships none (``--model-config`` presets)."""
        raise NotImplementedError

    def max_tokens_per_item(self, modality: str) -> int:
        return self.num_image_tokens()

    def dummy_images(self, count: int) -> list[Any]:
        """``count`` images of the largest size the model takes (profiling)."""
        from PIL import Image

        size = int(self.hf_config.vision_config.image_size)
        return [Image.new("RGB", (size, size), (127, 127, 127)) for _ in range(count)]

    # -- HF's processors, loaded on first use ------------------------------------------------
    @property
    def hf_processor(self) -> Any:
        if self._hf_processor is None:
            from transformers import AutoProcessor

            source = self.model_config.tokenizer or self.model_config.model
            try:
                self._hf_processor = AutoProcessor.from_pretrained(source)
            except (OSError, ValueError, TypeError) as e:
                raise ValueError(f"text prompts with multi_modal_data need the model's HF processor "
                                 f"(processor_config.json + tokenizer) in {source}: {e}") from e
        return self._hf_processor

    @property
    def image_processor(self) -> Any:
        if self._image_processor is None:
            if self._hf_processor is not None:
                self._image_processor = self._hf_processor.image_processor
            else:
                from transformers import AutoImageProcessor

                source = self.model_config.tokenizer or self.model_config.model
                try:
                    self._image_processor = AutoImageProcessor.from_pretrained(source)
                except (OSError, ValueError, TypeError):
                    self._image_processor = self.default_image_processor()
        return self._image_processor

    # -- a prompt ----------------------------------------------------------------------------
    def parse_items(self, mm_data: Any) -> dict[str, list[Any]]:
        """``multi_modal_data`` checked: modality -> its items, PIL images (RGB) or, with
        ``enable_mm_embeds``, precomputed embeddings ``[feature_size, hidden_size]`` (all of one
        kind per modality)."""
        from PIL import Image

        if not isinstance(mm_data, Mapping):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': PIL.Image}}, "
                             f"got {type(mm_data).__name__}")
        items: dict[str, list[Any]] = {}
        for modality, value in mm_data.items():
            if modality not in self.supported_modalities:
                raise ValueError(f"multi_modal_data[{modality!r}]: {self.architecture} takes "
                                 f"{sorted(self.supported_modalities)} only")
            if isinstance(value, torch.Tensor):
                values = self._embeddings(modality, value)
            else:
                values = list(value) if isinstance(value, (list, tuple)) else [value]
                for i, item in enumerate(values):
                    if isinstance(item, torch.Tensor):
                        raise ValueError(f"multi_modal_data[{modality!r}][{i}] is a tensor: precomputed "
                                         f"embeddings go in as one tensor [num_items, feature_size, hidden_size], "
                                         "not mixed with images in a list")
                    if not isinstance(item, Image.Image):
                        raise ValueError(f"multi_modal_data[{modality!r}][{i}] must be a PIL.Image.Image, "
                                         f"got {type(item).__name__}")
            limit = self.limits[modality]
            if len(values) > limit:
                raise ValueError(f"multi_modal_data[{modality!r}] has {len(values)} items but "
                                 f"limit_mm_per_prompt allows at most {limit} per prompt "
                                 f"(--limit-mm-per-prompt '{{\"{modality}\": N}}')")
            items[modality] = [im if isinstance(im, torch.Tensor) or im.mode == "RGB" else im.convert("RGB")
                               for im in values]
        return items

    def _embeddings(self, modality: str, value: torch.Tensor) -> list[torch.Tensor]:
        """A tensor of precomputed item embeddings, checked: one ``[feature_size, hidden]`` per item."""
        if not getattr(self.model_config, "enable_mm_embeds", False):
            raise ValueError(f"multi_modal_data[{modality!r}] is a tensor (precomputed embeddings), which needs "
                             "enable_mm_embeds=True (--enable-mm-embeds); without it, pass PIL images")
        length = self.max_tokens_per_item(modality)
        hidden = int(self.model_config.hidden_size)
        if value.dim() == 2:
            value = value.unsqueeze(0)
        if value.dim() != 3 or tuple(value.shape[1:]) != (length, hidden) or not value.is_floating_point():
            raise ValueError(f"multi_modal_data[{modality!r}] embeddings must be a floating-point tensor "
                             f"[num_items, {length}, {hidden}] ({self.architecture}: {length} rows per item, "
                             f"the language model's hidden size {hidden}); got {value.dtype} {tuple(value.shape)}")
        if not torch.isfinite(value).all():
            raise ValueError(f"multi_modal_data[{modality!r}] embeddings hold NaN or infinite values")
        return [item.detach().to(HOST).contiguous() for item in value]

    def apply(self, prompt: str | Sequence[int], mm_data: Any, *,
              add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
        """(placeholder-expanded prompt token ids, one feature per item in prompt order)."""
        images = self.parse_items(mm_data).get("image", [])
        placeholder = self.placeholder_str["image"]
        if images and isinstance(images[0], torch.Tensor):
            return self._apply_embeddings(prompt, images, add_special_tokens=add_special_tokens)
        keys = [hash_image(image) for image in images]  # what the caches key the items on
        if isinstance(prompt, str):
            found = prompt.count(placeholder)
            if found != len(images):
                raise ValueError(self._mismatch(found, len(images)))
            if images:
                out = self.hf_processor(text=[prompt], images=self.hf_images(images), return_tensors="pt",
                                        add_special_tokens=add_special_tokens)
                token_ids = out["input_ids"][0].tolist()
                pixel_values = out["pixel_values"]
            else:
                token_ids = self.hf_processor.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
                pixel_values = None
        else:
            token_ids = self._expand_placeholders(list(prompt), len(images))
            pixel_values = self._pixel_values(images, keys) if images else None
        return token_ids, self._features(token_ids, keys, pixel_values)

    def _pixel_values(self, images: list[Any], keys: list[str]) -> torch.Tensor:
        """``[len(images), 3, H, W]``: HF's image processor's output, each image's from the
        processor cache when an equal image (content hash ``keys``) was processed before. HF
        processes the images of a call one by one, so a cached row is what the call would give."""
        rows: dict[str, torch.Tensor] = {}
        with self._cache_lock:
            for key in keys:
                if key in self._pixel_cache:
                    self._pixel_cache.move_to_end(key)
                    rows[key] = self._pixel_cache[key]
            self.cache_queries += len(keys)
            self.cache_hits += sum(key in rows for key in keys)
        missing = list(dict.fromkeys(k for k in keys if k not in rows))
        if missing:
            by_key = dict(zip(keys, images, strict=True))
            fresh = dict(zip(missing, self.image_processor([by_key[k] for k in missing],
                                                           return_tensors="pt")["pixel_values"], strict=True))
            rows.update(fresh)
            self._remember(fresh)
        return torch.stack([rows[k] for k in keys])

    def _remember(self, rows: dict[str, torch.Tensor]) -> None:
        """Keep processed rows, least recently used out first, within ``mm_processor_cache_gb``."""
        with self._cache_lock:
            for key, row in rows.items():
                size = row.numel() * row.element_size()
                if size > self._cache_budget or key in self._pixel_cache:  # (another thread's)
                    continue
                self._pixel_cache[key] = row
                self._cache_bytes += size
            while self._cache_bytes > self._cache_budget:
                _, old = self._pixel_cache.popitem(last=False)
                self._cache_bytes -= old.numel() * old.element_size()

    def _expand_placeholders(self, token_ids: list[int], num_items: int) -> list[int]:
        """A token-id prompt's one placeholder token per item, expanded as HF's processor would.
        NOTE: ids already expanded (``num_image_tokens()`` image tokens per item, as HF's
        processor and this method write them) are taken as they are."""
        if token_ids.count(self.image_token_id) == num_items * self.num_image_tokens():
            return token_ids
        placeholder = self.placeholder_token_id
        found = token_ids.count(placeholder)
        if found != num_items:
            raise ValueError(self._mismatch(found, num_items) + " (a token-id prompt has one "
                             f"placeholder token, id {placeholder}, per image, or is already expanded)")
        replacement = self.expanded_placeholder_ids()
        expanded: list[int] = []
        for t in token_ids:
            if t == placeholder:
                expanded.extend(replacement)
            else:
                expanded.append(t)
        return expanded

    def _apply_embeddings(self, prompt: str | Sequence[int], embeds: list[torch.Tensor], *,
                          add_special_tokens: bool) -> tuple[list[int], list[MultiModalFeature]]:
        """:meth:`apply` for precomputed embeddings: the prompt's placeholders expanded by id (a
        text prompt tokenized first, without images for HF's processor to expand them), each
        item's embedding rows taking the place of its encoder output."""
        if isinstance(prompt, str):
            found = prompt.count(self.placeholder_str["image"])
            if found != len(embeds):
                raise ValueError(self._mismatch(found, len(embeds)))
            prompt = self.hf_processor.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        token_ids = self._expand_placeholders(list(prompt), len(embeds))
        n = self.num_image_tokens()
        return token_ids, [MultiModalFeature(modality="image", identifier=hash_tensor(embed), offset=offset, length=n,
                                             data={"image_embeds": embed})
                           for offset, embed in zip(self._item_offsets(token_ids, len(embeds)), embeds, strict=True)]

    def check_text_only(self, token_ids: Sequence[int]) -> None:
        """A prompt without multi_modal_data must not hold image placeholders (they have no embeddings)."""
        found = sum(1 for t in token_ids if t == self.image_token_id)
        if found:
            raise ValueError(f"the prompt holds {found} image placeholder token(s) "
                             f"({self.placeholder_str['image']!r}, id {self.image_token_id}) but no multi_modal_data; "
                             "pass the images as {'prompt': ..., 'multi_modal_data': {'image': [...]}}")

    def _mismatch(self, found: int, num_images: int) -> str:
        return (f"the prompt has {found} image placeholder(s) ({self.placeholder_str['image']!r}) but "
                f"multi_modal_data has {num_images} image(s); they must match, one placeholder per image")

    def _item_offsets(self, token_ids: list[int], num_items: int) -> list[int]:
        """Where each item's run starts: item ``i`` takes the next ``num_image_tokens()``
        placeholder positions, which must be contiguous (HF's expansion writes them so)."""
        n = self.num_image_tokens()
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(positions) != n * num_items:
            raise ValueError(f"the processed prompt has {len(positions)} image placeholder tokens, expected "
                             f"{n} per image x {num_items} image(s)")
        offsets = []
        for k in range(num_items):
            run = positions[k * n:(k + 1) * n]
            if run[-1] - run[0] != n - 1:
                raise ValueError(f"image {k}'s {n} placeholder tokens are not contiguous in the prompt")
            offsets.append(run[0])
        return offsets

    def _features(self, token_ids: list[int], keys: list[str], pixel_values: Any) -> list[MultiModalFeature]:
        n = self.num_image_tokens()
        return [MultiModalFeature(modality="image", identifier=key, offset=offset, length=n,
                                  data={"pixel_values": pixel_values[k:k + 1].contiguous()})
                for k, (offset, key) in enumerate(zip(self._item_offsets(token_ids, len(keys)), keys, strict=True))]
