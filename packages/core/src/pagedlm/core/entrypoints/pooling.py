"""``LLM.encode`` / ``LLM.embed`` / ``LLM.score``: the offline API of pooling models (vLLM's names).

Every prompt is validated before any is queued; the requests then share the engine's scheduler
like generation requests (prefill only: each finishes with its prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedlm.core.engine.processor import PromptType
from pagedlm.core.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedlm.core.pooling_params import PoolingParams, pooling_request

if TYPE_CHECKING:
    from pagedlm.core.entrypoints.llm import LLM


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def encode(llm: LLM, prompts: PromptType | Sequence[PromptType],
           pooling_params: PoolingParams | Sequence[PoolingParams] | None, *, use_tqdm: bool,
           pooling_task: str | None, priority: list[int] | None) -> list[PoolingRequestOutput]:
    prompts = _as_list(prompts)
    if pooling_params is None:
        pooling_params = PoolingParams()
    params_list = [pooling_params] * len(prompts) if isinstance(pooling_params, PoolingParams) \
        else list(pooling_params)
    if len(params_list) != len(prompts):
        raise ValueError(f"pooling_params has {len(params_list)} entries but there are {len(prompts)} prompts; "
                         "pass one PoolingParams or one per prompt")
    if priority is not None and len(priority) != len(prompts):
        raise ValueError(f"priority has {len(priority)} entries but there are {len(prompts)} prompts")
    if pooling_task is not None:
        params_list = [PoolingParams(dimensions=p.dimensions, normalize=p.normalize, task=pooling_task)
                       for p in params_list]
    engine = llm.llm_engine
    mc = engine.vllm_config.model_config
    priorities = priority or [0] * len(prompts)
    processed = [
        (*pooling_request(engine.processor, mc, str(next(llm._request_counter)), prompt, params, priority=p), params)
        for prompt, params, p in zip(prompts, params_list, priorities)
    ]
    request_ids = []
    for core_request, text, params in processed:
        engine.add_processed_request(core_request, text, pooling_params=params)
        request_ids.append(core_request.request_id)
    finished: dict[str, Any] = {}
    pbar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if pbar is not None:
                        pbar.update(1)
    except BaseException:
        engine.abort_request([r for r in request_ids if r not in finished])
        raise
    finally:
        if pbar is not None:
            pbar.close()
    results = [finished[r] for r in request_ids]
    for out in results:
        if isinstance(out, RequestOutput):  # failed (or aborted) before its prompt was pooled
            raise RuntimeError(f"pooling request {out.request_id} failed: {out.error or 'aborted'}")
    return results


def embed(llm: LLM, prompts: PromptType | Sequence[PromptType],
          pooling_params: PoolingParams | Sequence[PoolingParams] | None, *, use_tqdm: bool,
          priority: list[int] | None) -> list[EmbeddingRequestOutput]:
    outputs = encode(llm, prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed", priority=priority)
    return [EmbeddingRequestOutput.from_base(o) for o in outputs]


def score(llm: LLM, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType], *,
          use_tqdm: bool) -> list[ScoringRequestOutput]:
    """Cosine similarity of the embeddings of ``data_1[i]`` and ``data_2[i]``; one ``data_1`` is
    compared with every ``data_2`` (vLLM's rule for embedding models)."""
    import torch

    first, second = _as_list(data_1), _as_list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side (data_1 and data_2)")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"data_1 has {len(first)} entries and data_2 {len(second)}: pass one data_1 or as many "
                         "as data_2")
    outputs = encode(llm, first + second, PoolingParams(normalize=True), use_tqdm=use_tqdm, pooling_task="embed",
                     priority=None)
    n = len(first)
    results = []
    for a, b in zip(outputs[:n], outputs[n:]):
        similarity = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
        results.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(float(similarity)),
                                            a.prompt_token_ids + b.prompt_token_ids))
    return results
