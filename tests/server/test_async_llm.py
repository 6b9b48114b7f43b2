"""AsyncLLM without HTTP: in-process and engine-core-process clients, aborts, engine death, wire format."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedlm.core import SamplingParams
from pagedlm.core.engine import serial
from pagedlm.core.engine.arg_utils import EngineArgs
from pagedlm.core.engine.async_llm import AsyncLLM, EngineDeadError
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import RequestOutputKind
from pagedlm.core.sched import EngineCoreOutput

pytestmark = pytest.mark.timeout(300)

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def make(tiny_llama: str, multiprocess: bool, monkeypatch=None, **kwargs) -> AsyncLLM:
    if monkeypatch is not None:
        # the spawned core reads it at start-up: one thread per process on a small CI machine
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = EngineArgs(model=tiny_llama, dtype="float32", device="cpu", max_model_len=256, **kwargs)
    return AsyncLLM.from_engine_args(args, multiprocess=multiprocess, log_stats=False)


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> tuple[list[str], list]:
    """(texts per choice, outputs); DELTA outputs are concatenated."""
    outs = [out async for out in llm.generate(prompt, params, request_id)]
    texts: dict[int, str] = {}
    for out in outs:
        for c in out.outputs:
            texts[c.index] = (texts.get(c.index, "") + c.text) if params.output_kind == DELTA else c.text
    return [texts[i] for i in sorted(texts)], outs


@pytest.fixture(scope="module")
def inproc(tiny_llama):
    llm = make(tiny_llama, multiprocess=False)
    yield llm
    llm.shutdown()


def _straddling_stop(pieces: list[str]) -> str:
    """A 2-character stop string whose first character ends one streamed piece and whose second
    begins the next: the case where streaming could send text the stop string then cuts."""
    full = "".join(pieces)
    offset = 0
    for a, b in zip(pieces, pieces[1:]):
        offset += len(a)
        if a and b:
            stop = a[-1] + b[0]
            if full.find(stop) == offset - 1:
                return stop
    raise AssertionError(f"no usable stop string in {pieces!r}")


def test_delta_and_final_agree_and_stop_strings_are_held_back(inproc):
    async def run():
        base = dict(temperature=0, max_tokens=30, ignore_eos=True)
        _, outs = await collect(inproc, "Hello there", SamplingParams(output_kind=DELTA, **base), "a")
        pieces = [o.outputs[0].text for o in outs]
        stop = _straddling_stop(pieces)
        jobs = [collect(inproc, "Hello there", SamplingParams(output_kind=kind, stop=[stop], **base), f"s{i}")
                for i, kind in enumerate((DELTA, FINAL, DELTA))]
        return "".join(pieces), stop, await asyncio.gather(*jobs)

    full, stop, results = asyncio.run(run())
    expected = full[: full.index(stop)]
    for texts, outs in results:
        assert texts == [expected]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"


def test_n_seed_and_bad_input(inproc):
    async def run():
        params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, output_kind=DELTA)
        a, _ = await collect(inproc, {"prompt_token_ids": [3, 4, 5]}, params, "n1")
        b, _ = await collect(inproc, {"prompt_token_ids": [3, 4, 5]}, params, "n2")
        with pytest.raises(ValueError, match="max_model_len=256"):
            await collect(inproc, "hi", SamplingParams(max_tokens=1000), "bad")
        return a, b

    a, b = asyncio.run(run())
    assert a == b and len(a) == 3 and len(set(a)) > 1
    assert inproc.num_unfinished_requests == 0


def test_abort_frees_blocks_at_once(inproc):
    async def run():
        gen = inproc.generate("Go on", SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA), "long")
        async for _ in gen:
            stats = inproc.latest_stats
            assert stats is not None and stats.num_running_reqs == 1 and stats.num_free_blocks < stats.num_blocks
            break
        await gen.aclose()  # what a disconnecting HTTP client causes
        for _ in range(100):
            stats = inproc.latest_stats
            if stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_blocks:
                return stats
            await asyncio.sleep(0.02)
        raise AssertionError(f"blocks not freed: {stats}")

    stats = asyncio.run(run())
    assert stats.kv_cache_usage == 0.0


def test_engine_core_process(tiny_llama, monkeypatch):
    llm = make(tiny_llama, multiprocess=True, monkeypatch=monkeypatch)
    try:
        assert llm.engine_pid != os.getpid()

        async def run():
            base = dict(temperature=0, max_tokens=12, ignore_eos=True)
            final = await collect(llm, "Process", SamplingParams(output_kind=FINAL, **base), "f")
            delta = await collect(llm, "Process", SamplingParams(output_kind=DELTA, **base), "d")
            return final[0], delta[0]

        final, delta = asyncio.run(run())
        assert final == delta and final[0]

        # a second event loop works too (the client is not tied to one loop)
        async def killed():
            gen = llm.generate("Die", SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA), "k")
            await gen.__anext__()
            os.kill(llm.engine_pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="died"):
                async for _ in gen:
                    pass
            assert time.monotonic() - start < 10
            with pytest.raises(EngineDeadError):
                await collect(llm, "after", SamplingParams(), "after")

        asyncio.run(killed())
        assert llm.is_dead
    finally:
        llm.shutdown()
        llm.shutdown()  # idempotent


def test_engine_core_startup_error_is_reported(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="KV cache holds 1 blocks"):
        make(tiny_llama, multiprocess=True, monkeypatch=monkeypatch, num_gpu_blocks_override=1)


def test_wire_format_round_trip():
    params = SamplingParams(n=1, temperature=0.5, stop=["x"], stop_token_ids=[3], logit_bias={5: -2.0}, seed=9,
                            logprobs=2, output_kind=DELTA)
    params.all_stop_token_ids |= {2, 3}
    request = EngineCoreRequest("r", [1, 2, 3], params, arrival_time=12.5)
    kind, payload = serial.decode(serial.encode_add(request))
    assert kind == serial.InputKind.ADD
    back = serial.request_from_wire(payload)
    assert (back.request_id, back.prompt_token_ids, back.arrival_time) == ("r", [1, 2, 3], 12.5)
    assert back.sampling_params == params and back.sampling_params.all_stop_token_ids == {2, 3}
    assert back.sampling_params.output_kind is DELTA

    out = EngineCoreOutput("r", [7], finish_reason="length", new_logprobs=([[7, 8]], [[-0.1, float("-inf")]], [1]),
                           num_cached_tokens=16)
    batch = serial.EngineCoreOutputs([out], None, 3.0)
    kind, payload = serial.decode(serial.encode_outputs(batch))
    got = serial.outputs_from_wire(payload).outputs[0]
    assert (got.request_id, got.new_token_ids, got.finish_reason, got.num_cached_tokens) == ("r", [7], "length", 16)
    assert got.new_logprobs[1][0][1] == float("-inf")


def test_tokens_after_a_stop_string_in_the_same_batch_are_dropped(inproc):
    # AsyncLLM hands the OutputProcessor several engine steps at once when it lags behind the core.
    from pagedlm.core.engine.output_processor import OutputProcessor

    tok = inproc.tokenizer
    ids = tok("hello world and more words", add_special_tokens=False).input_ids
    k = next(k for k in range(1, len(ids) + 1) if "world" in tok.decode(ids[:k]))
    assert k < len(ids)
    op = OutputProcessor(tok)
    params = SamplingParams(stop=["world"], output_kind=DELTA, max_tokens=50)
    op.add_request("p", None, [1], params, ["p"], [params])
    outputs, to_abort = op.process_outputs([EngineCoreOutput("p", ids[:k]), EngineCoreOutput("p", ids[k:])])
    assert to_abort == ["p"] and len(outputs) == 1
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[0].outputs[0].text == tok.decode(ids[:k]).split("world")[0]
