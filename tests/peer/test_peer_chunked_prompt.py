# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9), tests/entrypoints/openai/test_chunked_prompt.py;
# licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's test helpers point at
# peer_utils, and the tests listed in tests/peer/README.md are skipped (with the reason below) or
# adjusted where marked "pagedlm:".
import openai  # use the official client for correctness check
import pytest
import pytest_asyncio

from peer_utils import RemoteOpenAIServer

# any model with a chat template should work here
MODEL_NAME = "Qwen/Qwen3-0.6B"


@pytest.fixture(scope="module")
def server():
    args = [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--enforce-eager",
        "--max-num-seqs",
        "128",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        "1000",
    ]

    with RemoteOpenAIServer(MODEL_NAME, args) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


@pytest.mark.asyncio
async def test_completion_stream_options_and_logprobs_with_long_prompts(
    client: openai.AsyncOpenAI,
):
    # Test stream with long prompt
    prompt = "What is the capital of France?" * 400

    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=5,
        temperature=0.0,
        stream=True,
        stream_options={
            "include_usage": True,
            "continuous_usage_stats": True,
        },
        logprobs=5,
    )

    tokens_received = 0
    finished = False
    async for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert chunk.usage.completion_tokens >= 0
        assert chunk.usage.total_tokens == (
            chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        )
        if not finished:
            # A final chunk may carry only the finish_reason with no text and
            # no logprobs (Rust); every chunk that carries tokens is checked.
            if chunk.choices[0].finish_reason is None or chunk.choices[0].text:
                # pagedlm: a chunk's text may be empty: the random model's tokens are often bytes
                # of an unfinished UTF-8 character, whose text comes with a later chunk (the
                # token and its logprobs come now)
                # Count actual tokens from logprobs since multiple tokens
                # can be batched into a single chunk
                assert chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens
                tokens_received += len(chunk.choices[0].logprobs.tokens)

            if chunk.choices[0].finish_reason is not None:
                finished = True

        if finished:
            assert chunk.usage.completion_tokens == tokens_received


@pytest.mark.asyncio
async def test_chat_completion_stream_options_and_logprobs_with_long_prompts(
    client: openai.AsyncOpenAI,
):
    # Test stream with long prompt
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?" * 400},
    ]
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=5,
        temperature=0.0,
        stream=True,
        stream_options={
            "include_usage": True,
            "continuous_usage_stats": True,
        },
        logprobs=True,
        top_logprobs=5,
    )

    tokens_received = 0
    empty_chunks_received = 0
    finished = False
    async for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert chunk.usage.completion_tokens >= 0
        assert chunk.usage.total_tokens == (
            chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        )

        if not finished:
            # pagedlm: the role-only chunk is told apart by its logprobs (none), not by empty
            # content: a token that is bytes of an unfinished UTF-8 character streams with
            # content "" and its logprobs (its text comes with a later chunk)
            if chunk.choices[0].logprobs is None and (
                chunk.choices[0].delta.content == ""
                or chunk.choices[0].finish_reason is None
            ):
                # when there is no tokens generated (the role-only first chunk;
                # Python sends content="", Rust omits content)
                assert chunk.usage.completion_tokens == 0
                assert chunk.choices[0].logprobs is None
                empty_chunks_received += 1
            elif chunk.choices[0].delta.content is None:
                # final chunk with only the finish_reason (Rust)
                assert chunk.choices[0].logprobs is None
            else:
                # Count actual tokens from logprobs since multiple tokens
                # can be batched into a single chunk
                assert chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
                tokens_received += len(chunk.choices[0].logprobs.content)

            if chunk.choices[0].finish_reason is not None:
                finished = True

        if finished:
            assert chunk.usage.completion_tokens == tokens_received

    assert empty_chunks_received <= 1
