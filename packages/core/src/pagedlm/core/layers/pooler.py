"""Pooling models (vLLM's ``runner="pooling"``): one vector per prompt from the model's hidden states.

A pooling request is a prompt only: the scheduler runs its prefill (in chunks, like any prompt)
and the request finishes with the step that computes its last prompt token; it never decodes.
The model runner hands each step's hidden states ``[T, hidden]`` to :class:`Pooler`, which
gathers what the pooling type needs over the prompt's chunks and returns the pooled vector when
the prompt is done:

- ``LAST``: the last prompt token's hidden state (decoder embedding models);
- ``MEAN``: the mean over every prompt token;
- ``CLS``: the first token's.

The vector leaves the worker raw (float32, unnormalized); normalization and matryoshka
truncation (``dimensions``) are per request and happen in the front end
(``PoolingParams.finish``).

Which pooling a checkpoint uses comes from its sentence-transformers files (``modules.json``,
the Pooling module's ``config.json``, a ``Normalize`` module) unless ``PoolerConfig`` overrides it;
without them decoder models pool the LAST token and normalize, as vLLM's embedding adapter does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")

# sentence-transformers' pooling modes -> pooling types (the others are refused by name)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_MODE_NAMES = {"lasttoken": "LAST", "last": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
# module classes by name: sentence-transformers writes "sentence_transformers.models.Pooling" or,
# in newer versions, "sentence_transformers.base.modules.pooling.Pooling"
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class PoolerConfig:
    """vLLM's ``PoolerConfig``: overrides of the checkpoint's pooling (``None``: the checkpoint's)."""

    #: LAST, MEAN or CLS
    pooling_type: str | None = None
    #: L2-normalize embeddings (a request's ``PoolingParams.normalize`` overrides it)
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = str(self.pooling_type).upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type={self.pooling_type!r} is not one of "
                                 f"{', '.join(POOLING_TYPES)}")

    @classmethod
    def from_any(cls, value: PoolerConfig | dict[str, Any] | None) -> PoolerConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"pooling_type", "normalize"})
            if unknown:
                raise ValueError(f"pooler_config has unknown fields {unknown}; allowed: pooling_type, normalize")
            return cls(**value)
        raise ValueError(f"pooler_config={value!r} must be a PoolerConfig or a dict")


def read_sentence_transformers_pooling(model_dir: str | None) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers checkpoint, (None, None) without one.

    Raises ValueError for modules this engine cannot run (Dense layers, max pooling, ...)."""
    path = os.path.join(model_dir, "modules.json") if model_dir and os.path.isdir(model_dir) else None
    if path is None or not os.path.isfile(path):
        return None, None
    with open(path) as f:
        modules = json.load(f)
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in _ST_MODULES:
            raise ValueError(f"{path} names the sentence-transformers module {kind!r}, which pagedlm does not run "
                             f"(supported: {', '.join(_ST_MODULES)})")
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                config = json.load(f)
            if "pooling_mode" in config:  # newer sentence-transformers: one name
                mode = str(config["pooling_mode"]).lower()
                known = _ST_MODE_NAMES.get(mode)
                bad, modes = ([], [known]) if known else ([f"pooling_mode={mode!r}"], [])
            else:  # one boolean per mode
                bad = [m for m in _ST_UNSUPPORTED_MODES if config.get(m)]
                modes = [t for m, t in _ST_MODES.items() if config.get(m)]
            if bad or len(modes) != 1:
                raise ValueError(f"the checkpoint's pooling modes {bad + modes} are not supported: exactly one of "
                                 "last token, mean or CLS pooling must be set")
            if config.get("include_prompt") is False:
                raise ValueError("the checkpoint's pooling has include_prompt=false, which pagedlm does not support")
            pooling_type = modes[0]
    return pooling_type, normalize


def resolve_pooling(model_dir: str | None, override: PoolerConfig) -> tuple[str, bool]:
    """The (pooling type, default normalize) a pooling model runs with."""
    st_type, st_normalize = read_sentence_transformers_pooling(model_dir)
    pooling_type = override.pooling_type or st_type or "LAST"
    normalize = override.normalize if override.normalize is not None else (
        st_normalize if st_normalize is not None else True)
    return pooling_type, normalize


class Pooler:
    """Per-step pooling of a pooling model's hidden states (the model runner's side)."""

    def __init__(self, pooling_type: str) -> None:
        assert pooling_type in POOLING_TYPES, pooling_type
        self.pooling_type = pooling_type
        #: req_id -> (float32 sum of the hidden states so far, for MEAN; the CLS row, for CLS)
        self._partial: dict[str, torch.Tensor] = {}

    def pool(self, req_ids: list[str], num_prompt_tokens: list[int], query_start_loc: Any, num_computed: Any,
             num_scheduled: Any, hidden_states: torch.Tensor) -> dict[str, list[float]]:
        """The pooled vectors (``[hidden]`` as a list of floats) of the requests whose prompt ends
        in this step. ``hidden_states`` is ``[T, hidden]``; request ``i``'s rows are
        ``query_start_loc[i]:query_start_loc[i + 1]``, at positions ``num_computed[i]`` onwards."""
        done_ids: list[str] = []
        vectors: list[torch.Tensor] = []
        partial = self._partial
        for i, req_id in enumerate(req_ids):
            start, count = int(num_computed[i]), int(num_scheduled[i])
            first = int(query_start_loc[i])
            rows = hidden_states[first : first + count]
            if start == 0:
                partial.pop(req_id, None)  # a new prompt, or one recomputed after preemption
            if self.pooling_type == "MEAN":
                chunk_sum = rows.float().sum(dim=0)
                partial[req_id] = partial[req_id] + chunk_sum if req_id in partial else chunk_sum
            elif self.pooling_type == "CLS" and start == 0:
                partial[req_id] = rows[0].float()
            if start + count < num_prompt_tokens[i]:
                continue
            if self.pooling_type == "LAST":
                vector = rows[-1].float()
            elif self.pooling_type == "MEAN":
                vector = partial.pop(req_id) / num_prompt_tokens[i]
            else:
                vector = partial.pop(req_id)
            done_ids.append(req_id)
            vectors.append(vector)
        if not vectors:
            return {}
        # one device-to-host copy for the step
        return dict(zip(done_ids, torch.stack(vectors).cpu().tolist()))

    def drop(self, keep: set[str]) -> None:
        """Forget the partial state of requests not in ``keep`` (finished or aborted mid-prompt)."""
        for req_id in [r for r in self._partial if r not in keep]:
            del self._partial[req_id]
