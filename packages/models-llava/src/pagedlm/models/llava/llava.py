"""LLaVA-1.5 (``LlavaForConditionalGeneration``): CLIP vision tower -> MLP projector -> Llama.

Built from a vision part (``vision_tower``, ``multi_modal_projector``) and the Llama language
part (``model``, ``lm_head``) of pagedlm-models-llama. The language part is an ordinary
:class:`CausalLM` over flat token tensors: images reach it as rows of its input embeddings,
which the model runner puts at the placeholder positions (``embed_multimodal`` gives one
``[num_image_tokens, hidden]`` tensor per image).

Checkpoints name the parts ``vision_tower.(vision_model.)*``, ``multi_modal_projector.*``,
``language_model.model.*`` and ``language_model.lm_head.*`` (llava-hf), or ``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.language_model.*`` and ``lm_head.*`` (transformers 5's
in-memory names); both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedlm.core.config import VllmConfig
from pagedlm.core.layers import QKV_GATE_UP_STACKED_PARAMS, CausalLM, maybe_prefix
from pagedlm.core.layers.vision import vision_activation
from pagedlm.models.llama.modeling import SKIPPED_WEIGHTS, LlamaModel
from pagedlm.models.llava.clip import CLIPVisionTower

#: checkpoint name prefix -> ours (first match wins)
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    """``[..., vision_hidden * num_feature_layers] -> [..., text_hidden]``: linear, activation, linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _feature_layers(config: Any) -> list[int]:
    layers = config.vision_feature_layer
    return [int(layers)] if isinstance(layers, int) else [int(x) for x in layers]


class LlavaForConditionalGeneration(CausalLM):
    stacked_params = QKV_GATE_UP_STACKED_PARAMS
    skipped_weights = SKIPPED_WEIGHTS

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        vision = hf_config.vision_config
        self.config = vllm_config.model_config.text_config
        total = int(vision.num_hidden_layers)
        # HF's hidden_states index i is the output of i layers (negative: counted from the end)
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in _feature_layers(hf_config)]
        self.num_vision_layers = max(self.feature_layers)
        self.select_strategy = hf_config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={self.select_strategy!r} is not supported "
                             "(default, full)")
        self.vision_tower = CLIPVisionTower(vision, self.num_vision_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(self.feature_layers), self.config.hidden_size, hf_config.projector_hidden_act,
            bool(getattr(hf_config, "multimodal_projector_bias", True)))
        self.model = LlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.init_lm_head(prefix)

    def embed_multimodal(self, modality: str, *, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``pixel_values [B, 3, H, W]`` -> B tensors ``[num_image_tokens, text_hidden]``."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r}")
        states = self.vision_tower(pixel_values)
        features = torch.cat([states[i] for i in self.feature_layers], dim=-1)
        if self.select_strategy == "default":
            features = features[:, 1:]  # drop CLIP's class token
        return list(self.multi_modal_projector(features))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from pagedlm.core.model_loader import load_weights_by_name

        vision: list[tuple[str, torch.Tensor]] = []

        def language(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                name = self._our_name(name)
                if name is None:
                    continue
                if name.startswith(_VISION_PARTS):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(language(weights))
        return loaded | load_weights_by_name(self, vision)

    def _our_name(self, name: str) -> str | None:
        """A checkpoint name as ours, or None for a tensor this model does not use (the vision
        layers after the last one read, the tower's final norm, buffers)."""
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        if name.startswith("vision_tower."):
            if name.startswith("vision_tower.post_layernorm.") or name.endswith("position_ids"):
                return None
            if name.startswith("vision_tower.encoder.layers.") and int(name.split(".")[3]) >= self.num_vision_layers:
                return None
        return name
