"""``SpeculativeConfig``: vLLM's speculative-decoding options (``LLM(speculative_config={...})``,
``--speculative-config JSON``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

#: the built-in methods (plugins may register more: ``pagedlm_register_spec_proposers``)
BUILTIN_METHODS = ("ngram", "draft_model")
#: what vLLM sets for an n-gram config naming neither lookup bound
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts ``num_speculative_tokens`` tokens per request and
    step, the target model scores them in the same forward pass, and verification keeps exactly
    the target's distribution (docs/speculative.md).

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier occurrence
    of the request's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens), ``"draft_model"``
    (a smaller ``model`` with the target's vocabulary drafts greedily), or a method a plugin
    registered. A ``model`` given without ``method`` means ``"draft_model"`` (as vLLM reads it).
    ``disable_by_batch_size``: no drafts in a step with at least this many running requests (a
    busy batch gains nothing from them); None: always speculate.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config needs a method ('ngram', 'draft_model' or a registered "
                                 "proposer's name) or a draft model (speculative_config.model=PATH)")
            method = "draft_model"
        if not isinstance(method, str) or not method:
            raise ValueError(f"speculative_config.method={method!r} is invalid: must be a proposer name "
                             f"such as {', '.join(map(repr, BUILTIN_METHODS))}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} is invalid: must be an integer >= 1 "
                             "(the draft tokens per request and step)")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config.{name}={value!r} is invalid: must be an integer >= 1 or null")
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.model is not None:
                raise ValueError(f"speculative_config.model={self.model!r} is not used by method='ngram' "
                                 "(drafts come from the request's own tokens); drop it or use method='draft_model'")
        else:
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is only read by method='ngram' "
                                     f"(got method={method!r})")
        if method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.method='draft_model' needs speculative_config.model "
                                 "(a local model directory or .gguf file with the target's vocabulary)")
            if not os.path.exists(os.path.expanduser(self.model)):
                raise ValueError(f"speculative_config.model={self.model!r} does not exist: pass a local model "
                                 "directory or .gguf file")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond its scheduled tokens: a draft model writes the K/V of the
        token just sampled and of its own drafts but the last one, ahead of the target."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0  # type: ignore[return-value]

    def speculates(self, num_running_reqs: int) -> bool:
        """Whether a step with this many running requests gets drafts (``disable_by_batch_size``)."""
        return self.disable_by_batch_size is None or num_running_reqs < self.disable_by_batch_size

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A config from a ``SpeculativeConfig``, a dict of its fields (unknown ones refused by
        name), or None (speculation off)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a dict of SpeculativeConfig fields "
                             "(or a JSON object on the command line)")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; allowed: {allowed}")
        return cls(**value)


def check_speculative_config(vllm_config: Any) -> None:
    """What speculation needs from the rest of the engine configuration (``VllmConfig.finalize``):
    a registered method, one pipeline stage, no custom logits processors, and, for a method whose
    proposer follows every step (a draft model), synchronous scheduling. Other methods keep async
    scheduling: their steps with drafts run synchronously (spec_decode/engine_step.py)."""
    from pagedlm.core.spec_decode.proposer import get_proposer_cls

    spec = vllm_config.speculative_config
    proposer_cls = get_proposer_cls(str(spec.method))
    pc, sc = vllm_config.parallel_config, vllm_config.scheduler_config
    if pc.pipeline_parallel_size > 1:
        raise ValueError("speculative_config does not work with pipeline_parallel_size > 1 yet")
    if spec.method == "draft_model" and pc.world_size > 1:
        raise ValueError("speculative_config.method='draft_model' runs on one rank only (tensor_parallel_size=1)")
    if vllm_config.model_config.logits_processors:
        raise ValueError("speculative_config does not work with logits_processors yet (verification samples "
                         "several positions per request)")
    if not proposer_cls.needs_every_step:
        return
    if sc.async_scheduling:
        raise ValueError(f"speculative_config.method={spec.method!r} needs async_scheduling off (its proposer "
                         "follows every step's tokens on the host); drop async_scheduling=True")
    sc.async_scheduling = False
