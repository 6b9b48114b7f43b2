"""Tiny random vision-language checkpoints (LLaVA-1.5 layout) and HF's greedy tokens on them.

The checkpoint directory is what ``save_pretrained`` of transformers' model, processor and
tokenizer writes: config.json (a CLIP vision config and a Llama text config), safetensors,
processor_config.json and a tokenizer that knows ``<image>`` (the test BPE tokenizer plus one
added special token, the last id of the vocabulary). Weights are re-drawn as in
:mod:`pagedlm.core.testing.checkpoints` so logits are spread and greedy tokens are stable; the
projector's output is scaled so image embeddings weigh as much as token embeddings (images then
change the continuation, which the tests check).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedlm.core.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, _pin_tokenizer_config, build_bpe_tokenizer

IMAGE_TOKEN = "<image>"
#: CLIP's geometry in the tiny checkpoint: 56 px images of 14 px patches -> 16 image tokens
TINY_IMAGE_SIZE = 56
TINY_PATCH_SIZE = 14


def make_tiny_llava_checkpoint(out_dir: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512,
                               logit_scale: float = 8.0, max_position_embeddings: int = 512) -> str:
    """Build a tiny random ``LlavaForConditionalGeneration`` checkpoint in ``out_dir``; returns it.

    Vision: CLIP, 3 layers of width 32, quick-GELU, features of layer -2 without the class token
    (``vision_feature_layer=-2``, ``"default"``) -> 16 tokens per image. Projector: linear, GELU,
    linear. Text: Llama, 2 layers of width 64. ``<image>`` is id ``vocab_size - 1``.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_bpe_tokenizer(out, vocab_size=vocab_size - 1)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == vocab_size - 1 and len(tokenizer) == vocab_size
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=TINY_IMAGE_SIZE, patch_size=TINY_PATCH_SIZE, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-6,
                       rope_theta=500000.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", architectures=["LlavaForConditionalGeneration"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _reinitialise(model, seed=seed, logit_scale=logit_scale)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(out))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": TINY_IMAGE_SIZE},
                                              crop_size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=TINY_PATCH_SIZE, vision_feature_select_strategy="default",
        num_additional_image_tokens=1)
    processor.save_pretrained(str(out))
    _pin_tokenizer_config(out)
    return str(out)


GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
#: SigLIP's geometry in the tiny Gemma 3 checkpoint: 28 px images of 7 px patches (a 4 x 4 grid),
#: pooled to 2 x 2 -> 4 soft tokens per image
GEMMA3_TINY_IMAGE_SIZE = 28


def make_tiny_gemma3_vision_checkpoint(out_dir: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512,
                                       logit_scale: float = 8.0) -> str:
    """Build a tiny random ``Gemma3ForConditionalGeneration`` checkpoint in ``out_dir``; returns it.

    Vision: SigLIP, 2 layers of width 32, no pooling head; projector: 2 x 2 average pool, Gemma RMS
    norm, projection. Text: the tiny Gemma 3 of :func:`~pagedlm.core.testing.make_tiny_checkpoint`
    (head size 256, sliding window 8 on every other layer). ``<start_of_image>``,
    ``<end_of_image>`` and ``<image_soft_token>`` are the last three ids.
    """
    import json

    import torch
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        GenerationConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from pagedlm.core.testing.checkpoints import _config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_bpe_tokenizer(out, vocab_size=vocab_size - len(GEMMA3_IMAGE_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(list(GEMMA3_IMAGE_TOKENS), special_tokens=True)
    boi, eoi, soft = tokenizer.convert_tokens_to_ids(list(GEMMA3_IMAGE_TOKENS))
    assert len(tokenizer) == vocab_size and soft == vocab_size - 1
    tokenizer.save_pretrained(str(out))
    # HF's Gemma3Processor reads the image tokens from the tokenizer's named special tokens
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["extra_special_tokens"] = dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA3_IMAGE_TOKENS))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = _config("gemma3", vocab_size=vocab_size)
    text.architectures = None
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=GEMMA3_TINY_IMAGE_SIZE, patch_size=7, vision_use_head=False)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=soft,
                          architectures=["Gemma3ForConditionalGeneration"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    _reinitialise(model, seed=seed, logit_scale=logit_scale)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(out))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": GEMMA3_TINY_IMAGE_SIZE,
                                                      "width": GEMMA3_TINY_IMAGE_SIZE}),
        tokenizer=tokenizer, image_seq_length=4)
    processor.save_pretrained(str(out))
    _pin_tokenizer_config(out)
    return str(out)


def _reinitialise(model: Any, *, seed: int, logit_scale: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    text = model.config.text_config
    gemma = text.model_type.startswith("gemma")
    has_qk_norm = any(name.endswith("q_norm.weight") for name in params)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight") or ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight"):
                w = 0.5 + torch.rand(p.shape, generator=gen)
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    w *= 2.0  # Gemma normalises q and k: their scale lives here
                p.copy_(w)
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("language_model.embed_tokens.weight") and gemma:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(text.hidden_size))  # scaled by sqrt(hidden)
            elif p.dim() == 1 or "embed" in name:  # class embedding, token and position embeddings
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                # [in, out] for Gemma's projection (x @ W), [out, in, ...] for the rest
                fan_in = p.shape[0] if name.endswith("mm_input_projection_weight") else math.prod(p.shape[1:])
                std = 1.0 / math.sqrt(fan_in)
                if name.endswith(("q_proj.weight", "k_proj.weight")) and not has_qk_norm:
                    std *= 2.0  # attention that selects positions (see checkpoints._QK_GAIN)
                p.copy_(std * torch.randn(p.shape, generator=gen))
        norm = model.model.language_model.norm.weight
        if gemma:  # zero-centred: the scale is 1 + w
            norm.copy_(logit_scale * (0.5 + torch.rand(norm.shape, generator=gen)) - 1.0)
        else:
            norm.mul_(logit_scale)


def load_hf_vlm(model_dir: str | os.PathLike[str]) -> tuple[Any, Any]:
    """(HF model in float32 on the CPU, its processor) of a vision-language checkpoint."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(model_dir))


def hf_multimodal_greedy(model: Any, processor: Any, prompts: Sequence[tuple[str, Sequence[Any]]], max_new: int, *,
                         add_special_tokens: bool = True) -> list[list[int]]:
    """HF transformers' greedy tokens for ``(prompt text with <image> placeholders, images)`` pairs,
    one prompt at a time (no padding)."""
    import torch

    results = []
    for text, images in prompts:
        nested = type(processor).__name__ == "Gemma3Processor"  # it takes a list of images per prompt
        batch_images = ([list(images)] if nested else list(images)) if images else None
        inputs = processor(text=[text], images=batch_images, return_tensors="pt",
                           add_special_tokens=add_special_tokens)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        results.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return results


def random_image(seed: int, size: tuple[int, int]) -> Any:
    """A noise PIL image of ``size`` (width, height): different seeds give different pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def data_url(image: Any, fmt: str = "PNG") -> str:
    """``data:image/<fmt>;base64,...`` of a PIL image (what an OpenAI client sends)."""
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
