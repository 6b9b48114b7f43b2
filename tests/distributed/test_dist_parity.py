"""TP=2, PP=2, TP=2 x PP=2 and DP=2 give the greedy tokens of one process (fp32, CPU, gloo; on
GPUs with NCCL when ``PAGEDLM_TEST_DIST_DEVICE=cuda``, see dist_helpers).

Each case starts real worker processes (a few seconds each on two cores), so the cases are few
and each checks several things on the same engine: tokens, the pipeline depth reached, and that
stopping the engine (explicitly, or by dropping the ``LLM``) leaves no process behind.
"""

from __future__ import annotations

import gc
import os

import pytest
from dist_helpers import ENGINE_KWARGS, generate, skip_unless_devices, wait_gone

from pagedlm.core import LLM

LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp2": {"data_parallel_size": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory):
    return {arch: tiny_checkpoint_factory(arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def single_process_tokens(checkpoints):
    result = {}
    for arch, path in checkpoints.items():
        llm = LLM(model=path, **ENGINE_KWARGS)
        result[arch] = generate(llm)
        llm.shutdown()
    return result


def _child_pids(llm: LLM) -> list[int]:
    client = llm.llm_engine.engine_core
    if hasattr(client, "replica_pids"):
        return list(client.replica_pids)
    return list(client.engine_core.executor.worker_pids)


def _count_batches_in_flight(llm: LLM) -> list[int]:
    """Record, at each submission, how many batches are in flight (kept out of the test's frame
    so that dropping ``llm`` really drops the engine)."""
    core = llm.llm_engine.core
    assert core.batch_queue_size == 2
    submit = core.executor.execute_model
    depth: list[int] = []

    def counting(scheduler_output, non_block=False):
        depth.append(len(core.batch_queue) + 1)
        return submit(scheduler_output, non_block)

    core.executor.execute_model = counting
    return depth


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layout_matches_single_process(arch, layout, checkpoints, single_process_tokens):
    sizes = LAYOUTS[layout]
    skip_unless_devices(sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1)
                        * sizes.get("data_parallel_size", 1))
    llm = LLM(model=checkpoints[arch], **ENGINE_KWARGS, **LAYOUTS[layout])
    pids = _child_pids(llm)
    assert len(pids) == (2 if layout != "tp2pp2" else 4)
    depth = _count_batches_in_flight(llm) if "pp" in layout else []
    try:
        assert generate(llm) == single_process_tokens[arch]
        if depth:
            # Prefill chunks and, in steady state, the decodes split in two: both stages busy.
            assert depth.count(2) >= 0.8 * len(depth), f"batches in flight at each submission: {depth}"
    finally:
        if arch == "llama":
            llm.shutdown()
        else:
            # Dropping the last reference must stop the workers too (no explicit shutdown).
            del llm
            gc.collect()
    assert wait_gone(pids) == [], "worker processes outlived the engine"


@pytest.mark.timeout(120)
def test_interpreter_exit_leaves_no_workers(tmp_path, checkpoints):
    """A script that never calls shutdown(): its workers end with it."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from pagedlm.core import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={checkpoints['llama']!r}, dtype='float32', device='cpu', tensor_parallel_size=2)\n"
        "    print('PIDS', *llm.llm_engine.core.executor.worker_pids, flush=True)\n"
    )
    env = {**os.environ, "PAGEDLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2
    assert wait_gone(pids, 5.0) == []
