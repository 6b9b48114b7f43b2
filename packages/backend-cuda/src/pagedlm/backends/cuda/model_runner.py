"""``CudaModelRunner``: persistent device input buffers, CUDA-graph decode, a profiling run.

Per step the host work is two pinned host-to-device copies (the packed step data, and the block
table) into buffers that live as long as the runner; nothing else is allocated for the inputs.
Decode-only steps (every request has one new token) of at most ``max_capture_size`` requests
replay a CUDA graph captured at start-up for the next larger captured batch size: the padded
requests have one token each, a slot of -1 (their K/V are not stored) and a context of one
token, so their rows are computed and ignored. Every other step (prefill chunks, mixed batches,
larger decode batches) of at most ``max_mixed_capture_size`` tokens replays a *mixed* graph
captured for the next larger token count, with the request count padded to ``max_num_seqs``
(when the attention backend declares ``supports_mixed_graphs``): padded tokens have a slot of -1
and belong to no request, padded requests have no query tokens, so attention skips both and
their rows are garbage that nothing reads. With several KV-cache groups (Gemma 3's sliding and
full layers) each group's block table and slot mapping has its persistent buffer, padded alike.
With speculative decoding, smaller mixed sizes serve verification steps (``spec_graphs.py``). An
eager forward of a 0.6B model costs 10-20 ms of host time (hundreds of Python-level launches),
several times its device time; a replay costs one launch. Steps over that size run eagerly
through the same buffers. ``enforce_eager=True`` turns graphs off.

Buffer packing (why: one copy, and fixed addresses per padded size for graph replay): one int64
buffer holds the token data ``input_ids | positions | slot_mapping`` (one slot mapping per
KV-cache group), each segment ``n`` long and starting at a multiple of ``_tok_stride(n)``; then the
request data ``query_start_loc (b + 1) | seq_lens (b) | decode_order (b)`` as int32 (segments at
multiples of ``_req_stride(b)``); then, for async scheduling, the positions in ``input_ids`` of
tokens still on the device and their rows in the last sampled tensor. The block tables
``[max_num_seqs, max_blocks_per_req]`` int32, one per group, are apart: their row stride never
changes. Segments start on 64-byte boundaries because Triton specialises kernels on
16-byte pointer alignment: unaligned views would compile a second variant of every kernel in
the middle of a run.
"""


from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from pagedlm.backends.cuda.spec_graphs import verification_capture_sizes
from pagedlm.core.attention.backend import CommonAttentionMetadata
from pagedlm.core.config import VllmConfig
from pagedlm.core.distributed import PP_TENSOR_NAMES, IntermediateTensors, get_pp_group
from pagedlm.core.forward_context import set_forward_context
from pagedlm.core.layers.vocab_embedding import LogitsProcessor
from pagedlm.core.logger import init_logger
from pagedlm.core.multimodal.encoder_runner import multimodal_embeddings, profile_encoder
from pagedlm.core.sample import build_sampling_metadata
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.worker.input_batch import StepInputs
from pagedlm.core.worker.model_runner import ModelRunner
from pagedlm.core.worker.prompt_embeds import forward_with_embeddings, gather_step_prompt_embeds

logger = init_logger(__name__)

__all__ = ["CudaModelRunner", "capture_sizes", "default_capture_sizes"]


#: most block-table entries a step stages as whole rows (1 MiB of int32)
_FULL_ROWS_MAX = 1 << 18


