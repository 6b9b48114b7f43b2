"""``--compare hf``: the same workload through HF transformers' own continuous batching.

HF's engine is ``model.generate_batch`` (transformers >= 4.56), a thin loop over its
``ContinuousBatchingManager``. ``generate_batch`` takes one ``max_new_tokens`` for all requests, so
it runs workloads whose output lengths are all equal (``fixed``); workloads with per-request
lengths (``nano``, ``sharegpt-like``) go through the manager's ``add_request(max_new_tokens=...)``,
the same engine. Either way the manager's warm-up runs before the clock starts, as ours does.

The transformers API moved between 5.x releases (``ContinuousBatchingConfig`` split off
``GenerationConfig``; ``block_size`` became ``page_size``), so options are passed only where the
installed version declares them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from typing import Any

from pagedlm.core import envs
from pagedlm.core.bench.workloads import Workload
from pagedlm.core.platforms.interface import HOST

#: bytes HF continuous batching may spend on attention masks on the CPU (see run_hf)
_MASK_BUDGET = 2 * 2**30


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def build_hf_model(model_dir: str, *, dummy: bool, dtype: Any, device: str, attn_implementation: str, seed: int):
    """HF model for ``model_dir``: random init from config.json when ``dummy``, else its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if dummy:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    else:
        gguf = {}
        if os.path.isfile(model_dir):  # HF reads a GGUF file (dequantized) from its directory
            model_dir, gguf = os.path.dirname(model_dir), {"gguf_file": os.path.basename(model_dir)}
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation, dtype=dtype,
                                                     **gguf)
    return model.to(device=device, dtype=dtype).eval()


