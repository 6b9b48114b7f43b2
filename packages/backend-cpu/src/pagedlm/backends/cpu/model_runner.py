"""The CPU platform's model runner: decode steps of a few requests replay a CPU graph.

Single-stream decode of a small model spends about half its step in the Python of the forward
(Gemma 3 270M: ~6 ms of ~20, ~25 module and op calls a layer); ``kernels/graph.py`` records the
forward's kernel calls once and replays them. Decode-only steps of ``B <=
PAGEDLM_CPU_GRAPH_MAX_BATCH`` requests (4 by default) each have a graph, captured at the first
such step of that ``B`` on static input buffers (token ids, positions, and per KV-cache group the
block table rows, slot mapping and query positions of the ``cpu_paged`` decode kernel), with the
LM head in the graph too (every request of a decode step samples), then
checked: at the second such step the replay's hidden states and logits must equal an eager
forward's bit for bit, or graphs are switched off for the process with a warning. Everything else runs eagerly, as
does everything with ``enforce_eager=True``.

NOTE: a graph holds raw pointers to the weights and the KV cache: it is dropped whenever either
may move (``initialize_kv_cache``, ``release_device_graphs`` for sleep mode, ``load_model``).
"""

from __future__ import annotations

import torch

from pagedlm.backends.cpu.attention import CpuAttentionGroup, CpuAttentionMetadata, CpuPagedAttentionImpl
from pagedlm.backends.cpu.kernels.graph import CaptureError, CpuGraph
from pagedlm.backends.cpu.platform import cpu_graph_max_batch
from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed.kv_transfer.worker_step import get_active_kv_connector
from pagedlm.core.forward_context import set_forward_context
from pagedlm.core.logger import init_logger
from pagedlm.core.worker.input_batch import StepInputs
from pagedlm.core.worker.model_runner import ModelRunner
from pagedlm.core.worker.prompt_embeds import forward_with_embeddings

logger = init_logger(__name__)

__all__ = ["CpuModelRunner"]


class _DecodeGraph:
    """The static inputs of the decode steps of ``B`` requests and their graph."""

    def __init__(self, num_reqs: int, num_groups: int, max_blocks: int, block_size: int) -> None:
        self.input_ids = torch.zeros(num_reqs, dtype=torch.int64)
        self.positions = torch.zeros(num_reqs, dtype=torch.int64)
        rows = torch.arange(num_reqs)
        self.block_tables = [torch.zeros(num_reqs, max_blocks, dtype=torch.int32) for _ in range(num_groups)]
        self.slot_mappings = [torch.zeros(num_reqs, dtype=torch.int64) for _ in range(num_groups)]
        self.seq_lens = torch.ones(num_reqs, dtype=torch.int64)
        self.query_pos = self.positions.view(num_reqs, 1)  # a decode's query sits at its position
        self.metadata = [
            CpuAttentionMetadata(
                num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=0,
                query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32), seq_lens=self.seq_lens,
                block_table=table, slot_mapping=slots, num_decodes=num_reqs,
                groups=[CpuAttentionGroup(query_index=rows[:, None], query_valid=None, out_index=rows,
                                          query_pos=self.query_pos, block_table=table, seq_lens=self.seq_lens,
                                          block_size=block_size, max_seq_len=0)])
            for table, slots in zip(self.block_tables, self.slot_mappings, strict=True)
        ]
        self.graph: CpuGraph | None = None
        self.verified = False

    def stage(self, step: StepInputs) -> None:
        """Copy the step's inputs into the static buffers (the graph reads them in place)."""
        self.input_ids.numpy()[:] = step.input_ids
        self.positions.numpy()[:] = step.positions
        self.seq_lens.numpy()[:] = step.seq_lens
        for table, slots, step_table, step_slots in zip(self.block_tables, self.slot_mappings, step.block_tables,
                                                        step.slot_mappings, strict=True):
            table.numpy()[:, : step_table.shape[1]] = step_table
            slots.numpy()[:] = step_slots

    def attn_metadata(self) -> object:
        return self.metadata[0] if len(self.metadata) == 1 else self.metadata