def _tok_stride(n: int) -> int:
    return -(-n // 8) * 8  # int64 elements: 64 bytes


def _req_stride(b: int) -> int:
    return -(-(b + 1) // 16) * 16  # int32 elements: 64 bytes


def default_mixed_capture_sizes(max_num_tokens: int) -> list[int]:
    """Token counts of the mixed-batch graphs: 256, 512, then steps of at most 1.5x up to 16384
    (above 512 tokens padding wastes at most a third of a step's rows), capped at
    ``max_num_tokens`` (always included when it is at most 16384; larger steps run eagerly)."""
    sizes = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
    top = min(max_num_tokens, sizes[-1])
    return sorted({s for s in sizes if s < top} | {top})


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 256 (padding wastes < 8 rows), then every
    multiple of 32 up to 512, capped at ``max_num_seqs`` (which is always included)."""
    sizes = {1, 2, 4} | set(range(8, 257, 8)) | set(range(288, 513, 32))
    return sorted({s for s in sizes if s <= max_num_seqs} | {min(max_num_seqs, 512)})


def capture_sizes(max_num_seqs: int, max_num_tokens: int, sizes: list[int] | None,
                  max_size: int | None) -> tuple[list[int], list[int]]:
    """``(decode batch sizes, mixed-step token counts)`` with a graph: ``compilation_config``'s
    ``cudagraph_capture_sizes`` (those up to ``max_num_seqs``) or the defaults, then both lists
    cut at its ``max_cudagraph_capture_size``."""
    decode = [s for s in sizes if s <= max_num_seqs] if sizes is not None else default_capture_sizes(max_num_seqs)
    mixed = default_mixed_capture_sizes(max_num_tokens)
    if max_size is not None:
        decode = [s for s in decode if s <= max_size]
        if sizes is None and max_size < max_num_seqs:
            decode = sorted(set(decode) | {max_size})  # the default list ends at its cap
        mixed = [s for s in mixed if s <= max_size]
    return decode, mixed


class CudaModelRunner(ModelRunner):
    supports_prompt_embeds = True
    #: run the graph bookkeeping on a non-CUDA device with a stand-in "graph" that re-runs the
    #: forward (for CPU tests of padding and buffers under TRITON_INTERPRET=1)
    emulate_graphs: bool = False

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        sc = vllm_config.scheduler_config
        self.max_num_reqs = sc.max_num_seqs
        self.max_num_tokens = max(int(sc.max_num_batched_tokens or 8192), self.max_num_reqs)
        self.max_blocks = self.input_batch.max_blocks_per_req
        on_cuda = device.type == "cuda"
        pin = self.platform.is_pin_memory_available()
        self._allocate_step_buffers()
        self._num_staged = 0
        self._sampled_host = [torch.zeros(self.max_num_reqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._copy_events = [torch.cuda.Event() for _ in range(2)] if on_cuda else []
        #: pinned staging buffers (bytes) for host arrays sent to the device (grammar bitmasks)
        self._array_staging: list[torch.Tensor | None] = [None, None]
        self._array_staging_events = [torch.cuda.Event() for _ in range(2)] if on_cuda else []
        self._num_array_stagings = 0
        self._num_copies = 0

        # NOTE: pipeline stages run every step eagerly (execute_model's pp_forward path)
        single_stage = vllm_config.parallel_config.pipeline_parallel_size == 1
        self.use_graphs = (on_cuda and not vllm_config.enforce_eager and single_stage
                           and self.attn_backend.supports_graphs) or self.emulate_graphs
        cc = vllm_config.compilation_config
        self.capture_sizes, mixed_sizes = capture_sizes(self.max_num_reqs, self.max_num_tokens,
                                                        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size)
        self.max_capture_size = self.capture_sizes[-1] if self.capture_sizes else 0
        #: padded batch size -> (replay, (hidden states, logits) written by the captured forward)
        self._graphs: dict[int, tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        #: the logits ``[B, V]`` of the last step when a graph computed them (else None)
        self._graph_logits: torch.Tensor | None = None
        self._pad_to = np.zeros(self.max_capture_size + 1, dtype=np.int64)
        for size in reversed(self.capture_sizes):
            self._pad_to[: size + 1] = size
        mixed = (self.use_graphs and self.attn_backend.supports_mixed_graphs
                 and cc.cudagraph_mode != "FULL_DECODE_ONLY")
        self.mixed_capture_sizes = mixed_sizes if mixed else []
        spec = vllm_config.speculative_config
        if self.mixed_capture_sizes and spec is not None:  # verification steps: smaller graphs too
            self.mixed_capture_sizes = verification_capture_sizes(
                int(spec.num_speculative_tokens), self.capture_sizes, self.mixed_capture_sizes[0]) \
                + self.mixed_capture_sizes
        self.max_mixed_capture_size = self.mixed_capture_sizes[-1] if self.mixed_capture_sizes else 0
        #: padded token count -> (replay, (hidden states,)) of a mixed-batch graph
        self._mixed_graphs: dict[int, tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        self.capture_time_s = 0.0

    def _allocate_step_buffers(self) -> None:
        """The persistent device inputs and their pinned staging, for the KV-cache groups."""
        pin = self.platform.is_pin_memory_available()
        num_groups = self.num_kv_cache_groups
        # int64 elements: token data (ids, positions, a slot mapping per group), request data
        # (4 int32 segments: 2 int64 per _req_stride), fed-token indices
        step_len = (2 + num_groups) * _tok_stride(self.max_num_tokens) + 2 * _req_stride(self.max_num_reqs) \
            + 2 * _tok_stride(self.max_num_reqs)
        self._step_buf = torch.zeros(step_len, dtype=torch.int64, device=self.device)
        self._fed = (self._step_buf[:0], self._step_buf[:0])  # this step's (fed positions, sample rows)
        self.block_tables = [torch.zeros(self.max_num_reqs, self.max_blocks, dtype=torch.int32, device=self.device)
                             for _ in range(num_groups)]
        # NOTE: two sets of pinned staging buffers, used in turn: with async scheduling the host
        # stages step N+1 while the copies of step N may still be queued behind the device's
        # work, so a step must not overwrite the buffers the step before it copies from. The step
        # after next waits for them (``_staging_copied``): usually long done, since the engine
        # waited for step N's tokens, but a step that samples nothing gives it nothing to wait for.
        self._staging = [
            (torch.zeros(step_len, dtype=torch.int64, pin_memory=pin),
             [torch.zeros(self.max_num_reqs * self.max_blocks, dtype=torch.int32, pin_memory=pin)
              for _ in range(num_groups)])
            for _ in range(2)
        ]
        #: per staging set, an event completed once the copies out of it ran (None: nothing queued)
        self._staging_copied: list = [None, None]

    def set_kv_cache_groups(self, groups) -> None:
        num_groups = self.num_kv_cache_groups
        super().set_kv_cache_groups(groups)
        if self.num_kv_cache_groups != num_groups:
            self._allocate_step_buffers()

    def load_model(self) -> None:
        super().load_model()
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, LogitsProcessor):
                # the sampler reads bf16 logits as they are (saves a [B, vocab] float32 copy a step)
                module.float32_output = False
        kv_heads = {layer.num_kv_heads for layer in self.attention_layers.values()}
        if kv_heads:
            head_size = next(iter(self.attention_layers.values())).head_size
            self.metadata_builder.bind_model(num_kv_heads=min(kv_heads), head_size=head_size)
        if self.device.type == "cuda":
            self.compile_kernels()

    # -- inputs -----------------------------------------------------------------------------
    def _stage(self, step: StepInputs | None, num_tokens: int, num_reqs: int, *,
               mixed: bool = False) -> CommonAttentionMetadata:
        """Write one step's inputs (``num_tokens``/``num_reqs`` after padding) into the buffers.

        ``step=None`` stages an all-padding batch: a decode batch when ``num_tokens ==
        num_reqs`` (graph capture), else one whose first request has the extra tokens.
        ``mixed=True`` pads for a mixed-batch graph instead: padded tokens belong to no request
        and padded requests have no tokens and no context, and the metadata never selects the
        decode-only kernels (the graph must hold the variant that serves every batch)."""
        which = self._num_staged % 2
        step_host, bt_hosts = self._staging[which]
        self._num_staged += 1
        copied = self._staging_copied[which]
        if copied is not None:
            # NOTE: the copies out of these buffers (two steps ago) may still be queued: a step
            # that samples nothing (a prompt chunk) returns without the engine waiting for it, so
            # with async scheduling the host can stage the step after next before they ran.
            copied.synchronize()
        t = step_host.numpy()
        ts, rs = _tok_stride(num_tokens), _req_stride(num_reqs)
        num_groups = len(self.block_tables)
        req_at = (2 + num_groups) * ts  # int64 offset of the request data; int32 offset 2 * req_at
        r = t[req_at : req_at + 2 * rs].view(np.int32)
        req_buf = self._step_buf[req_at : req_at + 2 * rs].view(torch.int32)
        req_host = step_host[req_at : req_at + 2 * rs].view(torch.int32)
        real_t = real_b = num_fed = 0
        r[0] = 0
        if step is not None:
            real_t, real_b = len(step.input_ids), len(step.req_ids)
            t[:real_t] = step.input_ids
            t[ts : ts + real_t] = step.positions
            for g, slots in enumerate(step.slot_mappings):
                t[(2 + g) * ts : (2 + g) * ts + real_t] = slots
            r[: real_b + 1] = step.query_start_loc
            r[rs : rs + real_b] = step.seq_lens
            num_fed = len(step.fed_token_indices)
        surplus = 0
        if mixed:  # padded tokens: nothing stored, in no request; padded requests: empty
            t[real_t:num_tokens] = 0
            t[ts + real_t : ts + num_tokens] = 0
            for g in range(num_groups):
                t[(2 + g) * ts + real_t : (2 + g) * ts + num_tokens] = -1
            r[real_b + 1 : num_reqs + 1] = real_t
            r[rs + real_b : rs + num_reqs] = 0
        elif num_tokens > real_t:  # padded requests: one token each, nothing stored, context 1
            t[real_t:num_tokens] = 0
            t[ts + real_t : ts + num_tokens] = 0
            for g in range(num_groups):
                t[(2 + g) * ts + real_t : (2 + g) * ts + num_tokens] = -1
            # (an all-padding batch of more tokens than requests gives the surplus to the first)
            surplus = num_tokens - num_reqs if step is None else 0
            r[real_b + 1 : num_reqs + 1] = np.arange(real_t + 1, real_t + 1 + num_reqs - real_b) + surplus
            r[rs + real_b : rs + num_reqs] = 1
            if surplus:
                r[rs] += surplus
        decode_only = num_tokens == num_reqs and not mixed
        if decode_only:  # longest context first, padding (context 1) last
            order = r[2 * rs : 2 * rs + num_reqs]
            if real_b:
                order[:real_b] = np.argsort(-r[rs : rs + real_b], kind="stable")
            order[real_b:] = np.arange(real_b, num_reqs)
        end = req_at + 2 * rs
        if num_fed:
            fs = _tok_stride(num_fed)
            t[end : end + num_fed] = step.fed_token_indices  # type: ignore[union-attr]
            t[end + fs : end + fs + num_fed] = step.fed_sample_indices  # type: ignore[union-attr]
            self._fed = (self._step_buf[end : end + num_fed], self._step_buf[end + fs : end + fs + num_fed])
            end += 2 * fs
        else:
            self._fed = (self._step_buf[:0], self._step_buf[:0])
        self._step_buf[:end].copy_(step_host[:end], non_blocking=True)
        max_seq_len = self.max_model_len
        max_query_len = 1 + surplus
        if step is not None and real_b:
            for block_table, bt_host, host_table, step_table in zip(
                    self.block_tables, bt_hosts, self.input_batch.block_tables, step.block_tables, strict=True):
                if real_b * self.max_blocks <= _FULL_ROWS_MAX:
                    # Whole rows: one contiguous copy (a strided one costs a device-side kernel too).
                    nb = self.max_blocks
                    staged = bt_host[: real_b * nb].view(real_b, nb)
                    np.take(host_table, step.rows, axis=0, out=staged.numpy())
                    block_table[:real_b].copy_(staged, non_blocking=True)
                else:
                    nb = step_table.shape[1]
                    staged = bt_host[: real_b * nb].view(real_b, nb)
                    staged.numpy()[:] = step_table
                    block_table[:real_b, :nb].copy_(staged, non_blocking=True)
            max_seq_len = int(step.seq_lens.max())
            max_query_len = int(step.num_scheduled.max())
        self._staging_copied[which] = self.platform.record_event()
        if mixed:
            max_query_len = max(max_query_len, 2)
        return CommonAttentionMetadata(
            query_start_loc=req_buf[: num_reqs + 1],
            query_start_loc_cpu=req_host[: num_reqs + 1],
            seq_lens=req_buf[rs : rs + num_reqs],
            seq_lens_cpu=req_host[rs : rs + num_reqs],
            num_computed_tokens_cpu=torch.from_numpy(step.num_computed) if step is not None else torch.zeros(0),
            block_table=self.block_tables[0][:num_reqs],
            slot_mapping=self._step_buf[2 * ts : 2 * ts + num_tokens],
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            decode_order=req_buf[2 * rs : 2 * rs + num_reqs] if decode_only else None,
        )

    def _metadata(self, common: CommonAttentionMetadata):
        """The backend metadata of a staged step: per KV-cache group, its persistent block table
        and slot-mapping segment (one object for a single group)."""
        if len(self.block_tables) == 1:
            return self.metadata_builder.build(common)
        num_tokens, num_reqs = common.num_actual_tokens, common.num_reqs
        ts = _tok_stride(num_tokens)
        slot_mappings = [self._step_buf[(2 + g) * ts : (2 + g) * ts + num_tokens]
                         for g in range(len(self.block_tables))]
        return self.build_attention_metadata(common, [bt[:num_reqs] for bt in self.block_tables], slot_mappings)

    def _ids_positions(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        ts = _tok_stride(num_tokens)
        return self._step_buf[:num_tokens], self._step_buf[ts : ts + num_tokens]

    # -- the forward pass (core hook) -------------------------------------------------------
    def run_model(self, step: StepInputs) -> torch.Tensor:
        """``[T, hidden]``: a graph replay (decode-only steps, then mixed ones), else an eager
        forward. Steps that compute prompt embeddings run eagerly: their embedding lookup is
        overridden for the forward (core's ``worker/prompt_embeds.py``), which a graph cannot."""
        assert self.model is not None
        num_tokens, num_reqs = len(step.input_ids), len(step.req_ids)
        self._graph_logits = None
        embeds = None
        if self.vllm_config.model_config.enable_prompt_embeds:
            embeds = gather_step_prompt_embeds(step, self.input_batch.requests, self.device, self.dtype)
        # NOTE: steps with prompt or image embeddings run eagerly (graphs embed token ids only)
        eager = embeds is not None or step.mm_embeds is not None
        if not eager and self._graphs and num_tokens == num_reqs and num_reqs <= self.max_capture_size:
            padded = int(self._pad_to[num_reqs])
            self._stage(step, padded, padded)
            self.feed_sampled_tokens(self._step_buf[:num_tokens], step)
            replay, (hidden, logits) = self._graphs[padded]
            replay()
            self._graph_logits = logits[:num_reqs]
            return hidden[:num_tokens]
        if not eager and self._mixed_graphs and num_tokens <= self.max_mixed_capture_size:
            padded = self.mixed_capture_sizes[bisect.bisect_left(self.mixed_capture_sizes, num_tokens)]
            self._stage(step, padded, self.max_num_reqs, mixed=True)
            self.feed_sampled_tokens(self._step_buf[:num_tokens], step)
            replay, (hidden,) = self._mixed_graphs[padded]
            replay()
            return hidden[:num_tokens]
        common = self._stage(step, num_tokens, num_reqs)
        if self.encoder_runner is not None:
            common = dataclasses.replace(
                common, bidirectional_spans=self.encoder_runner.bidirectional_spans(step, self.input_batch.requests))
        metadata = self._metadata(common)
        input_ids, positions = self._ids_positions(num_tokens)
        self.feed_sampled_tokens(input_ids, step)
        with set_forward_context(metadata), multimodal_embeddings(self.model, step.mm_embeds):
            return forward_with_embeddings(self.model, input_ids, positions, embeds)

    def feed_sampled_tokens(self, input_ids: torch.Tensor, step: StepInputs) -> None:
        """As the base runner's, with the indices already on the device (staged with the step)."""
        dst, src = self._fed
        if len(step.fed_token_indices):
            assert len(dst) == len(step.fed_token_indices), "feed_sampled_tokens before _stage"
            sampled = self.input_batch.sampled_on_device
            assert sampled is not None
            input_ids.index_copy_(0, dst, sampled.index_select(0, src))

    def copy_to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Into one of two pinned buffers, used in turn (a step's tokens are read before the
        step after next copies), with one of two reusable events."""
        if self.device.type != "cuda":
            return super().copy_to_host(tensor)
        k = self._num_copies % 2
        self._num_copies += 1
        host = self._sampled_host[k][: tensor.numel()]
        host.copy_(tensor, non_blocking=True)
        event = self._copy_events[k]
        event.record()
        return host, event

    def stage_to_device(self, array: np.ndarray) -> torch.Tensor:
        """Through one of two pinned buffers, used in turn; a buffer is refilled only once the
        copy out of it has completed (its event)."""
        if self.device.type != "cuda":
            return super().stage_to_device(array)
        if array.flags.c_contiguous:
            host = torch.from_numpy(array)
            if host.is_pinned():
                return host.to(self.device, non_blocking=True)  # (its owner keeps it until used)
        k = self._num_array_stagings % 2
        self._num_array_stagings += 1
        buf = self._array_staging[k]
        if buf is None or buf.numel() < array.nbytes:
            buf = self._array_staging[k] = torch.empty(array.nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self._array_staging_events[k].synchronize()
        host = buf[: array.nbytes].view(torch.from_numpy(array[:0]).dtype).view(array.shape)
        np.copyto(host.numpy(), array)
        on_device = host.to(self.device, non_blocking=True)
        self._array_staging_events[k].record()
        return on_device

    def compute_sample_logits(self, step: StepInputs, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._graph_logits is not None and len(step.sample_indices) == len(step.req_ids):
            return self._graph_logits  # every row samples, in batch order
        return super().compute_sample_logits(step, hidden_states)

    # -- start-up ---------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest forward (``max_num_batched_tokens`` tokens) plus logits and sampling of
        ``max_num_seqs`` rows with top-k/top-p on, so ``torch.cuda.max_memory_allocated`` holds
        the activation peak the KV-cache sizing must leave room for. No cache exists yet:
        attention runs with no metadata and returns zeros (its own buffers are the size of q)."""
        assert self.model is not None
        if self.device.type != "cuda":
            return
        n = self.max_num_tokens
        self._step_buf.zero_()
        start = time.perf_counter()
        profile_encoder(self.vllm_config, self.encoder_runner)
        with set_forward_context(None):
            hidden = self._stage_forward(n)
        if hidden is None:  # a pipeline stage before the last: no logits here
            torch.cuda.synchronize(self.device)
            logger.info("profiling run: %d tokens, peak %.2f GiB allocated (%.2fs)", n,
                        torch.cuda.max_memory_allocated(self.device) / 2**30, time.perf_counter() - start)
            return
        rows = min(self.max_num_reqs, n)
        logits = self.model.compute_logits(hidden[:rows])  # type: ignore[operator]
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9) for _ in range(rows)]
        md = build_sampling_metadata(params, prompt_token_ids=[[0]] * rows, output_token_ids=[[] for _ in range(rows)],
                                     vocab_size=logits.shape[-1], device=self.device)
        self.sampler(logits, md)
        torch.cuda.synchronize(self.device)
        del hidden, logits
        logger.info("profiling run: %d tokens, peak %.2f GiB allocated (%.2fs)", n,
                    torch.cuda.max_memory_allocated(self.device) / 2**30, time.perf_counter() - start)

    def release_device_graphs(self) -> None:
        # sleep mode: the graphs read the weights', the KV cache's and their pool's addresses; they
        # are captured again by initialize_kv_cache on wake (worker/sleep.py)
        self._graphs.clear()
        self._graph_logits = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        super().initialize_kv_cache(num_blocks)
        if self.use_graphs:
            self.capture_model()

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """Compile, in parallel, every Triton kernel variant the engine will launch, before the
        profiling run launches the first (kernels/launch.py says why): a forward of a few tokens
        with attention off (the layers' kernels), the fused sampler on its logits (in their dtype
        and in float32, which it gets after logits processing), and for the Triton backend one
        forward per attention variant: each key-range split count a decode step can use, and
        prefill.

        NOTE: inside ``compile_only`` every Triton op returns uninitialised memory, so these
        forwards' outputs are dropped unread; attention is called with a one-block stand-in
        cache per layer (nothing is launched on it) because the real one does not exist yet.
        """
        from pagedlm.backends.cuda.kernels.bitmask import apply_token_bitmask
        from pagedlm.backends.cuda.kernels.launch import compile_only
        from pagedlm.backends.cuda.kernels.sampling import gumbel_sample

        assert self.model is not None
        n = min(16, self.max_num_tokens)
        self._step_buf.zero_()
        caches = {name: layer.kv_cache for name, layer in self.attention_layers.items()}
        for layer in self.attention_layers.values():
            shape = self.attn_backend.get_kv_cache_shape(1, self.block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        try:
            with compile_only() as stats:
                with set_forward_context(None):
                    hidden = self._stage_forward(n)
                if hidden is not None:  # the (last) stage that samples
                    logits = self.model.compute_logits(hidden)  # type: ignore[operator]
                    temperature = torch.ones(n, dtype=torch.float32, device=self.device)
                    words = torch.zeros((n, -(-logits.shape[-1] // 32)), dtype=torch.int32, device=self.device)
                    rows = torch.arange(n, dtype=torch.int32, device=self.device)
                    for dtype in {logits.dtype, torch.float32}:
                        cast = logits.to(dtype)
                        gumbel_sample(cast, temperature, 0, 0)
                        for logit_rows in (None, rows):  # structured outputs' bitmask, in step order or not
                            apply_token_bitmask(cast, words, logit_rows)
                self._compile_attention_variants()
        finally:
            for name, layer in self.attention_layers.items():
                layer.kv_cache = caches[name]
        torch.cuda.synchronize(self.device)
        logger.info("compiled %d Triton kernel variants in %.2fs", stats.num_variants, stats.seconds)

    def _compile_attention_variants(self) -> None:
        """Inside ``compile_only``: a forward per attention variant the backend declares
        (``AttentionMetadataBuilder.precompile_metadata``), for the capture sizes and every power
        of two up to ``max_num_seqs`` (eager decode steps of any batch size)."""
        sizes = set(self.capture_sizes) | {self.max_num_reqs}
        sizes |= {1 << k for k in range(self.max_num_reqs.bit_length()) if 1 << k <= self.max_num_reqs}

        def stage(num_tokens: int, num_reqs: int) -> CommonAttentionMetadata:
            # NOTE: _stage reuses a staging buffer whose last copy must have happened
            torch.cuda.synchronize(self.device)
            return self._stage(None, num_tokens, num_reqs)

        for num_tokens, metadata in self.metadata_builder.precompile_metadata(
                sorted(sizes), min(16, self.max_num_tokens), stage):
            self._padding_forward(num_tokens, metadata)

    def _padding_forward(self, num_tokens: int, metadata) -> None:
        with set_forward_context(metadata):
            self._stage_forward(num_tokens)

    def _stage_forward(self, num_tokens: int) -> torch.Tensor | None:
        """This rank's part of a forward over the first ``num_tokens`` staged tokens, for start-up
        passes: a later pipeline stage starts from zeros instead of receiving activations, and
        nothing is sent on. Returns ``[T, hidden]`` on the last stage, None on the others."""
        assert self.model is not None
        input_ids, positions = self._ids_positions(num_tokens)
        pp = get_pp_group()
        if pp.is_first_rank:
            out = self.model(input_ids, positions)
        else:
            shape = (num_tokens, self.vllm_config.model_config.hidden_size)
            intermediate = IntermediateTensors(
                {name: torch.zeros(shape, dtype=self.dtype, device=self.device) for name in PP_TENSOR_NAMES})
            out = self.model(input_ids, positions, intermediate_tensors=intermediate)
        return out if pp.is_last_rank else None

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture one mixed-batch graph per token count in ``mixed_capture_sizes``, then one
        decode graph per size in ``capture_sizes``, largest first (later, smaller graphs then
        reuse the first one's memory pool).

        NOTE: the first graph of each kind is captured after an eager run of its forward, which
        does the lazy initialisations a capture must not (cuBLAS's workspace on the capture
        stream: captured without any warm-up, an fp32 model failed on the H200 with
        ``CUBLAS_STATUS_INTERNAL_ERROR``); the split-K counters of the GEMV kernels are made here,
        eagerly. The other sizes get ``compilation_config.cudagraph_num_of_warmups`` eager runs
        (vLLM's field; default 0): one per size was 1.2-1.6 s of a start-up (47 graphs, H200)."""
        assert self.model is not None
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        extra_warmups = self.vllm_config.compilation_config.cudagraph_num_of_warmups
        if self.device.type == "cuda":
            from pagedlm.backends.cuda.kernels.wna16_gemv import split_k_counters

            split_k_counters(self.device, 1)
        # NOTE: every KV-cache group's metadata reads its own persistent block table and slot
        # mapping segment (_metadata), so models of several groups replay these graphs too.
        for size in reversed(self.mixed_capture_sizes):
            metadata = self._metadata(self._stage(None, size, self.max_num_reqs, mixed=True))
            input_ids, positions = self._ids_positions(size)

            def mixed_forward(metadata=metadata, input_ids=input_ids, positions=positions) -> tuple[torch.Tensor, ...]:
                with set_forward_context(metadata):
                    return (self.model(input_ids, positions),)  # type: ignore[misc]

            first = size == self.mixed_capture_sizes[-1]
            self._mixed_graphs[size] = self._capture(mixed_forward, pool, extra_warmups + first)
        for size in reversed(self.capture_sizes):
            metadata = self._metadata(self._stage(None, size, size))
            input_ids, positions = self._ids_positions(size)

            def forward(metadata=metadata, input_ids=input_ids, positions=positions) -> tuple[torch.Tensor, ...]:
                # NOTE: a decode step samples every row, so the graph computes the logits too:
                # one launch fewer per step, and no per-step allocation of [B, V] floats.
                with set_forward_context(metadata):
                    hidden = self.model(input_ids, positions)  # type: ignore[misc]
                return hidden, self.model.compute_logits(hidden)  # type: ignore[union-attr, operator]

            first = size == self.capture_sizes[-1]
            self._graphs[size] = self._capture(forward, pool, extra_warmups + first)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_time_s = time.perf_counter() - start
        logger.info("captured %d CUDA graphs for decode batch sizes %s and %d for mixed batches of "
                    "up to %d tokens in %.2fs", len(self._graphs),
                    f"{self.capture_sizes[0]}..{self.capture_sizes[-1]}" if self.capture_sizes else "(none)",
                    len(self._mixed_graphs), self.max_mixed_capture_size, self.capture_time_s)

    def _capture(self, forward: Callable[[], tuple[torch.Tensor, ...]], pool,
                 warmups: int) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        """A graph of ``forward`` (its replay and outputs), after ``warmups`` eager runs of it."""
        if self.device.type != "cuda":
            # stand-in for tests: "replay" re-runs the forward into the same output tensors
            out = forward()

            def replay() -> None:
                for dst, src in zip(out, forward(), strict=True):
                    dst.copy_(src)

            return replay, out
        for _ in range(warmups):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out
