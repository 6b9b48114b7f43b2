"""A dead or failing worker ends the engine quickly, with an error naming the rank, and leaves no
process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
from dist_helpers import wait_gone

from pagedlm.core import LLM, SamplingParams


@pytest.mark.timeout(120)
def test_killed_worker_fails_the_engine_naming_its_rank(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2)
    engine = llm.llm_engine
    pids = list(engine.core.executor.worker_pids)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7, 8]}, params)
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 .*died unexpectedly \(killed by SIGKILL\)"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10.0
    # The surviving rank is stopped too, and the engine stays failed with the same message.
    assert wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="worker rank 1"):
        engine.step()
    llm.shutdown()  # idempotent after a failure


@pytest.mark.timeout(120)
def test_worker_error_at_start_names_the_rank(tiny_llama):
    # Three pipeline stages for a two-layer model: every rank refuses to build its stage.
    expected = r"worker rank \d raised an error; .*: ValueError: pipeline_parallel_size=3 exceeds"
    with pytest.raises(RuntimeError, match=expected):
        LLM(model=tiny_llama, dtype="float32", device="cpu", pipeline_parallel_size=3)
