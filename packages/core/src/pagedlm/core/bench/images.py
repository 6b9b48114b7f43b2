"""Image workloads for ``pagedlm bench throughput`` (multimodal models): each request's token-id
prompt gets ``--images-per-request`` placeholder tokens (at its start) and as many random
``--image-size`` square images, distinct per request (no encoder-cache or prefix-cache sharing).
"""

from __future__ import annotations

import argparse
import random
from typing import Any


def add_image_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images-per-request", type=int, default=0,
                        help="multimodal models: random images per request (placeholders at the prompt's start)")
    parser.add_argument("--image-size", type=int, default=336, help="width and height of the random images")
    parser.add_argument("--hf-batch-size", type=int, default=64,
                        help="with --images-per-request, --compare hf runs HF's generate on batches of this size")


def image_prompts(args: argparse.Namespace, llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]] | None:
    """The workload's prompts with images, or None without ``--images-per-request``."""
    count = args.images_per_request
    if not count:
        return None
    if count < 0 or args.image_size < 1:
        raise ValueError("--images-per-request must be >= 0 and --image-size >= 1")
    processor = llm.llm_engine.processor.mm_processor
    if processor is None:
        raise ValueError("--images-per-request needs a multimodal model (e.g. --model-config llava-1.5-7b)")
    placeholder = processor.image_token_id
    rng = random.Random(args.workload_seed)
    out = []
    for ids in prompts:
        text = [t if t != placeholder else placeholder - 1 for t in ids]
        out.append({"prompt_token_ids": text[:1] + [placeholder] * count + text[1:],
                    "multi_modal_data": {"image": [_noise(rng, args.image_size) for _ in range(count)]}})
    return out


def warm_up_images(args: argparse.Namespace, llm: Any) -> None:
    """One untimed request with an image (not one of the workload's): loading HF's image processor
    and the encoder's first call stay out of the timing."""
    from pagedlm.core import SamplingParams

    if not args.images_per_request:
        return
    rng = random.Random(-1 - args.workload_seed)
    prompt = image_prompts(args, llm, [[7, 8, 9]])
    assert prompt is not None
    prompt[0]["multi_modal_data"]["image"] = [_noise(rng, args.image_size) for _ in range(args.images_per_request)]
    llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)


def _noise(rng: random.Random, size: int) -> Any:
    from PIL import Image

    return Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))


def run_hf_generate(llm_outputs: list[Any], prompts: list[dict[str, Any]], processor: Any, *, model_dir: str,
                    dummy: bool, dtype: Any, device: str, batch_size: int, seed: int) -> dict[str, Any]:
    """HF transformers' ``generate`` on the same requests (the placeholder-expanded ids pagedlm ran,
    the same pixels), ``batch_size`` at a time, left-padded, each to its pagedlm output length."""
    import time

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    else:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    pad = int(getattr(model.config.text_config, "pad_token_id", None) or 0)
    batches = []
    for start in range(0, len(prompts), batch_size):
        outs, reqs = llm_outputs[start:start + batch_size], prompts[start:start + batch_size]
        ids = [list(o.prompt_token_ids) for o in outs]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids], device=device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
        images = [im for r in reqs for im in r["multi_modal_data"]["image"]]
        pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"].to(device=device, dtype=dtype)
        batches.append((input_ids, mask, pixels, max(len(c.token_ids) for o in outs for c in o.outputs)))
    from pagedlm.core.platforms import resolve_platform

    num_out = 0
    sync = resolve_platform(device).synchronize
    sync()
    start_t = time.perf_counter()
    with torch.inference_mode():
        for input_ids, mask, pixels, max_new in batches:
            out = model.generate(input_ids=input_ids, attention_mask=mask, pixel_values=pixels, do_sample=False,
                                 max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad)
            num_out += (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    sync()
    elapsed = time.perf_counter() - start_t
    num_images = sum(len(r["multi_modal_data"]["image"]) for r in prompts)
    return {"api": "generate", "attn_implementation": str(model.config._attn_implementation),
            "batch_size": batch_size, "elapsed_s": elapsed, "total_output_tokens": num_out,
            "output_tokens_per_s": num_out / elapsed, "images_per_s": num_images / elapsed}
