# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9),
# tests/entrypoints/openai/chat_completion/test_chat.py: its module fixtures, shared here by the files that test
# file is split into; licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's
# test helpers point at peer_utils; adjusted where marked "pagedlm:".
"""The module fixtures of vLLM's chat tests: each test module that imports them starts its own
server, as each of vLLM's modules does."""

import pytest
import pytest_asyncio
from peer_utils import RemoteOpenAIServer, tiny_lora_dir

# any model with a chat template should work here
MODEL_NAME = "HuggingFaceH4/zephyr-7b-beta"


@pytest.fixture(scope="module")
def zephyr_lora_files():
    """Download zephyr LoRA files once per test session."""
    return tiny_lora_dir()  # pagedlm: a PEFT adapter of the tiny checkpoint, built here


@pytest.fixture(scope="module")
def server(zephyr_lora_files):
    args = [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--enforce-eager",
        # lora config below
        "--enable-lora",
        "--lora-modules",
        f"zephyr-lora={zephyr_lora_files}",
        "--max-lora-rank",
        "64",
        "--max-cpu-loras",
        "2",
        "--max-num-seqs",
        "128",
    ]

    with RemoteOpenAIServer(MODEL_NAME, args) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client
