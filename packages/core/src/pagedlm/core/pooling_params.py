"""``PoolingParams``: what a pooling request asks for (vLLM's class of the same name).

The workers return each prompt's raw pooled vector; the front end finishes it per request with
:meth:`PoolingParams.finish` (matryoshka truncation to ``dimensions``, then L2 normalization).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the pooling tasks served: "embed" (one normalized vector per prompt) and "encode" (the raw
#: pooled vector, normalized only when ``normalize=True``)
POOLING_TASKS = ("embed", "encode")


@dataclass
class PoolingParams:
    #: keep the first ``dimensions`` values (matryoshka models only)
    dimensions: int | None = None
    #: L2-normalize; None: the model's default (its sentence-transformers Normalize module or
    #: ``PoolerConfig.normalize``) for "embed", off for "encode"
    normalize: bool | None = None
    #: "embed" or "encode"; None: "embed"
    task: str | None = None

    def verify(self, model_config: Any) -> None:
        """Raise ValueError (naming the parameter) when this model cannot honour these params."""
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not a pooling task this engine serves; allowed: "
                             f"{', '.join(POOLING_TASKS)}")
        if self.dimensions is None:
            return
        name = model_config.name
        if not model_config.is_matryoshka:
            raise ValueError(f"dimensions={self.dimensions} is not supported: model {name!r} does not support "
                             "matryoshka representation (its config.json sets neither is_matryoshka nor "
                             "matryoshka_dimensions), so its embeddings cannot be shortened")
        allowed = getattr(model_config.hf_config, "matryoshka_dimensions", None)
        if allowed and self.dimensions not in allowed:
            raise ValueError(f"dimensions={self.dimensions} is not supported by model {name!r}; allowed: "
                             f"{', '.join(str(d) for d in allowed)}")
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or \
                not 1 <= self.dimensions <= model_config.hidden_size:
            raise ValueError(f"dimensions={self.dimensions!r} must be an integer in [1, "
                             f"{model_config.hidden_size}] (the model's hidden size)")

    def finish(self, raw: list[float], model_normalize: bool) -> Any:
        """The request's output tensor ``[dimensions or hidden]`` (float32) from the raw pooled vector."""
        import torch

        data = torch.tensor(raw, dtype=torch.float32)
        if self.dimensions is not None:
            data = data[: self.dimensions]
        normalize = self.normalize
        if normalize is None:
            normalize = model_normalize and (self.task or "embed") == "embed"
        if normalize:
            data = torch.nn.functional.normalize(data, p=2, dim=-1)
        return data


def check_runner(model_config: Any, runner: str, api: str) -> None:
    """ValueError when ``api`` (e.g. "LLM.embed") needs the other kind of model, as vLLM refuses it."""
    if model_config.runner == runner:
        return
    if runner == "pooling":
        raise ValueError(f"{api} needs a pooling (embedding) model, but {model_config.name!r} runs as a generative "
                         "model; start it with runner='pooling' (--runner pooling, or task='embed' / "
                         "convert='embed')")
    raise ValueError(f"{api} needs a generative model, but {model_config.name!r} runs as a pooling model "
                     "(runner='pooling'); use LLM.embed / encode / score (the server's /v1/embeddings), or "
                     "start it with runner='generate'")


def pooling_request(processor: Any, model_config: Any, request_id: str, prompt: Any, params: PoolingParams, *,
                    priority: int = 0) -> tuple[Any, str | None]:
    """A validated engine request for one pooling prompt: (EngineCoreRequest, prompt text).

    NOTE: it carries plain SamplingParams of one token: the scheduler runs the prompt, the
    workers pool it and the request finishes there; nothing is ever sampled."""
    from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams

    check_runner(model_config, "pooling", "pooling (encode/embed/score)")
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
    params.verify(model_config)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)
    return processor.process(request_id, prompt, sampling, priority=priority)
