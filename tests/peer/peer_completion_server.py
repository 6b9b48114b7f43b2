# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9),
# tests/entrypoints/openai/completion/test_completion.py: its module fixtures, shared here by the files that test
# file is split into; licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's
# test helpers point at peer_utils; adjusted where marked "pagedlm:".
"""The module fixtures of vLLM's completion tests: each test module that imports them starts its own
server, as each of vLLM's modules does."""

import pytest
import pytest_asyncio
from peer_utils import RemoteOpenAIServer

# any model with a chat template should work here
MODEL_NAME = "Qwen/Qwen3-0.6B"


@pytest.fixture(scope="module")
def default_server_args():
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "128",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--no-enable-prefix-caching",
    ]


@pytest.fixture(scope="module")
def server(default_server_args):
    with RemoteOpenAIServer(MODEL_NAME, default_server_args) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client
