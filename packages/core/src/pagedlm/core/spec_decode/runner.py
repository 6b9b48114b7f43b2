"""The model runner's part of speculative decoding (called from ``worker/model_runner.py``).

Per step: the scheduled drafts are written into the runner's token table after the request's
known tokens, so the step's flat inputs carry them like any token; after the forward pass the
target's logits are taken at every draft position plus one per sampling request (the
logits-index path), verified (``rejection_sampler.verify``), and the proposer drafts the next
step's tokens. A step without any draft samples through the runner's own sampler, exactly as
without speculation, and only proposes. A step with drafts runs synchronously, its result on the
host when this returns; with async scheduling (n-gram), steps that get no drafts run
asynchronously and propose nothing (``spec_decode/engine_step.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedlm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedlm.core.spec_decode.config import SpeculativeConfig
from pagedlm.core.spec_decode.proposer import ProposalBatch, get_proposer_cls
from pagedlm.core.spec_decode.rejection_sampler import VerifyRequest, verify
from pagedlm.core.worker.input_batch import StepInputs


class SpecDecodeRunner:
    def __init__(self, runner: Any, config: SpeculativeConfig) -> None:
        self.runner = runner
        self.config = config
        self.proposer = get_proposer_cls(str(config.method))(speculative_config=config, runner=runner)

    def write_draft_tokens(self, sched: SchedulerOutput) -> None:
        """Put each request's scheduled drafts after its known tokens in the token table (the
        slots beyond ``num_tokens`` are scratch: verified tokens overwrite them when they come)."""
        batch = self.runner.input_batch
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            state = batch.requests[req_id]
            batch.token_ids[state.row, state.num_tokens : state.num_tokens + len(drafts)] = drafts

    def proposes(self, non_block: bool) -> bool:
        """Whether a step without drafts proposes: always when run synchronously; a step scheduled
        asynchronously gets no drafts next (spec_decode/engine_step.py), so only a proposer that
        must see every step (a draft model's cache follows the target) waits for its tokens."""
        return not non_block or self.proposer.needs_every_step

    def propose(self, output: ModelRunnerOutput, step: StepInputs, states: list) -> ModelRunnerOutput:
        """The next drafts for a step that had none (sampled as without speculation)."""
        output.spec_token_ids = self._propose(step, states, output.sampled_token_ids,
                                              np.zeros(len(step.req_ids), dtype=np.int64))
        return output

    def verify_and_propose(self, step: StepInputs, states: list, hidden_states: torch.Tensor,
                           sched: SchedulerOutput, prompt_logprobs: dict) -> ModelRunnerOutput:
        """Verify the step's drafts, sample every sampling request's tokens and propose the next
        drafts. ``states`` are the step's requests (batch order), ``hidden_states`` ``[T, hidden]``."""
        runner = self.runner
        scheduled = sched.scheduled_spec_decode_tokens
        num_reqs = len(step.req_ids)
        sampled: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: dict = {}
        num_rejected = np.zeros(num_reqs, dtype=np.int64)
        sample_indices = step.sample_indices
        if len(sample_indices):
            drafts = [scheduled.get(step.req_ids[b], ()) for b in sample_indices]
            ends = step.query_start_loc[1:][sample_indices]
            # NOTE: the logits-index path: request b's d drafts end its chunk, so its rows are the
            # last d + 1 positions of the chunk (d = 0: the last position only)
            index = np.concatenate([np.arange(end - len(d) - 1, end) for end, d in zip(ends, drafts, strict=True)])
            logits = runner.model.compute_logits(
                hidden_states[torch.from_numpy(index).to(runner.device, non_blocking=True)])  # (no stream sync)
            requests = [VerifyRequest(s.sampling_params, s.prompt_token_ids if s.prompt_embeds is None else [],
                                      s.output_token_ids, d, s.generator)
                        for s, d in zip((states[b] for b in sample_indices), drafts, strict=True)]
            tokens, lps = verify(logits, requests)
            for b, d, out, lp in zip(sample_indices, drafts, tokens, lps, strict=True):
                sampled[b] = out
                num_rejected[b] = len(d) - (len(out) - 1)
                if lp is not None:
                    logprobs[step.req_ids[b]] = lp
        proposals = self._propose(step, states, sampled, num_rejected)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs, spec_token_ids=proposals)

    def _propose(self, step: StepInputs, states: list, sampled: list[list[int]],
                 num_rejected: np.ndarray) -> list[list[int]]:
        batch = self.runner.input_batch
        num_new = np.array([len(t) for t in sampled], dtype=np.int64)
        num_tokens = np.array([s.num_tokens for s in states], dtype=np.int64) + num_new
        max_len = batch.max_model_len
        for state, tokens in zip(states, sampled, strict=True):
            if tokens:  # scratch again: the scheduler sends these tokens with the next step
                end = min(state.num_tokens + len(tokens), max_len)
                batch.token_ids[state.row, state.num_tokens : end] = tokens[: end - state.num_tokens]
        k = int(self.config.num_speculative_tokens)  # type: ignore[arg-type]
        wanted = (num_new > 0) & (num_tokens < max_len)
        if not self.config.speculates(len(states)):
            wanted[:] = False
        proposal = ProposalBatch(step=step, token_ids=batch.token_ids, rows=step.rows, num_tokens=num_tokens,
                                 num_verified=step.num_scheduled - num_rejected, num_new_tokens=num_new,
                                 max_drafts=np.where(wanted, np.minimum(k, max_len - num_tokens), 0))
        return self.proposer.propose(proposal)
