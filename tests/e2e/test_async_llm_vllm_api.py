"""vLLM's AsyncLLM surface beyond generate: pause_generation / resume_generation / is_paused,
start_profile / stop_profile, reset_prefix_cache, collective_rpc, prompt embeddings, with the
engine core in this process and in its own."""

from __future__ import annotations

import asyncio
import glob

import pytest
import torch

from pagedlm.core import SamplingParams
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.async_llm import AsyncLLM
from pagedlm.core.sampling_params import RequestOutputKind

pytestmark = pytest.mark.timeout(300)
LONG = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "core-process"])
def engine(tiny_llama, tmp_path_factory, request):
    traces = tmp_path_factory.mktemp("traces")
    args = EngineArgs(model=tiny_llama, dtype="float32", device="cpu", max_model_len=256, enable_prompt_embeds=True,
                      kv_cache_memory_bytes=16 << 20,
                      profiler_config={"profiler": "torch", "torch_profiler_dir": str(traces)})
    llm = AsyncLLM.from_engine_args(args, multiprocess=request.param, log_stats=False)
    llm.traces = traces  # type: ignore[attr-defined]
    yield llm
    llm.shutdown()


async def _tokens(llm, prompt, params, request_id) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async for out in llm.generate(prompt, params, request_id):
        if params.output_kind == RequestOutputKind.DELTA:
            ids.extend(out.outputs[0].token_ids)
        else:
            ids = list(out.outputs[0].token_ids)
        reason = out.outputs[0].finish_reason
    return ids, reason


async def _started(llm, prompt, params, request_id) -> tuple[asyncio.Task, list[int]]:
    """A generate task that has produced at least one token (a list that grows as it runs)."""
    seen: list[int] = []
    first = asyncio.Event()

    async def run():
        reason = None
        async for out in llm.generate(prompt, params, request_id):
            seen.extend(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason
            first.set()
        return reason

    task = asyncio.ensure_future(run())
    await asyncio.wait_for(first.wait(), 60)
    return task, seen


def test_pause_abort_ends_requests_and_holds_new_ones(engine):
    async def main():
        assert not await engine.is_paused()
        a, _ = await _started(engine, {"prompt_token_ids": [1, 2, 3]}, LONG, "a1")
        b, _ = await _started(engine, {"prompt_token_ids": [4, 5, 6]}, LONG, "a2")
        await engine.pause_generation()  # mode="abort"
        assert await engine.is_paused()
        assert await a == "abort" and await b == "abort"
        late = asyncio.ensure_future(_tokens(engine, {"prompt_token_ids": [7, 8]},
                                             SamplingParams(max_tokens=3, ignore_eos=True), "a3"))
        await asyncio.sleep(0.5)
        assert not late.done() and engine.num_unfinished_requests == 0  # held before the engine
        await engine.resume_generation()
        assert not await engine.is_paused()
        ids, reason = await asyncio.wait_for(late, 60)
        assert len(ids) == 3 and reason == "length"

    asyncio.run(main())


def test_pause_wait_lets_requests_finish(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        task, _ = await _started(engine, {"prompt_token_ids": [9, 10, 11]}, params, "w1")
        with pytest.warns(DeprecationWarning, match="use mode='wait'"):
            await engine.pause_generation(wait_for_inflight_requests=True)
        assert task.done() and await task == "length"
        await engine.resume_generation()
        with pytest.raises(ValueError, match="mode='later' is invalid"):
            await engine.pause_generation(mode="later")

    asyncio.run(main())


def test_pause_keep_freezes_requests_and_resume_continues_them(engine):
    async def main():
        prompt = {"prompt_token_ids": [12, 13, 14, 15]}
        expected, _ = await _tokens(engine, prompt, LONG, "k0")
        task, seen = await _started(engine, prompt, LONG, "k1")
        await engine.pause_generation(mode="keep", clear_cache=False)
        frozen = len(seen)
        await asyncio.sleep(0.5)
        assert len(seen) - frozen <= 2 and not task.done()  # at most the steps already in flight
        await engine.resume_generation()
        assert await asyncio.wait_for(task, 60) == "length" and seen == expected

    asyncio.run(main())


def test_utilities_profile_rpc_and_cache_reset(engine):
    async def main():
        await _tokens(engine, {"prompt_token_ids": list(range(1, 40))}, SamplingParams(max_tokens=2), "u0")
        assert await engine.reset_prefix_cache() is True
        assert await engine.collective_rpc("kv_cache_bytes_per_block") == [8192]
        with pytest.raises((RuntimeError, AttributeError), match="has no method 'nope'"):
            await engine.collective_rpc("nope")
        await engine.start_profile("async")
        await _tokens(engine, {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2), "u1")
        await engine.stop_profile()
        assert glob.glob(str(engine.traces / "async_dp0_pp0_tp0.*.pt.trace.json.gz"))

    asyncio.run(main())


def test_prompt_embeds_reach_the_engine_core(engine):
    """Over the core process's wire too (raw bytes, no pickle): same tokens as the ids."""
    async def main():
        ids = [21, 22, 23, 24, 25]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        expected, _ = await _tokens(engine, {"prompt_token_ids": ids}, params, "e0")
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(engine.model_config.model, dtype=torch.float32)
        with torch.no_grad():
            embeds = hf.get_input_embeddings()(torch.tensor(ids))
        got, _ = await _tokens(engine, {"prompt_embeds": embeds}, params, "e1")
        assert got == expected

    asyncio.run(main())


def test_requests_held_by_a_pause_fail_when_the_engine_stops(tiny_llama):
    from pagedlm.core.engine.async_llm import EngineDeadError

    llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, device="cpu", kv_cache_memory_bytes=16 << 20),
                                    multiprocess=False, log_stats=False)

    async def main():
        await llm.pause_generation()
        held = asyncio.ensure_future(_tokens(llm, {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), "h"))
        await asyncio.sleep(0.2)
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(held, 30)

    asyncio.run(main())
