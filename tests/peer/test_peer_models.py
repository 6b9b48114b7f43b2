# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9), tests/entrypoints/openai/models/test_models.py;
# licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's test helpers point at
# peer_utils, and the tests listed in tests/peer/README.md are skipped (with the reason below) or
# adjusted where marked "pagedlm:".
import openai  # use the official client for correctness check
import pytest
import pytest_asyncio

from peer_utils import RemoteOpenAIServer, tiny_model_dir

# any model with a chat template should work here
MODEL_NAME = "Qwen/Qwen3-0.6B"
# technically this needs Mistral-7B-v0.1 as base, but we're not testing
# generation quality here


@pytest.fixture(scope="module")
def server(qwen3_lora_files):
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
        f"qwen3-lora={qwen3_lora_files}",
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


@pytest.mark.asyncio
async def test_check_models(client: openai.AsyncOpenAI, qwen3_lora_files):
    models = await client.models.list()
    models = models.data
    served_model = models[0]
    lora_models = models[1:]
    assert served_model.id == MODEL_NAME
    # pagedlm: root is the checkpoint actually served (peer_utils serves the tiny one under
    # MODEL_NAME), as vLLM's root is the model path it loaded
    assert served_model.root == tiny_model_dir()
    assert all(lora_model.root == qwen3_lora_files for lora_model in lora_models)
    assert lora_models[0].id == "qwen3-lora"
