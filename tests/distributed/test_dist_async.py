"""The server's engine (AsyncLLM, engine core in its own process) with DP=2 and with TP=2."""

from __future__ import annotations

import asyncio

import pytest
from dist_helpers import ENGINE_KWARGS, generate, prompts, wait_gone

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.async_llm import AsyncLLM


async def _generate_all(engine: AsyncLLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"r{i}"):
            final = out
        assert final is not None and final.finished
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts()))))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [{"data_parallel_size": 2}, {"tensor_parallel_size": 2}])
def test_async_engine_layout_matches_single_process(tiny_llama, layout):
    expected = generate(LLM(model=tiny_llama, **ENGINE_KWARGS))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE_KWARGS, **layout), log_stats=False)
    client = engine.engine_core
    pids = [c.pid for c in client.clients] if hasattr(client, "clients") else [client.pid]
    try:
        assert asyncio.run(_generate_all(engine)) == expected
        if hasattr(client, "load"):
            assert client.load == [0, 0] and not client.owner
    finally:
        engine.shutdown()
    assert wait_gone(pids) == []
