"""The model runner: scheduler output in, sampled token ids out, for one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from pagedlm.core.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedlm.core.attention.selector import get_attn_backend_cls
from pagedlm.core.config import VllmConfig, kv_cache_torch_dtype
from pagedlm.core.distributed import get_pp_group, pp_forward
from pagedlm.core.forward_context import set_forward_context
from pagedlm.core.kv_cache.spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    attention_spec,
    make_kv_cache_groups,
)
from pagedlm.core.layers import custom_ops
from pagedlm.core.layers.pooler import Pooler
from pagedlm.core.logger import init_logger
from pagedlm.core.model_loader import load_model
from pagedlm.core.multimodal.encoder_runner import EncoderRunner, make_encoder_runner
from pagedlm.core.platforms import HOST, resolve_platform
from pagedlm.core.sample import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    compute_topk_logprobs,
)
from pagedlm.core.sample.logits_processor import BatchLogitsProcessors, build_logitsprocs
from pagedlm.core.sample.logprobs import LogprobsLists
from pagedlm.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedlm.core.structured_output.bitmask import apply_grammar_bitmask
from pagedlm.core.worker.input_batch import InputBatch, StepInputs
from pagedlm.core.worker.prompt_embeds import embedding_body, forward_with_embeddings, gather_step_prompt_embeds

logger = init_logger(__name__)



class AsyncModelRunnerOutput:
    """A step whose sampled tokens may still be on the device; ``result()`` brings them back.

    ``token_ids_host`` ``[S]`` is the destination of a device-to-host copy already queued, and
    ``event`` (if any) completes with it; row ``j`` belongs to ``sample_states[j]``, which sits at
    ``sample_indices[j]`` of the step's ``req_ids``.

    NOTE: a plain result: taking it changes no state. The runner learns its sampled tokens like
    every other worker, from the scheduler output of the request's next step
    (``CachedRequestData.new_token_ids``); until then the device feeds them (async scheduling).
    """

    def __init__(self, req_ids: list[str], prompt_logprobs: dict[str, LogprobsLists], *,
                 sample_indices: np.ndarray | None = None, sample_states: list | None = None,
                 token_ids_host: torch.Tensor | None = None, event: Any | None = None,
                 logprobs: LogprobsTensors | None = None) -> None:
        self.req_ids = req_ids
        self._prompt_logprobs = prompt_logprobs
        self._sample_indices = sample_indices
        self._sample_states = sample_states or []
        self._token_ids_host = token_ids_host
        self._event = event
        self._logprobs = logprobs
        self._output: ModelRunnerOutput | None = None
        #: the worker's KV-connector report for this step (set by the worker), passed on in result()
        self.kv_connector_output: Any = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        """An output that is already on the host."""
        pending = cls(output.req_ids, output.prompt_logprobs)
        pending._output = output
        return pending

    def result(self) -> ModelRunnerOutput:
        if self._output is not None:
            if self.kv_connector_output is not None:
                self._output.kv_connector_output = self.kv_connector_output
            return self._output
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if self._token_ids_host is not None:
            if self._event is not None:
                self._event.synchronize()
            token_ids = self._token_ids_host.tolist()  # the one device-to-host copy of the step
            lp = self._logprobs.tolists() if self._logprobs is not None else None
            column_ranks = None
            if self._logprobs is not None and self._logprobs.column_ranks is not None:
                column_ranks = self._logprobs.column_ranks.tolist()
            assert self._sample_indices is not None
            for j, (i, state) in enumerate(zip(self._sample_indices, self._sample_states)):
                sampled[i] = [token_ids[j]]
                k = state.sampling_params.num_logprob_columns
                if lp is not None and k is not None:
                    explicit = column_ranks is not None and state.sampling_params.logprob_token_ids
                    rank = column_ranks[j][: k + 1] if explicit else lp[2][j]
                    logprobs[state.req_id] = ([lp[0][j][: k + 1]], [lp[1][j][: k + 1]], [rank])
        self._output = ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                         prompt_logprobs=self._prompt_logprobs,
                                         kv_connector_output=self.kv_connector_output)
        return self._output


def _tensor_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in module.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _check_kv_cache_dtype(backend: type[AttentionBackend], cache_dtype: str, device: str) -> None:
    """``ValueError`` naming the backends that can, when ``backend`` cannot hold a ``cache_dtype`` cache."""
    if cache_dtype in backend.supported_kv_cache_dtypes:
        return
    from pagedlm.core.plugins import get_plugins, resolve_class_path

    able = []
    for name, path in sorted(get_plugins().attention_backends().items()):
        try:
            cls = resolve_class_path(path)
        except Exception:  # noqa: BLE001 - a backend that cannot be imported here cannot be suggested
            continue
        devices = getattr(cls, "supported_devices", None)
        if cache_dtype in getattr(cls, "supported_kv_cache_dtypes", ()) and (devices is None or device in devices):
            able.append(name)
    hint = (f"use attention_backend={able[0]!r}" if able else f"no attention backend on {device!r} reads one yet")
    raise ValueError(f"kv_cache_dtype={cache_dtype!r}: attention backend {backend.name!r} cannot read an FP8 KV cache "
                     f"({hint}; or kv_cache_dtype='auto')")


@dataclasses.dataclass
class _DeferredSample:
    """A step's forward, queued, and what sampling it needs: ``logits [S, V]`` of
    ``sample_states``."""

    step: StepInputs
    states: list
    sample_states: list
    logits: torch.Tensor
    prompt_logprobs: dict[str, LogprobsLists]


def _done(output: ModelRunnerOutput, non_block: bool) -> ModelRunnerOutput | AsyncModelRunnerOutput:
    return AsyncModelRunnerOutput.ready(output) if non_block else output


class ModelRunner:
    #: its ``run_model`` feeds prompt embeddings (``enable_prompt_embeds``); a subclass that
    #: replaces ``run_model`` is taken not to, unless it (or a subclass) declares it again
    supports_prompt_embeds: bool = True

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.platform = resolve_platform(vllm_config.device_config.device)
        mc = vllm_config.model_config
        self.dtype: torch.dtype = mc.dtype  # type: ignore[assignment]
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.max_model_len
        self.attn_backend: type[AttentionBackend] = get_attn_backend_cls(vllm_config)
        self.attn_backend.validate(head_size=mc.head_dim, dtype=self.dtype, block_size=self.block_size)
        cache_dtype = vllm_config.cache_config.cache_dtype
        _check_kv_cache_dtype(self.attn_backend, cache_dtype, self.platform.device_name)
        #: the KV cache tensors' dtype (float8_e4m3fn for kv_cache_dtype="fp8")
        self.kv_cache_dtype: torch.dtype = kv_cache_torch_dtype(cache_dtype, self.dtype)
        # NOTE: the platform's layer ops are resolved once, here; the sampler and the model bind
        # them when built (layers.custom_ops), so no forward pass looks them up.
        self.layer_ops = custom_ops.registered_ops(self.platform.device_name)
        with custom_ops.use_ops(self.layer_ops):
            self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        #: the adapters' slots and per-step metadata (pagedlm.core.lora) when LoRA is enabled
        self.lora_manager: Any = None
        #: multimodal models: runs the encoder and keeps its outputs (pagedlm.core.multimodal)
        self.encoder_runner: EncoderRunner | None = None
        self.attention_layers: dict = {}
        #: one tensor per cache slot (kv_cache/spec.py): layer j of every KV-cache group uses slot j
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_groups: list[KVCacheGroupSpec] = [KVCacheGroupSpec((), FullAttentionSpec())]
        #: layer name -> its cache slot
        self.kv_cache_slots: dict[str, int] = {}
        self.input_batch = InputBatch(
            max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            vocab_size=mc.vocab_size,
            device=device,
        )
        self.metadata_builder = self.attn_backend.get_builder_cls()(block_size=self.block_size, device=device)
        self._sampling_key: tuple | None = None
        self._sampling_md: SamplingMetadata | None = None
        # The custom logits processors (LLM(logits_processors=...)) and the batch indices they see.
        procs = build_logitsprocs(vllm_config, device, self.platform.is_pin_memory_available())
        self.logitsprocs: BatchLogitsProcessors | None = BatchLogitsProcessors(procs) if procs else None
        if vllm_config.model_config.enable_prompt_embeds:
            self._check_prompt_embeds_support()
        #: speculative decoding's part (spec_decode/runner.py); None when it is off
        self.spec_decode = None
        if vllm_config.speculative_config is not None:
            from pagedlm.core.spec_decode.runner import SpecDecodeRunner

            self.spec_decode = SpecDecodeRunner(self, vllm_config.speculative_config)
        #: pooling models (runner="pooling"): pools every request's prompt instead of sampling
        self.pooler = Pooler(mc.pooling_type) if mc.runner == "pooling" else None
        #: a step run with ``pending_structured_output_tokens``: its output, or what sampling it
        #: needs (``_DeferredSample``), until ``sample_tokens``
        self._pending_step: Any = None

    def _check_prompt_embeds_support(self) -> None:
        # The class nearest in the MRO that replaces run_model or declares support decides.
        owner = next(c for c in type(self).__mro__
                     if "run_model" in c.__dict__ or "supports_prompt_embeds" in c.__dict__)
        if not owner.__dict__.get("supports_prompt_embeds", False):
            raise ValueError(
                f"enable_prompt_embeds=True is not supported by {type(self).__name__} (its forward pass does not "
                "feed prompt embeddings yet); run on the CPU (device='cpu') or drop enable_prompt_embeds")
        if get_pp_group().world_size > 1:
            raise ValueError("enable_prompt_embeds=True does not work with pipeline parallelism yet "
                             "(pipeline_parallel_size > 1)")

    # -- set-up -----------------------------------------------------------------------------
    def load_model(self) -> None:
        with custom_ops.use_ops(self.layer_ops):
            self.model, self.attention_layers = load_model(self.vllm_config, self.attn_backend, self.device)
        if self.vllm_config.lora_config is not None:
            from pagedlm.core.lora.manager import LoRAModelManager

            self.lora_manager = LoRAModelManager(self.model, self.vllm_config, self.device, layer_ops=self.layer_ops,
                                                 pin_memory=self.platform.is_pin_memory_available())
        #: bytes of this rank's parameters (a tied tensor once)
        self.model_weight_bytes = _tensor_bytes(self.model)
        if self.vllm_config.model_config.enable_prompt_embeds and embedding_body(self.model) is None:
            raise ValueError(f"enable_prompt_embeds=True needs a model whose body embeds its input through "
                             f"model.get_input_embeddings(input_ids); {type(self.model).__name__} has none")
        self.encoder_runner = make_encoder_runner(self.vllm_config, self.model, self.device, self.dtype,
                                                  self.attn_backend)
        # The groups of this rank's layers; the engine core replaces them with the groups of every
        # rank's layers (pipeline stages hold different layers) before sizing the cache.
        self.set_kv_cache_groups(make_kv_cache_groups(self.get_kv_cache_specs()))
        if self.spec_decode is not None:
            self.spec_decode.proposer.load_model()

    def get_kv_cache_specs(self) -> dict[str, AttentionSpec]:
        """Each attention layer's span, in layer order.

        NOTE: groups share cache tensors slot by slot, which needs one K/V shape for every layer;
        a model whose layers differ in shape is reported as all full attention (one group, one
        tensor per layer, no block freed early).
        """
        layers = self.attention_layers
        if len({(layer.num_kv_heads, layer.head_size) for layer in layers.values()}) > 1:
            return {name: FullAttentionSpec() for name in layers}
        return {name: attention_spec(layer.sliding_window) for name, layer in layers.items()}

    def set_kv_cache_groups(self, groups: list[KVCacheGroupSpec]) -> None:
        """Adopt the KV-cache groups (before the cache exists): each layer learns its group, whose
        metadata it reads, and its slot, whose tensor it uses; the batch keeps a table per group."""
        self.kv_cache_groups = groups
        self.kv_cache_slots = {}
        for group_id, group in enumerate(groups):
            for slot, name in enumerate(group.layer_names):
                layer = self.attention_layers.get(name)
                if layer is not None:  # another pipeline stage's layer otherwise
                    layer.kv_cache_group_id = group_id
                    self.kv_cache_slots[name] = slot
        if len(groups) != len(self.input_batch.block_tables):
            ib = self.input_batch
            self.input_batch = InputBatch(max_num_reqs=ib.max_num_reqs, max_model_len=ib.max_model_len,
                                          block_size=ib.block_size, vocab_size=ib.vocab_size, device=ib.device,
                                          num_kv_cache_groups=len(groups))

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.kv_cache_groups)

    def _slot_layers(self) -> dict[int, list]:
        """Cache slot -> this rank's layers using it."""
        slots: dict[int, list] = {}
        for name, layer in self.attention_layers.items():
            slots.setdefault(self.kv_cache_slots[name], []).append(layer)
        return slots

    def _slot_shape(self, layers: list, num_blocks: int) -> tuple[int, ...]:
        layer = layers[0]  # NOTE: layers sharing a slot have one shape (get_kv_cache_specs)
        return self.attn_backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block id costs on this rank: one block of every cache slot."""
        draft = self.spec_decode.proposer.kv_cache_bytes_per_block() if self.spec_decode is not None else 0
        return draft + sum(int(np.prod(self._slot_shape(layers, 1))) * self.kv_cache_dtype.itemsize
                           for layers in self._slot_layers().values())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layers in self._slot_layers().values():
            shape = self._slot_shape(layers, num_blocks)
            cache = self.platform.kv_cache_tensor(shape, self.kv_cache_dtype, self.device)
            for layer in layers:
                layer.kv_cache = cache
            self.kv_caches.append(cache)
        if self.spec_decode is not None:
            self.spec_decode.proposer.initialize_kv_cache(num_blocks)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step. ``non_block=True`` (async scheduling) returns as soon as the step is
        queued on the device; its ``result()`` waits for the sampled tokens. The next step may
        be run before that: tokens still on the device are fed to it there.

        With ``sched.pending_structured_output_tokens`` the step stops before sampling and
        returns None; :meth:`sample_tokens` finishes it with the grammar bitmask."""
        if self._pending_step is not None:
            raise RuntimeError("execute_model called before sample_tokens finished the previous step")
        output = self._execute(sched, non_block)
        if sched.pending_structured_output_tokens:
            self._pending_step = output
            return None
        return output

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Finish the step :meth:`execute_model` left before sampling (vLLM's two-phase step):
        apply ``grammar_output``'s bitmask rows and sample."""
        pending, self._pending_step = self._pending_step, None
        if pending is None:
            raise RuntimeError("sample_tokens called without a step waiting for it")
        if not isinstance(pending, _DeferredSample):  # the step did not sample (or did already)
            return pending
        if grammar_output is not None and grammar_output.grammar_bitmask is not None:
            apply_grammar_bitmask(pending.logits, [s.req_id for s in pending.sample_states],
                                  grammar_output.structured_output_request_ids, grammar_output.grammar_bitmask,
                                  to_device=self.stage_to_device, op=self.layer_ops.get("apply_token_bitmask"))
        return self._sample(pending, non_block)

    def _execute(self, sched: SchedulerOutput, non_block: bool) -> Any:
        batch = self.input_batch
        batch.update(sched)
        if self.lora_manager is not None:
            self.lora_manager.update_requests(sched)
        if self.spec_decode is not None:
            self.spec_decode.write_draft_tokens(sched)
        if self.logitsprocs is not None:
            self.logitsprocs.update(batch.requests, batch.membership_version)
        if sched.total_num_scheduled_tokens == 0:
            return _done(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]), non_block)
        step = batch.prepare(sched)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(step.req_ids, step.num_scheduled)
        assert self.model is not None
        if self.encoder_runner is not None:
            step.mm_embeds = self.encoder_runner.step_embeds(sched, step, batch.requests)
        if get_pp_group().world_size == 1:
            hidden_states = self.run_model(step)
        else:
            metadata, input_ids, positions = self._eager_inputs(step)
            with set_forward_context(metadata):
                pp_hidden = pp_forward(self.model, input_ids, positions, dtype=self.dtype,
                                       hidden_size=self.vllm_config.model_config.hidden_size)
            if pp_hidden is None:
                # A non-last pipeline stage handed its activations on; the last one samples.
                return _done(ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in step.req_ids]),
                             non_block)
            hidden_states = pp_hidden

        states = [batch.requests[r] for r in step.req_ids]
        if self.pooler is not None:
            return _done(self._pool(sched, step, states, hidden_states), non_block)
        prompt_logprobs = self._prompt_logprobs(step, states, hidden_states)
        spec = self.spec_decode
        if spec is not None and sched.scheduled_spec_decode_tokens:
            return _done(spec.verify_and_propose(step, states, hidden_states, sched, prompt_logprobs), non_block)
        if not len(step.sample_indices):
            output = ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in step.req_ids],
                                       prompt_logprobs=prompt_logprobs)
            return _done(output if spec is None else spec.propose(output, step, states), non_block)
        sample_states = [states[i] for i in step.sample_indices]
        logits = self.compute_sample_logits(step, hidden_states)
        deferred = _DeferredSample(step, states, sample_states, logits, prompt_logprobs)
        if sched.pending_structured_output_tokens:
            return deferred  # NOTE: the forward is queued; sample_tokens applies the bitmask
        if sched.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, [s.req_id for s in sample_states], sched.structured_output_request_ids,
                                  sched.grammar_bitmask, to_device=self.stage_to_device,
                                  op=self.layer_ops.get("apply_token_bitmask"))
        return self._sample(deferred, non_block)

    def _sample(self, d: _DeferredSample, non_block: bool) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        out = self.sampler(d.logits, self._sampling_metadata(d.sample_states, d.logits.shape[-1]))
        self.input_batch.set_sampled_on_device(d.sample_states, out.sampled_token_ids)
        token_ids_host, event = self.copy_to_host(out.sampled_token_ids)
        pending = AsyncModelRunnerOutput(
            d.step.req_ids, d.prompt_logprobs, sample_indices=d.step.sample_indices, sample_states=d.sample_states,
            token_ids_host=token_ids_host, event=event, logprobs=out.logprobs_tensors)
        spec = self.spec_decode
        if spec is not None and spec.proposes(non_block):  # (a step without drafts samples as without speculation)
            return _done(spec.propose(pending.result(), d.step, d.states), non_block)
        return pending if non_block else pending.result()

    def _pool(self, sched: SchedulerOutput, step: StepInputs, states: list,
              hidden_states: torch.Tensor) -> ModelRunnerOutput:
        """A pooling model's step: the pooled vectors of the prompts that end in it, no sampling."""
        assert self.pooler is not None
        if sched.finished_req_ids:
            self.pooler.drop(set(self.input_batch.requests) | set(self.input_batch.preempted))
        pooled = self.pooler.pool(step.req_ids, [s.num_prompt_tokens for s in states], step.query_start_loc,
                                  step.num_computed, step.num_scheduled, hidden_states)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=[[] for _ in step.req_ids],
                                 pooler_output=pooled)

    def compute_sample_logits(self, step: StepInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, V]`` float32 of the last token of each sampling request
        (``step.sample_indices``). Extension point: a runner whose graph already computed them
        returns those."""
        assert self.model is not None
        # non_blocking: a blocking copy would make the host wait for the forward pass here
        logits_indices = torch.from_numpy(step.query_start_loc[1:][step.sample_indices] - 1).to(
            self.device, non_blocking=True)
        return self.model.compute_logits(hidden_states[logits_indices])

    def _sampling_metadata(self, sample_states: list, vocab_size: int) -> SamplingMetadata:
        """The sampling metadata of these rows, rebuilt only when the rows change.

        NOTE: in steady decoding the same requests sample step after step; the metadata holds
        their output lists by reference (they grow in place) and their generators, so it stays
        valid until a request joins or leaves the batch (``InputBatch.membership_version``).
        """
        key = (self.input_batch.membership_version, vocab_size, tuple(s.req_id for s in sample_states))
        if key != self._sampling_key:
            self._sampling_key = key
            self._sampling_md = build_sampling_metadata(
                [s.sampling_params for s in sample_states],
                # NOTE: a prompt given as embeddings has placeholder ids: penalties see no prompt
                prompt_token_ids=[s.prompt_token_ids if s.prompt_embeds is None else [] for s in sample_states],
                output_token_ids=[s.output_token_ids for s in sample_states],
                vocab_size=vocab_size,
                device=self.device,
                generators={i: s.generator for i, s in enumerate(sample_states) if s.generator is not None},
            )
            if self.logitsprocs is not None:
                self._sampling_md.logitsprocs = self.logitsprocs.step_view(
                    [s.req_id for s in sample_states], self.device)
        assert self._sampling_md is not None
        return self._sampling_md

    def run_model(self, step: StepInputs) -> torch.Tensor:
        """The forward pass of one (single-stage) step: ``[T, hidden]`` for the step's ``T`` tokens.

        Extension point: device runners override it to feed persistent input buffers and replay
        captured graphs (pagedlm-backend-cuda's ``CudaModelRunner``).
        """
        assert self.model is not None
        metadata, input_ids, positions = self._eager_inputs(step)
        embeds = None
        if self.vllm_config.model_config.enable_prompt_embeds:
            embeds = gather_step_prompt_embeds(step, self.input_batch.requests, self.device, self.dtype)
        if step.mm_embeds is not None:
            embeds = step.mm_embeds
        with set_forward_context(metadata):
            return forward_with_embeddings(self.model, input_ids, positions, embeds)

    def _eager_inputs(self, step: StepInputs) -> tuple[object, torch.Tensor, torch.Tensor]:
        """(attention metadata, input_ids [T], positions [T]) of a step, copied to the device."""
        metadata = self.build_attention_metadata(self._common_metadata(step), step.block_tables, step.slot_mappings)
        input_ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True)
        self.feed_sampled_tokens(input_ids, step)
        positions = torch.from_numpy(step.positions).to(self.device, non_blocking=True)
        return metadata, input_ids, positions

    def feed_sampled_tokens(self, input_ids: torch.Tensor, step: StepInputs) -> None:
        """Write the tokens of the previous step that are still on the device (async scheduling)
        into this step's ``input_ids`` ``[T]`` (on the device, in stream order)."""
        if not len(step.fed_token_indices):
            return
        dev = self.device
        dst = torch.from_numpy(step.fed_token_indices).to(dev, non_blocking=True)
        src = torch.from_numpy(step.fed_sample_indices).to(dev, non_blocking=True)
        sampled = self.input_batch.sampled_on_device
        assert sampled is not None
        input_ids.index_copy_(0, dst, sampled.index_select(0, src))

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any | None]:
        """Start copying ``tensor`` to the host without waiting; returns (host tensor, event to
        wait on before reading it, or None when it is readable at once)."""
        if not self.platform.is_pin_memory_available():
            return tensor.to(HOST), None
        host = tensor.to(HOST, non_blocking=True)
        return host, self.platform.record_event()

    def stage_to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device, copied without waiting where the platform pins memory."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.platform.is_pin_memory_available():
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def release_device_graphs(self) -> None:
        """Drop captured device graphs (sleep mode: they point at memory about to be freed).
        Extension point: a no-op here; device runners that capture graphs override it and
        capture again in ``initialize_kv_cache``."""

    def profile_run(self) -> None:
        """Run the largest step the engine will schedule, before the KV cache exists, so the
        platform can measure the activation peak. Extension point: a no-op here (host memory
        is not sized from a peak); device runners override it."""

    def build_attention_metadata(self, common: CommonAttentionMetadata, block_tables: list,
                                 slot_mappings: list) -> object:
        """The backend metadata of a step: one object for a single KV-cache group, else a list, one
        per group: ``common`` is group 0's; group ``g``'s is ``common`` with ``block_tables[g]`` and
        ``slot_mappings[g]`` (host arrays, or device tensors already in place)."""
        first = self.metadata_builder.build(common)
        if len(block_tables) == 1:
            return first
        return [first] + [self.metadata_builder.build(dataclasses.replace(
            common, block_table=self._on_device(table, torch.int32), slot_mapping=self._on_device(slots, torch.int64)))
            for table, slots in zip(block_tables[1:], slot_mappings[1:], strict=True)]

    def _on_device(self, a: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(a, torch.Tensor):
            return a
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=dtype, non_blocking=True)

    def _common_metadata(self, step: StepInputs) -> CommonAttentionMetadata:
        """The step's metadata with KV-cache group 0's block table and slot mapping."""
        dev = self.device

        def to_dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=dev, dtype=dtype, non_blocking=True)

        qsl_cpu = torch.from_numpy(step.query_start_loc).to(torch.int32)
        seq_lens_cpu = torch.from_numpy(step.seq_lens).to(torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens_cpu.to(dev),
            seq_lens_cpu=seq_lens_cpu,
            num_computed_tokens_cpu=torch.from_numpy(step.num_computed).to(torch.int32),
            block_table=to_dev(np.ascontiguousarray(step.block_tables[0]), torch.int32),
            slot_mapping=to_dev(step.slot_mappings[0], torch.int64),
            num_reqs=len(step.req_ids),
            num_actual_tokens=int(step.query_start_loc[-1]),
            max_query_len=int(step.num_scheduled.max()),
            max_seq_len=int(step.seq_lens.max()),
            bidirectional_spans=(self.encoder_runner.bidirectional_spans(step, self.input_batch.requests)
                                 if self.encoder_runner is not None else None),
        )

    def _prompt_logprobs(self, step: StepInputs, states: list, hidden_states: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1..P-1, computed chunk by chunk and sent when the prompt ends."""
        done: dict[str, LogprobsLists] = {}
        assert self.model is not None
        for i, state in enumerate(states):
            k = state.sampling_params.prompt_logprobs
            if k is None or state.prompt_logprobs_sent:
                continue
            start = int(step.num_computed[i])
            end = min(start + int(step.num_scheduled[i]), state.num_prompt_tokens - 1)
            if end > start:
                rows = int(step.query_start_loc[i]) + torch.arange(end - start, device=self.device)
                logits = self.model.compute_logits(hidden_states[rows])
                targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
                tensors = compute_topk_logprobs(torch.log_softmax(logits.float(), dim=-1), k, targets)
                state.prompt_logprobs_parts.append(tensors.tolists())
            if start + int(step.num_scheduled[i]) >= state.num_prompt_tokens:
                parts = state.prompt_logprobs_parts
                done[state.req_id] = (
                    [x for p in parts for x in p[0]], [x for p in parts for x in p[1]], [x for p in parts for x in p[2]]
                )
                state.prompt_logprobs_parts = []
                state.prompt_logprobs_sent = True
        return done
