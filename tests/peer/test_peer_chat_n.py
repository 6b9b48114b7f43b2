# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9), tests/entrypoints/openai/chat_completion/test_chat.py (its tests of n); licensed under
# Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's test helpers point at peer_utils, and
# the tests listed in tests/peer/README.md are skipped (with the reason below) or adjusted where
# marked "pagedlm:".

# imports for structured outputs tests
import json
from collections import defaultdict

import jsonschema
import openai  # use the official client for correctness check
import pytest
import pytest_asyncio
import regex as re
import requests
import torch
from openai import BadRequestError

from peer_chat_server import MODEL_NAME, client, server, zephyr_lora_files  # noqa: F401 - module fixtures
from peer_utils import RemoteOpenAIServer, tiny_lora_dir
# pagedlm: vLLM's request classes are used only by its unit tests, skipped here
BatchChatCompletionRequest = ChatCompletionRequest = VLLMValidationError = SamplingParams = None


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_chat_completion_n_parameter_non_streaming(
    client: openai.AsyncOpenAI, model_name: str
):
    """Test that n parameter returns multiple choices for non-streaming requests."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the opposite of big?"},
    ]

    # Test with n=3
    chat_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=50,
        temperature=1.0,
        n=3,
        seed=42,
        stream=False,
    )

    assert len(chat_completion.choices) == 3

    # Verify each choice has content and correct index
    for i, choice in enumerate(chat_completion.choices):
        assert choice.index == i
        assert choice.message.content is not None
        assert len(choice.message.content) > 0

    contents = [choice.message.content for choice in chat_completion.choices]
    assert len(set(contents)) > 1, "Expected different responses with n=3"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_chat_completion_n_parameter_streaming(
    client: openai.AsyncOpenAI, model_name: str
):
    """Test that n parameter returns multiple choices for streaming requests."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]

    stream = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=15,
        temperature=0.7,
        n=2,
        stream=True,
    )

    # Collect all chunks using defaultdict for dynamic handling
    chunks_by_index = defaultdict(list)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                chunks_by_index[choice.index].append(choice.delta.content)

    # Verify both choices received content
    assert len(chunks_by_index[0]) > 0, "Choice 0 received no content chunks"
    assert len(chunks_by_index[1]) > 0, "Choice 1 received no content chunks"

    # Reconstruct full responses
    response_0 = "".join(chunks_by_index[0])
    response_1 = "".join(chunks_by_index[1])

    assert len(response_0) > 0, "Choice 0 has empty response"
    assert len(response_1) > 0, "Choice 1 has empty response"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_chat_completion_n_with_seed(client: openai.AsyncOpenAI, model_name: str):
    """Test that n parameter works correctly with seed parameter."""
    messages = [
        {"role": "user", "content": "Say hello."},
    ]

    # Test that seed parameter is accepted and works with n > 1
    chat_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=10,
        temperature=0.8,
        n=2,
        seed=42,
        stream=False,
    )

    # Verify we get n=2 choices
    assert len(chat_completion.choices) == 2

    # Verify both choices have valid content
    for i, choice in enumerate(chat_completion.choices):
        assert choice.index == i
        assert choice.message.content is not None
        assert len(choice.message.content) > 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_chat_completion_n_equals_1(client: openai.AsyncOpenAI, model_name: str):
    """Test that n=1 (default) still works correctly."""
    messages = [
        {"role": "user", "content": "Hello!"},
    ]

    chat_completion = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=10,
        temperature=0.7,
        n=1,
        stream=False,
    )

    assert len(chat_completion.choices) == 1
    assert chat_completion.choices[0].index == 0
    assert chat_completion.choices[0].message.content is not None


# Unit tests for n parameter in ChatCompletionRequest.to_sampling_params()
@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_to_sampling_params():
    """Test that n parameter is correctly passed to SamplingParams."""
    # Test with n=3
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Hello"}],
        n=3,
        max_tokens=10,
    )

    sampling_params = request.to_sampling_params(
        max_tokens=10,
        default_sampling_params={},
    )

    assert isinstance(sampling_params, SamplingParams)
    assert sampling_params.n == 3, f"Expected n=3, got n={sampling_params.n}"


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_default():
    """Test that n parameter defaults to 1."""
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Hello"}],
        # n not specified, should default to 1
        max_tokens=10,
    )

    assert request.n == 1, "n should default to 1"
    sampling_params = request.to_sampling_params(
        max_tokens=10,
        default_sampling_params={},
    )

    # SamplingParams.from_optional converts None to 1
    assert sampling_params.n == 1, f"Expected n=1 (default), got n={sampling_params.n}"