def _cb_config(hf_kwargs: dict[str, Any]):
    """A ``ContinuousBatchingConfig`` with the fields this transformers version knows, or None."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        return None
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "page_size" not in names and "page_size" in hf_kwargs:
        hf_kwargs = {**hf_kwargs, "block_size": hf_kwargs["page_size"]}
    return ContinuousBatchingConfig(**{k: v for k, v in hf_kwargs.items() if k in names})


def run_hf(workload: Workload, *, model_dir: str, dummy: bool, dtype: Any, device: str, attn_implementation: str,
           seed: int, kv_tokens: int | None, max_batch_tokens: int | None, max_requests: int | None) -> dict[str, Any]:
    """Run ``workload`` through HF continuous batching; returns timings and token counts.

    ``kv_tokens`` sizes HF's KV cache on the CPU, where its memory-based sizing does not apply (it
    asks psutil and then reserves most of the host's RAM); on GPUs HF sizes its own cache.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    if getattr(transformers.GenerationMixin, "generate_batch", None) is None:
        raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch (needs >= 4.56)")
    t_load = time.perf_counter()
    model = build_hf_model(model_dir, dummy=dummy, dtype=dtype, device=device,
                           attn_implementation=attn_implementation, seed=seed)
    load_s = time.perf_counter() - t_load
    cb_kwargs: dict[str, Any] = {}
    if torch.device(device).type == HOST.type:  # HF on the host
        page = 256
        # HF's CPU path (sdpa) builds dense float masks of [max_batch_tokens, cache + batch tokens]:
        # a cache as large as ours (sized for max_num_seqs full-length requests) would need tens of
        # GB of masks. So its cache holds what the workload can use, and the batch is cut until
        # the masks fit in _MASK_BUDGET.
        need = sum(len(p) + o for p, o in zip(workload.prompts, workload.output_lens))
        cache_tokens = min(kv_tokens or need, need)
        num_blocks = max(1, -(-cache_tokens // page))
        tokens = num_blocks * page
        batch = max_batch_tokens or 8192
        while batch > 256 and batch * (tokens + batch) * 4 > _MASK_BUDGET:
            batch //= 2
        cb_kwargs.update(page_size=page, num_blocks=num_blocks, max_batch_tokens=batch)
    if max_requests:
        cb_kwargs["max_requests_per_batch"] = max_requests
    cb_config = _cb_config(cb_kwargs)
    sample = workload.temperature > 0
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max(workload.output_lens), do_sample=sample,
                                      eos_token_id=-1, pad_token_id=0)  # eos -1: run every request to its length
    if sample:
        gen_kwargs.update(temperature=workload.temperature, top_k=0, top_p=1.0)
    if cb_config is None:  # older 5.x: continuous-batching knobs live on GenerationConfig
        gen_kwargs.update({"block_size" if k == "page_size" else k: v for k, v in cb_kwargs.items()})
    gen_config = GenerationConfig(**gen_kwargs)
    model.generation_config.eos_token_id = -1
    inputs = [list(p) for p in workload.prompts]
    uniform = len(set(workload.output_lens)) == 1
    # NOTE: no_grad, not inference_mode: transformers 5.17's continuous-batching manager resets
    # its static tensors in place from its own thread, outside any inference_mode, and fails on
    # inference tensors ("Inplace update to inference tensor outside InferenceMode"; seen on CUDA).
    with torch.no_grad():
        if uniform:
            api, elapsed, outputs = "generate_batch", *_via_generate_batch(model, inputs, gen_config, cb_config)
        else:
            api, elapsed, outputs = "ContinuousBatchingManager", *_via_manager(model, inputs, workload.output_lens,
                                                                              gen_config, cb_config)
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    num_out = sum(len(o.generated_tokens) for o in outputs)
    num_in = sum(len(p) for p in inputs)
    result = {
        "engine": f"transformers {transformers.__version__} continuous batching",
        "api": api,
        "attn_implementation": attn_implementation,
        "continuous_batching_config": cb_kwargs,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_requests": len(inputs),
        "num_finished": len(outputs),
        "errors": errors[:5],
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "requests_per_s": len(outputs) / elapsed,
        "input_tokens_per_s": num_in / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }
    del model
    return result


def _via_generate_batch(model, inputs, gen_config, cb_config) -> tuple[float, list[Any]]:
    kwargs: dict[str, Any] = {"generation_config": gen_config, "progress_bar": False}
    if cb_config is not None and _accepts(model.generate_batch, "continuous_batching_config"):
        kwargs["continuous_batching_config"] = cb_config
    start = time.perf_counter()
    results = model.generate_batch(inputs, **kwargs)
    outputs = list(results.values())
    # The call also builds the manager and warms it up; the requests' own timestamps show when the
    # work started (created_time is set as they are queued) and ended (lifespan[1]).
    first = min((o.created_time for o in outputs if getattr(o, "created_time", 0) > 0), default=None)
    last = max((o.lifespan[1] for o in outputs if getattr(o, "lifespan", (-1, -1))[1] > 0), default=None)
    if first is None or last is None or last <= first or first < start:
        return time.perf_counter() - start, outputs
    return last - first, outputs


def _via_manager(model, inputs, output_lens, gen_config, cb_config) -> tuple[float, list[Any]]:
    init_kwargs: dict[str, Any] = {"generation_config": gen_config}
    if cb_config is not None and _accepts(model.init_continuous_batching, "continuous_batching_config"):
        init_kwargs["continuous_batching_config"] = cb_config
    manager = model.init_continuous_batching(**init_kwargs)
    if hasattr(manager, "warmup"):
        manager.warmup()
    with_eos = _accepts(manager.add_request, "eos_token_id")
    timeout_s = envs.bench_hf_timeout_s()
    start = time.perf_counter()
    manager.start()
    results: dict[str, Any] = {}
    try:
        for i, (ids, n) in enumerate(zip(inputs, output_lens)):
            extra = {"eos_token_id": -1} if with_eos else {}
            manager.add_request(ids, request_id=f"bench-{i}", max_new_tokens=n, **extra)
        while len(results) < len(inputs):
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"HF continuous batching did not finish in {timeout_s:.0f}s "
                                   f"({len(results)}/{len(inputs)} requests)")
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("HF's generation thread stopped early "
                                   f"({len(results)}/{len(inputs)} requests finished)")
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
    return elapsed, list(results.values())
