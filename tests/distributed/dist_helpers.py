"""Shared by the tests of this folder (a plain module: test files import it by name)."""

from __future__ import annotations

import os
import random
import time

from pagedlm.core import LLM, SamplingParams

MAX_NEW = 10
# A small token budget: prompts are chunked over several steps and several batches exist at
# once, so pipeline parallelism really has more than one batch in flight.
ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 32, "max_model_len": 256}
# The same checks on GPUs (NCCL instead of gloo): PAGEDLM_TEST_DIST_DEVICE=cuda on a multi-GPU host.
if os.environ.get("PAGEDLM_TEST_DIST_DEVICE") == "cuda":
    ENGINE_KWARGS["device"] = "cuda"


def skip_unless_devices(world_size: int) -> None:
    """Skip when the engine's device type has fewer than ``world_size`` devices (CPU ranks share
    the host, so they never skip)."""
    if ENGINE_KWARGS["device"] != "cuda":
        return
    import pytest
    import torch

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this host has {torch.cuda.device_count()}")


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(4, 500) for _ in range(40)]
    return [base[:40], base[:20] + [9, 8, 7], [rng.randrange(4, 500) for _ in range(3)],
            [rng.randrange(4, 500) for _ in range(57)], base[:5]]


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
