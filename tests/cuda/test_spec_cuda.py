"""Speculative decoding on the CUDA runner: verification steps replay the mixed-batch graphs
(the verification-sized ones among them), greedy tokens identical to decoding without
speculation and to HF transformers (fp32), for n-gram and self-drafting, Gemma 3's two KV-cache
groups included, alone and in mixed batches, under chunked prefill, preemption and async
scheduling.

Under ``TRITON_INTERPRET=1`` the engine runs on the CPU with the Triton backend and the graph
stand-in (tests/cuda/test_cuda_e2e.py says how).
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]
#: per prompt: requests finish one after another, so the running count falls mid-run (async mode:
#: the steps of 3 or more requests run ahead without drafts, the later ones speculate)
MAX_TOKENS = (3, 5, 16, 16)
ARCHS = ("llama", "gemma3")
MODES = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    # the two long requests grow from 3 to 4 blocks of 16 (36-token prompts + 16) in 6 blocks
    "preemption": {"num_gpu_blocks_override": 6, "max_model_len": 64},
    # n-gram keeps async scheduling: steps of >= 3 running requests run ahead without drafts
    "async": {"async_scheduling": True},
}


def echo_prompts(model_dir: str) -> list[list[int]]:
    """Two prompts that repeat a span, then two ``P + greedy(P)[:30]`` whose greedy continuation
    repeats n-grams of its own context most often among a few random ``P`` (a random tiny model
    rarely repeats its prompt; n-gram drafts are then accepted there by construction)."""
    import numpy as np

    from pagedlm.core.spec_decode.ngram_proposer import ngram_drafts
    from pagedlm.core.testing import hf_greedy

    rng = random.Random(0)
    spans = [[rng.randrange(4, 500) for _ in range(n)] for n in (5, 9)]
    starts = [[rng.randrange(4, 500) for _ in range(6)] for _ in range(8)]
    outs = [r.token_ids for r in hf_greedy(model_dir, starts, 30 + max(MAX_TOKENS))]

    def hits(seq: list[int]) -> int:
        return sum(ngram_drafts(np.array(seq[:t]), 1, 3, 1) == [seq[t]] for t in range(36, len(seq)))

    scored = sorted(((hits(p + o), p + o[:30]) for p, o in zip(starts, outs, strict=True)), key=lambda x: -x[0])
    return [spans[0] * 3, spans[1] * 2] + [prompt for _, prompt in scored[:2]]


def spec_config(method: str, model: str, mode: str) -> dict:
    if method == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        return {**cfg, "disable_by_batch_size": 3} if mode == "async" else cfg
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


def engine_options(device) -> dict:
    if device.type == "cuda":
        return {"device": "cuda"}
    return {"device": "cpu", "attention_backend": "triton", "num_gpu_blocks_override": 64, "max_num_seqs": 8,
            "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def cuda_runner(device):
    """Puts CPU engines on the CUDA runner with the graph stand-in (a no-op on a GPU)."""
    mp = pytest.MonkeyPatch()
    if device.type != "cuda":
        from pagedlm.backends.cpu.platform import CpuPlatform
        from pagedlm.backends.cuda.model_runner import CudaModelRunner

        mp.setattr(CpuPlatform, "get_model_runner_cls",
                   lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
        mp.setattr(CudaModelRunner, "emulate_graphs", True)
    yield engine_options(device)
    mp.undo()


@pytest.fixture(scope="module")
def references(tiny_checkpoints, cuda_runner):
    """arch -> (prompts, HF greedy results, the CUDA runner's tokens without speculation)."""
    from pagedlm.core import LLM
    from pagedlm.core.testing import hf_greedy

    refs = {}
    for arch in ARCHS:
        prompts = echo_prompts(tiny_checkpoints[arch])
        llm = LLM(model=tiny_checkpoints[arch], dtype="float32", **cuda_runner)
        off = generate(llm, prompts)
        llm.shutdown()
        hf = hf_greedy(tiny_checkpoints[arch], prompts, max(MAX_TOKENS))
        refs[arch] = prompts, [dataclasses.replace(r, token_ids=r.token_ids[:n], top2_gaps=r.top2_gaps[:n])
                               for r, n in zip(hf, MAX_TOKENS, strict=True)], off
    return refs


def generate(llm, prompts: list[list[int]]) -> list[list[int]]:
    from pagedlm.core import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def count_verification_replays(runner) -> dict[int, int]:
    """Mixed-graph replays (per padded size) of the steps that verify drafts."""
    counts = dict.fromkeys(runner._mixed_graphs, 0)
    verifying = [False]
    execute = runner.execute_model

    def execute_model(sched, non_block=False):
        verifying[0] = bool(sched.scheduled_spec_decode_tokens)
        return execute(sched, non_block)

    runner.execute_model = execute_model
    for size, (replay, out) in list(runner._mixed_graphs.items()):
        def counted(replay=replay, size=size):
            counts[size] += verifying[0]
            replay()
        runner._mixed_graphs[size] = (counted, out)
    return counts


CASES = [(arch, "ngram", mode) for arch in ARCHS for mode in MODES] + [
    ("llama", "self-draft", "default"), ("llama", "self-draft", "chunked-tiny-budget"),
    ("gemma3", "self-draft", "default")]


@pytest.mark.parametrize(("arch", "method", "mode"), CASES)
def test_greedy_with_speculation_matches_hf_and_speculation_off(arch, method, mode, tiny_checkpoints, references,
                                                                 cuda_runner):
    from pagedlm.backends.cuda.model_runner import default_mixed_capture_sizes
    from pagedlm.backends.cuda.spec_graphs import verification_capture_sizes
    from pagedlm.core import LLM
    from pagedlm.core.testing import compare_greedy

    kwargs = {**cuda_runner, **MODES[mode]}
    if arch == "gemma3" and mode == "preemption":
        # two groups of one layer (full, sliding): the sliding one frees what leaves its window, so
        # these prompts preempt with 12 blocks and not with 8-10 (found on the CPU platform)
        kwargs["num_gpu_blocks_override"] = 12
    model = tiny_checkpoints[arch]
    prompts, hf, off = references[arch]
    llm = LLM(model=model, dtype="float32", speculative_config=spec_config(method, model, mode), **kwargs)
    runner = llm.llm_engine.core.executor.worker.model_runner
    assert type(runner).__name__ == "CudaModelRunner"
    default_sizes = default_mixed_capture_sizes(runner.max_num_tokens)
    verification_sizes = verification_capture_sizes(3, runner.capture_sizes, default_sizes[0])
    assert verification_sizes and sorted(runner._mixed_graphs) == verification_sizes + default_sizes
    replays = count_verification_replays(runner)
    ours = generate(llm, prompts)
    mismatches, forgiven = compare_greedy(ours, hf)
    assert mismatches == 0 and forgiven <= 1, (mismatches, forgiven)
    assert ours == off
    core = llm.llm_engine.core
    stats = core.scheduler.spec.stats
    if arch == "llama" or method == "self-draft":  # (the tiny Gemma 3's outputs seldom repeat their context)
        assert stats.num_accepted_tokens > 0, stats
    if method == "self-draft":
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9, stats
    # verification steps replayed mixed-batch graphs (the verification-sized ones where drafts are many)
    if stats.num_drafts:
        assert sum(replays.values()) > 0, replays
    if arch == "llama":
        assert sum(replays[s] for s in verification_sizes) > 0, replays
    if mode == "preemption":
        assert core.scheduler.num_preemptions_total > 0
    llm.shutdown()
