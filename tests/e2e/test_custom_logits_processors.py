"""Custom logits processors end to end (``LLM(logits_processors=[...])``, ``extra_args``): the
rows that enable one change, every other row gives the tokens it gives without any."""

from __future__ import annotations

import pytest

from pagedlm.core import LLM, SamplingParams

DUMMY = "pagedlm.core.testing.logits_processors:DummyLogitsProcessor"
TOP_ONE = "pagedlm.core.testing.logits_processors:TopOneLogitsProcessor"
ADAPTER = "pagedlm.core.testing.logits_processors:RepeatAdapterLogitsProcessor"
PROMPTS = [{"prompt_token_ids": [5 + i, 40 + 3 * i, 17, 90 - i] * (1 + i % 3)} for i in range(6)]


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)


def _mixed_params(**extra) -> list[SamplingParams]:
    params = []
    for i in range(len(PROMPTS)):
        args = {"target_token": 30 + i} if i % 2 == 0 else None
        params.append(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, extra_args=args, **extra))
    return params


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 16, "block_size": 4,
                                      "max_model_len": 48}],
                         ids=["default", "async-scheduling", "preemption-and-chunks"])
def test_target_rows_change_and_the_others_keep_their_greedy_tokens(tiny_llama, plain, options):
    expected = _tokens(plain.generate(PROMPTS, _mixed_params(), use_tqdm=False))
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", logits_processors=[DUMMY],
              **({"kv_cache_memory_bytes": 16 << 20} | options))
    got = _tokens(llm.generate(PROMPTS, _mixed_params(), use_tqdm=False))
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == ([30 + i] * 8 if i % 2 == 0 else e), i
    if "num_gpu_blocks_override" in options:
        assert llm.llm_engine.core.scheduler.num_preemptions_total > 0
    # The processor saw the requests come and go: the workers drop the last finished requests with
    # the next step, where the next request takes index 0 and the others' indices are removed.
    runner = llm.llm_engine.core.executor.worker.model_runner
    dummy = next(iter(runner.logitsprocs.procs.all))
    assert sum(len(u.added) for u in dummy.updates if u is not None) >= len(PROMPTS)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    last = [u for u in dummy.updates if u is not None][-1]
    assert last.batch_size == 1 and [a[0] for a in last.added] == [0] and dummy.req_info == {}
    assert sorted(last.removed) == list(range(1, len(last.removed) + 1))


def test_argmax_invariant_processor_runs_on_the_random_path_only(tiny_llama, plain):
    greedy = _tokens(plain.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                    use_tqdm=False))
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    random_alone = _tokens(plain.generate(PROMPTS[2:3], seeded, use_tqdm=False))
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              logits_processors=[TOP_ONE])
    params = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, extra_args={"top_one": True}),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args={"top_one": True}),
              seeded]
    got = _tokens(llm.generate(PROMPTS[:3], params, use_tqdm=False))
    # Keeping the top token only makes sampling greedy; greedy rows and rows without it are unchanged.
    assert got == greedy + random_alone


def test_adapter_wraps_per_request_functions(tiny_llama, plain):
    first = _tokens(plain.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False))[0][0]
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              logits_processors=[ADAPTER])
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, extra_args={"repeat": True}),
              SamplingParams(temperature=0.9, seed=1, max_tokens=5, ignore_eos=True, extra_args={"echo_first": True})]
    got = _tokens(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert got == [[first] * 5, [PROMPTS[1]["prompt_token_ids"][0]] * 5]


def test_validate_params_and_bad_names_are_refused(tiny_llama):
    llm = LLM(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20, logits_processors=[DUMMY])
    with pytest.raises(ValueError, match=r"extra_args\['target_token'\]=-1 must be a token id"):
        llm.generate(PROMPTS[:2], [SamplingParams(), SamplingParams(extra_args={"target_token": -1})], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="cannot be loaded"):
        LLM(model=tiny_llama, device="cpu", logits_processors=["pagedlm.core.testing.logits_processors:Nope"])
    with pytest.raises(ValueError, match="must be a list"):
        LLM(model=tiny_llama, device="cpu", logits_processors=DUMMY)
    with pytest.raises(ValueError, match="extra_args=.* is invalid"):
        SamplingParams(extra_args=["target_token"])


def test_worker_processes_load_processors_by_name(tiny_llama, plain):
    """The multiprocess executor: every worker resolves the "module:Class" names itself."""
    expected = _tokens(plain.generate(PROMPTS[:2], _mixed_params()[:2], use_tqdm=False))
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              distributed_executor_backend="mp", logits_processors=[DUMMY])
    try:
        assert _tokens(llm.generate(PROMPTS[:2], _mixed_params()[:2], use_tqdm=False)) == [[30] * 8, expected[1]]
    finally:
        llm.shutdown()


def test_cli_takes_logits_processor_names():
    from pagedlm.core import EngineArgs
    from pagedlm.core.utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--logits-processors", DUMMY, TOP_ONE])
    assert EngineArgs.from_cli_args(args).logits_processors == [DUMMY, TOP_ONE]