class CpuModelRunner(ModelRunner):
    """Core's runner, with decode steps of up to :func:`cpu_graph_max_batch` requests replayed."""

    #: prompt-embedding steps run core's eager forward (``super().run_model``)
    supports_prompt_embeds = True

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.max_graph_batch = 0 if vllm_config.enforce_eager else cpu_graph_max_batch()
        cap = vllm_config.compilation_config.max_cudagraph_capture_size
        if cap is not None:
            self.max_graph_batch = min(self.max_graph_batch, cap)
        self._graphs: dict[int, _DecodeGraph] = {}
        #: the logits of the current step when its graph computed them
        self._graph_logits: torch.Tensor | None = None
        #: why graphs are off for good (a capture or a check failed), or None
        self.graphs_off: str | None = None
        self._attention_ok: bool | None = None  # see _graphable_attention

    def load_model(self) -> None:
        self._graphs.clear()
        super().load_model()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._graphs.clear()
        self._attention_ok = None
        super().initialize_kv_cache(num_blocks)

    def release_device_graphs(self) -> None:
        self._graphs.clear()

    def run_model(self, step: StepInputs) -> torch.Tensor:
        num_reqs = len(step.req_ids)
        self._graph_logits = None
        if not self._graph_step(step, num_reqs):
            return super().run_model(step)
        entry = self._graphs.get(num_reqs)
        if entry is None:
            entry = self._graphs[num_reqs] = _DecodeGraph(num_reqs, len(step.block_tables),
                                                          self.input_batch.max_blocks_per_req, self.block_size)
        entry.stage(step)
        self.feed_sampled_tokens(entry.input_ids, step)
        if entry.graph is None:
            hidden, self._graph_logits = self._capture(entry, num_reqs)
        elif not entry.verified:
            hidden, self._graph_logits = self._verify(entry, num_reqs)
        else:
            hidden, self._graph_logits = entry.graph.replay()
        return hidden

    def compute_sample_logits(self, step: StepInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        """A graph step's logits ``[B, V]`` come from the graph (every request of a decode step samples)."""
        if self._graph_logits is not None and len(step.sample_indices) == len(step.req_ids):
            return self._graph_logits
        return super().compute_sample_logits(step, hidden_states)

    def _graph_step(self, step: StepInputs, num_reqs: int) -> bool:
        """Whether this step may replay a graph: decodes only, few requests, nothing that a
        graph would bake in (prompt or image embeddings, adapters, a KV connector)."""
        return (0 < num_reqs <= self.max_graph_batch and self.graphs_off is None and len(step.input_ids) == num_reqs
                and step.mm_embeds is None and not self.vllm_config.model_config.enable_prompt_embeds
                and self.lora_manager is None and self.spec_decode is None and self.pooler is None
                and get_active_kv_connector() is None
                and self._graphable_attention())

    def _graphable_attention(self) -> bool:
        """Every attention layer takes ``kernels/attention_decode.c`` on decode steps (float32
        caches, no soft cap): the torch path gathers a context shaped by the step."""
        if self._attention_ok is None:
            impls = [layer.impl for layer in self.attention_layers.values()]
            self._attention_ok = bool(impls) and self.dtype == torch.float32 and all(
                isinstance(impl, CpuPagedAttentionImpl) and impl.use_sdpa and impl.logits_soft_cap is None
                for impl in impls) and all(cache.dtype == torch.float32 for cache in self.kv_caches)
        return self._attention_ok

    def _eager(self, entry: _DecodeGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden [B, hidden], logits [B, V])`` of the staged step."""
        assert self.model is not None
        with set_forward_context(entry.attn_metadata()):
            hidden = forward_with_embeddings(self.model, entry.input_ids, entry.positions, None)
        return hidden, self.model.compute_logits(hidden)

    def _capture(self, entry: _DecodeGraph, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph = CpuGraph()
        try:
            out = graph.capture(lambda: self._eager(entry))
        except CaptureError as e:
            self._switch_off(f"the forward of {num_reqs} decodes cannot be captured: {e}")
            return self._eager(entry)
        entry.graph = graph
        logger.debug("CPU graph for %d decode(s): %d calls", num_reqs, graph.num_calls)
        return out

    def _verify(self, entry: _DecodeGraph, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay, then run the same step eagerly (it rewrites the same K/V): equal, or no graphs."""
        assert entry.graph is not None
        try:
            replayed = [t.clone() for t in entry.graph.replay()]
        except RuntimeError as e:
            self._switch_off(f"a replay of the forward of {num_reqs} decodes failed: {e}")
            return self._eager(entry)
        eager = self._eager(entry)
        if not all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True)):
            self._switch_off(f"a replay of the forward of {num_reqs} decodes differs from the eager forward")
            return eager
        entry.verified = True
        return eager

    def _switch_off(self, reason: str) -> None:
        logger.warning("CPU graphs off: %s; every step runs eagerly", reason)
        self.graphs_off = reason
        self._graphs.clear()