@pytest.mark.parametrize(
    ("request_cls", "messages"),
    [
        (ChatCompletionRequest, [{"role": "user", "content": "Hello"}]),
        (BatchChatCompletionRequest, [[{"role": "user", "content": "Hello"}]]),
    ],
)
@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_null_top_logprobs_is_same_as_omitted(request_cls, messages):
    """`top_logprobs: null` must not switch off `logprobs: true`."""
    request = request_cls.model_validate(
        {"messages": messages, "logprobs": True, "top_logprobs": None}
    )

    assert request.top_logprobs == 0


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_accepts_model_specific_reasoning_effort():
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Hello"}],
        reasoning_effort="max",
    )

    chat_params = request.build_chat_params(
        default_template=None,
        default_template_content_format="auto",
    )

    assert request.reasoning_effort == "max"
    assert chat_params.chat_template_kwargs["reasoning_effort"] == "max"


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_rejects_unknown_reasoning_effort():
    with pytest.raises(ValueError, match="Input should be"):
        ChatCompletionRequest(
            model="test-model",
            messages=[{"role": "user", "content": "Hello"}],
            reasoning_effort="extra_high",
        )


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_various_values():
    """Test n parameter with various values."""
    for n_value in [1, 2, 5, 10]:
        request = ChatCompletionRequest(
            model="test-model",
            messages=[{"role": "user", "content": "Test"}],
            n=n_value,
            max_tokens=10,
        )

        sampling_params = request.to_sampling_params(
            max_tokens=10,
            default_sampling_params={},
        )

        assert sampling_params.n == n_value, (
            f"Expected n={n_value}, got n={sampling_params.n}"
        )


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_exceeds_default_limit(
    monkeypatch: pytest.MonkeyPatch,
):
    """Test that n values exceeding the default limit are rejected."""
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()

    max_n = envs.VLLM_MAX_N_SEQUENCES
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Test"}],
        n=max_n + 1,
        max_tokens=10,
    )

    with pytest.raises(VLLMValidationError, match="n must be at most"):
        request.to_sampling_params(
            max_tokens=10,
            default_sampling_params={},
        )


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_at_limit(
    monkeypatch: pytest.MonkeyPatch,
):
    """Test that n at exactly the limit is accepted."""
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()

    max_n = envs.VLLM_MAX_N_SEQUENCES
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Test"}],
        n=max_n,
        max_tokens=10,
    )

    sampling_params = request.to_sampling_params(
        max_tokens=10,
        default_sampling_params={},
    )
    assert sampling_params.n == max_n


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_custom_limit(
    monkeypatch: pytest.MonkeyPatch,
):
    """Test that VLLM_MAX_N_SEQUENCES env var overrides the default limit."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "128")
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()

    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Test"}],
        n=128,
        max_tokens=10,
    )

    sampling_params = request.to_sampling_params(
        max_tokens=10,
        default_sampling_params={},
    )
    assert sampling_params.n == 128

    request_over = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Test"}],
        n=129,
        max_tokens=10,
    )

    with pytest.raises(VLLMValidationError, match="n must be at most 128"):
        request_over.to_sampling_params(
            max_tokens=10,
            default_sampling_params={},
        )


@pytest.mark.skip(reason="a unit test of vLLM's own request classes (vllm.entrypoints...), not of the HTTP server")
def test_chat_completion_request_n_parameter_massive_value(
    monkeypatch: pytest.MonkeyPatch,
):
    """Test that astronomically large n values are rejected (CVE fix)."""
    import vllm.envs as envs

    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()

    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "Test"}],
        n=100_000_000,
        max_tokens=1,
    )

    with pytest.raises(VLLMValidationError, match="n must be at most"):
        request.to_sampling_params(
            max_tokens=1,
            default_sampling_params={},
        )
