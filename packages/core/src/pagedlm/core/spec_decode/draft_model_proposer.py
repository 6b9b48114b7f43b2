"""Drafts from a second, smaller model with the target's vocabulary (``method="draft_model"``).

KV cache: the draft model has its own cache tensors, one per draft layer, indexed by the *same
block ids* as the target's (the scheduler's one block manager; a block id costs one block of the
target's slots plus one of the draft's: ``kv_cache_bytes_per_block``). The draft reads the block
table of the target's first full-attention KV-cache group, so it needs no bookkeeping of its own:
prefix-cache hits, preemption and freed blocks apply to both models at once.

Per step, the draft first *follows* the target: it runs over every token of the step whose K/V
stayed (the chunk of a prompt, or the verified token and the accepted drafts) plus the token just
sampled, so its cache holds exactly what the target's holds, chunked prefill included. For the
requests that want drafts, that pass's last logits give draft 1; ``k - 1`` one-token passes give
the rest. Drafts are greedy (the argmax of the draft's logits): verification then treats them as
deterministic, which keeps the target's distribution exactly at any temperature. A pass writes
K/V only where the request holds slots (the scheduler allocates ``k`` lookahead slots); where it
does not, the request gets fewer drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedlm.core.attention.backend import CommonAttentionMetadata
from pagedlm.core.config import ModelConfig
from pagedlm.core.forward_context import set_forward_context
from pagedlm.core.kv_cache.spec import FullAttentionSpec
from pagedlm.core.layers import custom_ops
from pagedlm.core.model_loader import load_model
from pagedlm.core.spec_decode.proposer import ProposalBatch, SpecProposer


class DraftModelProposer(SpecProposer):
    def load_model(self) -> None:
        runner = self.runner
        cfg = runner.vllm_config
        target = cfg.model_config
        path = str(self.speculative_config.model)
        draft_mc = ModelConfig(model=path, dtype=target.dtype, max_model_len=cfg.max_model_len,
                               skip_tokenizer_init=True, trust_remote_code=target.trust_remote_code)
        if draft_mc.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model={path!r} has vocab_size={draft_mc.vocab_size}, the target "
                             f"{target.vocab_size}: a draft model must share the target's vocabulary")
        draft_config = dataclasses.replace(cfg, model_config=draft_mc, quant_config=None)
        with custom_ops.use_ops(runner.layer_ops):
            self.model, self.attention_layers = load_model(draft_config, runner.attn_backend, runner.device)
        groups = runner.kv_cache_groups
        self.group_id = next((g for g, group in enumerate(groups) if isinstance(group.spec, FullAttentionSpec)), None)
        if self.group_id is None:
            raise ValueError("speculative_config.method='draft_model' needs a target with full-attention layers "
                             "(its block table is the draft's); this model has only sliding-window layers")
        for layer in self.attention_layers.values():
            layer.kv_cache_group_id = self.group_id

    def _shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        runner = self.runner
        return [runner.attn_backend.get_kv_cache_shape(num_blocks, runner.block_size, layer.num_kv_heads,
                                                       layer.head_size)
                for layer in self.attention_layers.values()]

    def kv_cache_bytes_per_block(self) -> int:
        itemsize = self.runner.kv_cache_dtype.itemsize
        return sum(int(np.prod(shape)) * itemsize for shape in self._shapes(1))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        runner = self.runner
        # NOTE: the runner re-reads the groups before sizing the cache (the engine core's groups)
        self.group_id = next(g for g, group in enumerate(runner.kv_cache_groups)
                             if isinstance(group.spec, FullAttentionSpec))
        for layer, shape in zip(self.attention_layers.values(), self._shapes(num_blocks), strict=True):
            layer.kv_cache_group_id = self.group_id
            layer.kv_cache = runner.platform.kv_cache_tensor(shape, runner.kv_cache_dtype, runner.device)

    # -- per step ------------------------------------------------------------------------------
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        step, runner = batch.step, self.runner
        num_reqs = len(step.req_ids)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if not num_reqs:
            return drafts
        ib = runner.input_batch
        bs = ib.block_size
        # positions with slots: the blocks the request holds, within max_model_len
        held = np.array([ib.requests[r].num_blocks[self.group_id] for r in step.req_ids], dtype=np.int64) * bs
        limit = np.minimum(held, ib.max_model_len)
        start = step.num_computed.astype(np.int64)
        follow = batch.num_verified.astype(np.int64)
        # the token just sampled joins the pass where its slot exists
        with_new = (batch.num_new_tokens > 0) & (start + follow < limit)
        num_in_pass = follow + with_new
        last_logits = self._forward(batch.rows, start, num_in_pass, None, batch.token_ids)
        wanted = np.flatnonzero(with_new & (batch.max_drafts > 0))
        if not len(wanted):
            return drafts
        # draft 1 is predicted at the new token; draft j + 1 by feeding draft j at position
        # first + j - 1, which needs a slot there
        first = (start + num_in_pass)[wanted]
        num_drafts = np.minimum(batch.max_drafts[wanted], limit[wanted] - first + 1)
        out = [[t] for t in last_logits[torch.from_numpy(wanted).to(runner.device)].argmax(dim=-1).tolist()]
        active = np.arange(len(wanted))
        for j in range(1, int(num_drafts.max())):
            active = active[num_drafts[active] > j]
            inputs = np.array([out[a][-1] for a in active], dtype=np.int64)
            logits = self._forward(batch.rows[wanted[active]], first[active] + j - 1,
                                   np.ones(len(active), dtype=np.int64), inputs, batch.token_ids)
            for a, token in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                out[a].append(token)
        for a, b in enumerate(wanted):
            drafts[b] = out[a]
        return drafts

    def _forward(self, rows: np.ndarray, start: np.ndarray, count: np.ndarray, input_ids: np.ndarray | None,
                 token_ids: np.ndarray) -> torch.Tensor:
        """One draft forward pass: request ``i`` (table row ``rows[i]``) computes ``count[i]`` tokens
        from position ``start[i]`` on, ``input_ids`` ``[sum(count)]`` or, when None, its tokens in
        ``token_ids``. Returns the logits ``[B, V]`` of each request's last token."""
        runner = self.runner
        ib = runner.input_batch
        bs, dev = ib.block_size, runner.device
        num_reqs = len(rows)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(count, out=qsl[1:])
        total = int(qsl[-1])
        token_req = np.repeat(np.arange(num_reqs), count)
        positions = start[token_req] + np.arange(total) - qsl[:-1][token_req]
        token_rows = rows[token_req]
        if input_ids is None:
            input_ids = token_ids[token_rows, positions]
        table = ib.block_tables[self.group_id]
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start + count
        max_blocks = int(-(-seq_lens.max() // bs))
        qsl_cpu = torch.from_numpy(qsl).to(torch.int32)
        seq_cpu = torch.from_numpy(seq_lens).to(torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu, seq_lens=seq_cpu.to(dev),
            seq_lens_cpu=seq_cpu, num_computed_tokens_cpu=torch.from_numpy(start).to(torch.int32),
            block_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev), num_reqs=num_reqs, num_actual_tokens=total,
            max_query_len=int(count.max()), max_seq_len=int(seq_lens.max()))
        metadata = runner.metadata_builder.build(common)
        if runner.num_kv_cache_groups > 1:
            metadata = [metadata] * runner.num_kv_cache_groups  # (the draft's layers read their group's)
        with set_forward_context(metadata):
            hidden = self.model(torch.from_numpy(np.ascontiguousarray(input_ids)).to(dev),
                                torch.from_numpy(positions).to(dev))
        return self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(dev)])
