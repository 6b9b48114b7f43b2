"""OpenAI-style chat messages with image parts -> the conversation a chat template renders and
the images, in order (vLLM's chat handling of multimodal content).

Content formats (vLLM's ``chat_template_content_format``): a ``"string"`` template renders each
message's content as text, so a message's images become the model's placeholder, one per image,
placed before its text and joined by newlines; an ``"openai"`` template iterates over content
parts, so it gets the parts with each image as ``{"type": "image"}``. ``"auto"`` tells them apart
by rendering a probe message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedlm.core.multimodal.media import load_image_url

CONTENT_FORMATS = ("auto", "string", "openai")
_IMAGE_PARTS = ("image_url", "image_pil", "image_embeds")
_PROBE = "\x1fpagedlm-content-probe\x1f"


def has_image_parts(conversation: Sequence[Mapping[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, Mapping) and p.get("type") in _IMAGE_PARTS
                                                          for p in m["content"])
               for m in conversation)


def detect_content_format(tokenizer: Any, chat_template: str | None) -> str:
    """``"openai"`` when the template renders a text part's text (it iterates over parts), else
    ``"string"`` (it prints the content, so a list would come out as its repr)."""
    probe = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
    try:
        text = tokenizer.apply_chat_template(probe, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot take parts takes strings
        return "string"
    return "openai" if _PROBE in text and "'type'" not in text and '"type"' not in text else "string"


def parse_chat_messages(conversation: Sequence[Mapping[str, Any]], *, placeholder: str, content_format: str,
                        allowed_local_media_path: str = "", allowed_media_domains: list[str] | None = None,
                        enable_mm_embeds: bool = False,
                        param: str = "messages") -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages for the template, images in order: PIL images, or with ``image_embeds`` parts
    one ``[feature_size, hidden]`` tensor each); ``ValueError`` naming the bad part."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"chat_template_content_format={content_format!r} must be one of {CONTENT_FORMATS}")
    images: list[Any] = []
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        entry = dict(message)
        if isinstance(content, list):
            texts: list[str] = []
            parts: list[dict[str, Any]] = []
            num_images = 0
            for j, part in enumerate(content):
                where = f"{param}[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text":
                    texts.append(str(part.get("text") or ""))
                    parts.append({"type": "text", "text": texts[-1]})
                elif kind == "image_embeds":
                    images.append(_embeddings_of(part, where, enable_mm_embeds))
                    num_images += 1
                    parts.append({"type": "image"})
                elif kind in _IMAGE_PARTS:
                    images.append(_image_of(part, where, allowed_local_media_path, allowed_media_domains))
                    num_images += 1
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"{where}.type={kind!r} is not supported: use text, image_url, image_pil or "
                                     "image_embeds parts")
            if content_format == "openai":
                entry["content"] = parts
            else:
                entry["content"] = "\n".join([placeholder] * num_images + (["\n".join(texts)] if texts else []))
        messages.append(entry)
    return messages, images


def _embeddings_of(part: Mapping[str, Any], where: str, enable_mm_embeds: bool) -> Any:
    """An ``image_embeds`` part (vLLM's): a base64 string of a ``torch.save``d tensor
    ``[feature_size, hidden]`` (or ``[1, feature_size, hidden]``), loaded with ``weights_only``."""
    import base64
    import binascii
    import io
    import pickle

    import torch

    from pagedlm.core.platforms import HOST

    if not enable_mm_embeds:
        raise ValueError(f"{where}: image_embeds parts need the server started with --enable-mm-embeds")
    data = part.get("image_embeds")
    if not isinstance(data, str):
        raise ValueError(f"{where}.image_embeds must be a base64 string of a torch.save()d tensor")
    try:
        tensor = torch.load(io.BytesIO(base64.b64decode(data, validate=True)), weights_only=True, map_location=HOST)
    except (binascii.Error, pickle.UnpicklingError, ValueError, RuntimeError, EOFError, OSError, TypeError) as e:
        raise ValueError(f"{where}.image_embeds: not a base64 torch.save()d tensor ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{where}.image_embeds holds a {type(tensor).__name__}, not a tensor")
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2:
        raise ValueError(f"{where}.image_embeds must be one image's embeddings [feature_size, hidden_size]; got "
                         f"shape {tuple(tensor.shape)}")
    return tensor


def stack_items(items: list[Any]) -> Any:
    """A message list's items as ``multi_modal_data["image"]``: the images, or their embeddings as
    one ``[num_items, feature_size, hidden]`` tensor (``ValueError`` when the two are mixed or the
    embeddings differ in shape)."""
    import torch

    tensors = [item for item in items if isinstance(item, torch.Tensor)]
    if not tensors:
        return items
    if len(tensors) != len(items):
        raise ValueError("image_embeds parts cannot be mixed with image_url / image_pil parts in one request")
    if len({tuple(t.shape) for t in tensors}) != 1:
        raise ValueError(f"image_embeds parts differ in shape: {sorted({tuple(t.shape) for t in tensors})}")
    return torch.stack(tensors)


def _image_of(part: Mapping[str, Any], where: str, allowed_local_media_path: str,
              allowed_media_domains: list[str] | None) -> Any:
    from PIL import Image

    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL.Image.Image, got {type(image).__name__}")
        return image
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise ValueError(f"{where}.image_url must be {{'url': str}} or a string")
    try:
        return load_image_url(url, allowed_local_media_path=allowed_local_media_path,
                              allowed_media_domains=allowed_media_domains)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def render_multimodal_chat(tokenizer: Any, processor: Any, model_config: Any,
                           conversation: Sequence[Mapping[str, Any]], *, chat_template: str | None,
                           add_generation_prompt: bool, content_format: str = "auto",
                           continue_final_message: bool = False, param: str = "messages") -> dict[str, Any]:
    """A conversation with images as an engine prompt: ``{"prompt": text, "prompt_token_ids": ids
    (one placeholder token per image, as the template wrote them), "multi_modal_data": ...}``."""
    if processor is None:
        archs = ", ".join(model_config.architectures) or "this model"
        raise ValueError(f"{param}: image content parts need a multimodal model; {archs} takes text only")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        # as vLLM: a checkpoint whose template ships with its processor only (llava-hf's)
        chat_template = getattr(processor.hf_processor, "chat_template", None)
    if content_format == "auto":
        content_format = detect_content_format(tokenizer, chat_template)
    messages, images = parse_chat_messages(
        conversation, placeholder=processor.placeholder_str["image"], content_format=content_format,
        allowed_local_media_path=model_config.allowed_local_media_path,
        allowed_media_domains=model_config.allowed_media_domains,
        enable_mm_embeds=getattr(model_config, "enable_mm_embeds", False), param=param)
    extra = {"continue_final_message": True} if continue_final_message else {}
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    # The template writes the special tokens (BOS, role markers) itself.
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": list(token_ids), "multi_modal_data": {"image": stack_items(images)}}
