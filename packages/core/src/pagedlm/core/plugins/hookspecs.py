"""The pagedlm hook specifications: the whole public plugin contract.

Every hook is keyword-only. Registration hooks receive a ``register`` callback rather than
returning values, so that new optional arguments can be added to ``register`` later without
breaking existing plugins. A plugin implements any subset of these hooks in a module named by
an entry point in group ``pagedlm`` (see docs/plugins.md).

Every ``register`` callback also takes ``override=False`` (keyword only): a name claimed by two
plugins is an error naming both, unless one of them passes ``override=True`` to replace the other
on purpose. Implementations run in pluggy's order (``tryfirst=True`` first, ``trylast=True``
last); of two overrides of one name the first called wins. The contract's version is
``pagedlm.core.plugins.API_VERSION``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pagedlm.core.config import VllmConfig

hookspec = pluggy.HookspecMarker("pagedlm")


@hookspec
def pagedlm_register_models(register: Callable[[str, str], None]) -> None:
    """Register model classes by HF architecture name.

    Call ``register(architecture, class_path)`` once per architecture, e.g.
    ``register("LlamaForCausalLM", "pagedlm.models.llama.modeling:LlamaForCausalLM")``.
    The class is imported only when a checkpoint's ``config.json`` names the architecture.
    It must be constructible as ``Cls(vllm_config=..., prefix="")``. Returns nothing.
    """


@hookspec
def pagedlm_register_multimodal_processors(register: Callable[[str, str], None]) -> None:
    """Register the input processors of multimodal (e.g. vision-language) models.

    Call ``register(architecture, class_path)``: ``architecture`` is an HF ``architectures`` name
    the model is also registered under (``pagedlm_register_models``); ``class_path`` is a
    ``"module:Class"`` string naming a
    :class:`pagedlm.core.multimodal.processing.BaseMultiModalProcessor` subclass (image
    preprocessing and placeholder expansion through HF's ``AutoProcessor``, placeholder tokens per
    item, dummy items for profiling), imported only when such a model is used. The model class then
    takes ``multi_modal_data`` and implements ``embed_multimodal`` (docs/multimodal.md). Returns
    nothing.
    """


@hookspec
def pagedlm_register_platforms(register: Callable[..., None]) -> None:
    """Register hardware platforms.

    Call ``register(name, class_path, is_available, priority=0)``: ``name`` is the device
    name users pass as ``device=`` (``"cpu"``, ``"cuda"``); ``class_path`` points at a
    :class:`pagedlm.core.platforms.Platform` subclass; ``is_available`` is a cheap callable
    returning ``bool`` (it must not initialise the device); ``device="auto"`` picks the
    available platform with the highest ``priority``. Returns nothing.
    """


@hookspec
def pagedlm_register_attention_backends(register: Callable[[str, str], None]) -> None:
    """Register attention backends.

    Call ``register(name, class_path)`` where ``class_path`` points at a
    :class:`pagedlm.core.attention.AttentionBackend` subclass. Platforms pick a backend by
    name (``Platform.get_attn_backend_name``); users may force one with
    ``attention_backend=NAME``. Returns nothing.
    """


@hookspec
def pagedlm_add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``pagedlm`` command line.

    Receives the ``argparse`` subparsers object of the top-level parser. Add a parser with
    ``subparsers.add_parser(name, ...)`` and set its ``func`` default to a callable taking the
    parsed ``argparse.Namespace`` and returning an exit code. Returns nothing.
    """


@hookspec
def pagedlm_check_and_update_config(vllm_config: VllmConfig) -> None:
    """Validate or adjust an engine configuration before the engine is built.

    Called once, in the front end (``VllmConfig.finalize``), before any engine process starts and
    before the config is frozen; called for every plugin, after the platform's own
    ``check_and_update_config``. Raise
    ``ValueError`` with an actionable message to refuse a configuration; mutate fields to adjust
    it. Returns nothing.
    """


@hookspec
def pagedlm_default_model(register: Callable[..., None]) -> None:
    """Offer a model to run when the user names none (``LLM()``, ``pagedlm generate "..."``).

    Call ``register(name, resolve, priority=0, install_hint=None)``: ``name`` is what users are
    told they are running (e.g. ``"Gemma 3 270M (Q4_K_M GGUF)"``); ``resolve`` is a
    ``"module:function"`` string (imported only when a default model is actually needed) naming a
    function that takes no arguments and returns the local path of the model (an HF directory or
    a ``.gguf`` file), preparing it first if needed (e.g. assembling it into the pagedlm cache),
    or returns None when the model's files are not installed; ``install_hint`` then tells the
    user how to install them. The highest ``priority`` whose ``resolve`` returns a path wins.
    Returns nothing.
    """


