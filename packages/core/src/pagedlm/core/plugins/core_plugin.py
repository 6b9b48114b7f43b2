"""pagedlm-core's own hook implementations: the built-in quantization methods, KV connectors, the
xgrammar structured-output backend, the ``<think>`` reasoning parsers and the speculative-decoding
proposers.

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
    register("gguf", f"{_QUANT}.gguf:GGUFConfig")
    register("int8", f"{_QUANT}.int8:Int8Config")


_KVT = "pagedlm.core.distributed.kv_transfer"


@hookimpl
def pagedlm_register_kv_connectors(register: Callable[..., None]) -> None:
    register("SharedStorageConnector", f"{_KVT}.shared_storage_connector:SharedStorageConnector")
    register("P2pConnector", f"{_KVT}.p2p_connector:P2pConnector")
    register("OffloadingConnector", f"{_KVT}.offloading_connector:OffloadingConnector")


@hookimpl
def pagedlm_register_structured_output_backends(register: Callable[..., None]) -> None:
    register("xgrammar", "pagedlm.core.structured_output.xgrammar_backend:XgrammarBackend")


@hookimpl
def pagedlm_register_reasoning_parsers(register: Callable[..., None]) -> None:
    register("deepseek_r1", "pagedlm.core.reasoning.think:DeepSeekR1ReasoningParser")
    register("qwen3", "pagedlm.core.reasoning.think:Qwen3ReasoningParser")


_SPEC = "pagedlm.core.spec_decode"


@hookimpl
def pagedlm_register_spec_proposers(register: Callable[..., None]) -> None:
    register("ngram", f"{_SPEC}.ngram_proposer:NgramProposer")
    register("draft_model", f"{_SPEC}.draft_model_proposer:DraftModelProposer")
