"""pagedlm-core's own hook implementations: the built-in quantization methods and
speculative-decoding proposers.

Registered by :class:`pagedlm.core.plugins.Plugins` under the name ``"core"`` whatever the
autoload settings, through the same hooks as any plugin (so a plugin can replace a built-in
method with ``override=True``). Only class-path strings here: nothing is imported until used.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl

_QUANT = "pagedlm.core.layers.quantization"


@hookimpl
def pagedlm_register_quantization_methods(register: Callable[..., None]) -> None:
    register("fp8", f"{_QUANT}.fp8:Fp8Config")
    register("compressed-tensors", f"{_QUANT}.compressed_tensors:CompressedTensorsConfig")
    register("gptq", f"{_QUANT}.gptq:GPTQConfig")
    register("awq", f"{_QUANT}.awq:AWQConfig")


_SPEC = "pagedlm.core.spec_decode"


@hookimpl
def pagedlm_register_spec_proposers(register: Callable[..., None]) -> None:
    register("ngram", f"{_SPEC}.ngram_proposer:NgramProposer")
    register("draft_model", f"{_SPEC}.draft_model_proposer:DraftModelProposer")