@hookspec
def pagedlm_register_ops(register: Callable[..., None]) -> None:
    """Register a platform's implementation of a layer op (RMSNorm, rotary embedding, ...).

    Call ``register(op_name, platform_name, function_path)``: ``op_name`` is a contract of
    :data:`pagedlm.core.layers.custom_ops.OP_CONTRACTS` (or a dotted ``"yourplugin.op"`` name your
    own layers use); ``platform_name`` is a registered platform's name (``"cuda"``);
    ``function_path`` is a ``"module:function"`` string, imported only when a model is built on
    that platform. The function must keep the op's contract, dtype rounding included. Layers
    built on other platforms keep core's torch implementation. Returns nothing.
    """


@hookspec
def pagedlm_register_quantization_methods(register: Callable[..., None]) -> None:
    """Register quantization methods by name.

    Call ``register(name, class_path)``: ``name`` is what users pass as ``quantization=`` and what a
    checkpoint's ``config.json`` names as ``quantization_config.quant_method`` (``"fp8"``,
    ``"compressed-tensors"``, ``"gptq"``, ``"awq"``); ``class_path`` is a ``"module:Class"`` string
    naming a :class:`pagedlm.core.layers.quantization.QuantizationConfig` subclass, imported only
    when a model uses the method. The class parses the checkpoint's ``quantization_config``
    (``from_config``) and gives each linear layer, by its module path, a quantize method
    (``get_quant_method(layer, prefix)``) that creates the layer's parameters and computes its
    matmul. pagedlm-core registers its built-in methods through this same hook. Returns nothing.
    """


@hookspec
def pagedlm_register_kv_connectors(register: Callable[..., None]) -> None:
    """Register KV connectors (KV transfer between the paged cache and elsewhere) by name.

    Call ``register(name, class_path)``: ``name`` is what users pass as
    ``kv_transfer_config={"kv_connector": name, ...}`` (``--kv-transfer-config``); ``class_path``
    is a ``"module:Class"`` string naming a
    :class:`pagedlm.core.distributed.kv_transfer.base.KVConnectorBase_V1` subclass, imported only
    when an engine uses it, once per role (``Cls(vllm_config, role, kv_cache_config)``: a
    scheduler half in the engine core, a worker half in each worker). pagedlm-core registers its
    built-in connectors (SharedStorageConnector, P2pConnector, OffloadingConnector) through this
    same hook. Returns nothing.
    """


@hookspec
def pagedlm_register_structured_output_backends(register: Callable[..., None]) -> None:
    """Register grammar engines for structured outputs by name.

    Call ``register(name, class_path)``: ``name`` is what users pass as
    ``structured_outputs_config={"backend": name}``; ``class_path`` is a ``"module:Class"`` string
    naming a :class:`pagedlm.core.structured_output.backend.StructuredOutputBackend` subclass,
    imported only when a request asks for a grammar (in the engine core) or is validated (in the
    front end). ``"auto"`` means ``"xgrammar"``, which pagedlm-core registers through this same
    hook. Returns nothing.
    """


@hookspec
def pagedlm_register_reasoning_parsers(register: Callable[..., None]) -> None:
    """Register reasoning parsers (``--reasoning-parser NAME``) by name.

    Call ``register(name, class_path)``: ``class_path`` is a ``"module:Class"`` string naming a
    :class:`pagedlm.core.reasoning.ReasoningParser` subclass, built as ``Cls(tokenizer)``. It splits
    a reasoning model's output into thinking and answer, and tells the structured-output manager
    where the thinking ends. pagedlm-core registers ``deepseek_r1`` and ``qwen3``. Returns nothing.
    """


@hookspec
def pagedlm_register_tool_parsers(register: Callable[..., None]) -> None:
    """Register tool-call parsers (``--tool-call-parser NAME``) by name.

    Call ``register(name, class_path)``: ``class_path`` is a ``"module:Class"`` string naming a
    :class:`pagedlm.server.tool_parsers.ToolParser` subclass, built as ``Cls(tokenizer)``; it finds
    the tool calls in a model's output (whole, and incrementally for streams) for
    ``tool_choice="auto"``. pagedlm-server registers ``hermes``, ``qwen3`` (hermes-style
    ``<tool_call>`` tags), ``llama3_json`` and ``mistral``. Returns nothing.
    """


@hookspec
def pagedlm_register_spec_proposers(register: Callable[..., None]) -> None:
    """Register speculative-decoding methods by name.

    Call ``register(method, class_path)``: ``method`` is what users pass as
    ``speculative_config={"method": ...}`` (``"ngram"``, ``"draft_model"``); ``class_path`` is a
    ``"module:Class"`` string naming a :class:`pagedlm.core.spec_decode.proposer.SpecProposer`
    subclass, imported only when an engine speculates with it. The proposer runs in every model
    runner and returns each request's draft tokens after every step; verification keeps the
    target's distribution whatever it proposes. pagedlm-core registers its built-in methods
    through this same hook. Returns nothing.
    """
