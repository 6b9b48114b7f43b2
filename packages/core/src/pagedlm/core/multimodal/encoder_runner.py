"""The workers' side of the encoder cache: run the model's encoder on a step's scheduled items
(batched across requests), keep the outputs by item hash, and gather the rows of the step's
placeholder positions for the input embeddings.

The model implements ``embed_multimodal(modality, **batched_data) -> list of [length_i, hidden]``
(one tensor per item, in order); the gathered rows replace the embedding lookup at their flat
token positions through :func:`pagedlm.core.worker.prompt_embeds.input_embeddings_override` (the
seam prompt embeddings use).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def supports_multimodal(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "embed_multimodal", None))


class EncoderRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, *,
                 bidirectional_item_attention: bool = False) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.bidirectional_item_attention = bidirectional_item_attention
        #: item hash -> encoder output ``[length, hidden]`` on the device
        self.cache: dict[str, torch.Tensor] = {}

    def step_embeds(self, sched: Any, step: Any,
                    requests: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Free, encode, then (flat token indices ``[N]``, embeddings ``[N, hidden]``) of the step's
        placeholder positions on the device; None when the step computes none."""
        for key in sched.free_encoder_mm_hashes:
            self.cache.pop(key, None)
        if sched.scheduled_encoder_inputs:
            self._encode([requests[r].mm_features[i] for r, items in sched.scheduled_encoder_inputs.items()
                          for i in items])
        indices: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for b, req_id in enumerate(step.req_ids):
            features = requests[req_id].mm_features
            if not features:
                continue
            start = int(step.num_computed[b])
            end = start + int(step.num_scheduled[b])
            first = int(step.query_start_loc[b])
            for f in features:
                lo, hi = max(start, f.offset), min(end, f.end)
                if lo >= hi:
                    continue
                output = self.cache.get(f.identifier)
                if output is None:
                    raise RuntimeError(f"request {req_id}: the encoder output of item {f.identifier[:12]} is not "
                                       "cached on this worker (scheduler and worker disagree)")
                indices.append(torch.arange(first + lo - start, first + hi - start, dtype=torch.int64))
                rows.append(output[lo - f.offset:hi - f.offset])
        if not indices:
            return None
        return torch.cat(indices).to(self.device, non_blocking=True), torch.cat(rows)

    def bidirectional_spans(self, step: Any, requests: Mapping[str, Any]) -> list[list[tuple[int, int]]] | None:
        """Per request of the step, the ``(start, end)`` positions of the items the step computes,
        for a model whose items attend within themselves both ways; None otherwise."""
        if not self.bidirectional_item_attention:
            return None
        spans = []
        for b, req_id in enumerate(step.req_ids):
            start = int(step.num_computed[b])
            end = start + int(step.num_scheduled[b])
            spans.append([(f.offset, f.end) for f in requests[req_id].mm_features if f.offset < end and f.end > start])
        return spans if any(spans) else None

    def _encode(self, features: list[Any]) -> None:
        """One encoder call per modality and input shape over the items not cached yet."""
        groups: dict[tuple, list[Any]] = {}
        for f in features:
            if f.identifier in self.cache:
                continue  # another request of the step brought the same item
            if "image_embeds" in f.data:  # precomputed (enable_mm_embeds): nothing to encode
                self.cache[f.identifier] = f.data["image_embeds"].to(device=self.device, dtype=self.dtype)
                continue
            shapes = tuple((k, tuple(v.shape[1:])) for k, v in sorted(f.data.items()))
            groups.setdefault((f.modality, shapes), [])
            if all(g.identifier != f.identifier for g in groups[(f.modality, shapes)]):
                groups[(f.modality, shapes)].append(f)
        for (modality, _), items in groups.items():
            batched = {k: torch.cat([f.data[k] for f in items]).to(device=self.device, dtype=self.dtype,
                                                                    non_blocking=True)
                       for k in items[0].data}
            outputs = self.model.embed_multimodal(modality, **batched)  # type: ignore[operator]
            for f, out in zip(items, outputs, strict=True):
                if out.shape[0] != f.length:
                    raise RuntimeError(f"the encoder gave {out.shape[0]} rows for an item with {f.length} "
                                       "placeholder tokens")
                self.cache[f.identifier] = out

    def profile(self, processor: Any, num_tokens: int) -> None:
        """Encode the largest batch of dummy images one step may schedule (``num_tokens`` encoder
        tokens), so a device's activation peak includes the encoder's worst case."""
        per_item = processor.num_image_tokens()
        count = max(1, num_tokens // per_item)
        pixel_values = processor.image_processor(processor.dummy_images(count), return_tensors="pt")["pixel_values"]
        outputs = self.model.embed_multimodal(  # type: ignore[operator]
            "image", pixel_values=pixel_values.to(device=self.device, dtype=self.dtype))
        del outputs


def make_encoder_runner(vllm_config: Any, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                        attn_backend: Any) -> EncoderRunner | None:
    """The encoder runner of a multimodal model (None for a text model)."""
    from pagedlm.core.distributed import get_pp_group
    from pagedlm.core.multimodal.registry import create_processor

    processor = create_processor(vllm_config.model_config)
    if processor is None:
        return None
    bidirectional = processor.bidirectional_item_attention
    if bidirectional and not getattr(attn_backend, "supports_bidirectional_spans", False):
        raise ValueError(f"{type(model).__name__} attends bidirectionally within an image, which attention backend "
                         f"{attn_backend.name!r} does not support yet (the CPU backend does)")
    if not supports_multimodal(model):
        raise ValueError(f"{type(model).__name__} is registered as multimodal but has no embed_multimodal")
    if get_pp_group().world_size > 1:
        raise ValueError("multimodal models do not run with pipeline parallelism yet (pipeline_parallel_size > 1)")
    if vllm_config.model_config.enable_prompt_embeds:
        raise ValueError("enable_prompt_embeds=True is not supported with a multimodal model yet")
    return EncoderRunner(model, device, dtype, bidirectional_item_attention=bidirectional)


@contextlib.contextmanager
def multimodal_embeddings(model: torch.nn.Module,
                          mm_embeds: tuple[torch.Tensor, torch.Tensor] | None) -> Iterator[None]:
    """For the forward passes inside: the step's encoder embeddings at their placeholder positions
    (``StepInputs.mm_embeds``) instead of the placeholder tokens' own embeddings."""
    if mm_embeds is None:
        yield
        return
    from pagedlm.core.worker.prompt_embeds import embedding_body, input_embeddings_override

    body = embedding_body(model)
    assert body is not None, "a multimodal model's body embeds its input through get_input_embeddings"
    with input_embeddings_override(body, *mm_embeds):
        yield


def profile_encoder(vllm_config: Any, encoder_runner: EncoderRunner | None) -> None:
    """The encoder's worst case for a device's profiling run (nothing for a text model)."""
    if encoder_runner is None:
        return
    from pagedlm.core.multimodal.registry import create_processor, encoder_budget

    processor = create_processor(vllm_config.model_config)
    assert processor is not None
    encoder_runner.profile(processor, encoder_budget(vllm_config))
