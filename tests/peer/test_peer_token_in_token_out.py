# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9), tests/entrypoints/openai/completion/test_token_in_token_out.py;
# licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's test helpers point at
# peer_utils, and the tests listed in tests/peer/README.md are skipped (with the reason below) or
# adjusted where marked "pagedlm:".
import os
import tempfile

import pytest

from peer_utils import RemoteOpenAIServer, tiny_model_dir
from peer_utils import get_tokenizer

MODEL_NAME = "Qwen/Qwen3-0.6B"
MODEL_PATH = os.path.join(tempfile.gettempdir(), "qwen3_06b")


@pytest.fixture(scope="module")
def server():
    global MODEL_PATH
    MODEL_PATH = tiny_model_dir()  # pagedlm: the tiny checkpoint, not a download of Qwen3's config
    args = [
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "128",
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--load-format",
        "dummy",
    ]
    with RemoteOpenAIServer(MODEL_PATH, args) as remote_server:
        yield remote_server


@pytest.mark.asyncio
async def test_token_in_token_out_and_logprobs(server):
    """Test token-in-token-out and token_ids align with prompt_logprobs
    & logprobs when return_tokens_as_token_ids is enabled.
    """
    tokenizer = get_tokenizer(tokenizer_name=MODEL_NAME)
    text = "Hello, world! How are you today?"
    token_ids = tokenizer.encode(text)
    async with server.get_async_client() as client:
        # Test with both return_token_ids and return_tokens_as_token_ids enabled
        completion = await client.completions.create(
            model=MODEL_PATH,
            prompt=token_ids,
            max_tokens=20,
            temperature=0,
            echo=True,
            extra_body={
                "return_token_ids": True,
            },
        )

        # Verify all fields are present
        assert (
            completion.choices[0].token_ids is not None
            and 0 < len(completion.choices[0].token_ids) <= 20
        )
        assert completion.choices[0].prompt_token_ids is not None

        # Decode prompt tokens
        if completion.choices[0].prompt_token_ids:
            # pagedlm: the tiny tokenizer adds BOS (Qwen's does not), which the decode leaves out
            prompt_text = tokenizer.decode(completion.choices[0].prompt_token_ids, skip_special_tokens=True)
            # The decoded prompt should match or close to original prompt
            assert prompt_text == text
