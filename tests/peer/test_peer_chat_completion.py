# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Adapted for pagedlm from vLLM 0.33.0 (PyPI sdist, commit 4ba787ec9), tests/entrypoints/openai/chat_completion/test_chat_completion.py;
# licensed under Apache-2.0 (tests/peer/LICENSE). Changes: imports of vLLM's test helpers point at
# peer_utils, and the tests listed in tests/peer/README.md are skipped (with the reason below) or
# adjusted where marked "pagedlm:".
import openai  # use the official client for correctness check
import pytest
import pytest_asyncio

from peer_utils import RemoteOpenAIServer

# any model with a chat template defined in tokenizer_config should work here
MODEL_NAME = "Qwen/Qwen2.5-1.5B-Instruct"


@pytest.fixture(scope="module")
def default_server_args():
    return [
        # use half precision for speed and memory savings in CI environment
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "128",
        "--enforce-eager",
        "--enable-per-request-metrics",
    ]


@pytest.fixture(scope="module")
def server(default_server_args):
    with RemoteOpenAIServer(MODEL_NAME, default_server_args) as remote_server:
        yield remote_server


@pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_json_schema(client: openai.AsyncOpenAI, model_name: str) -> None:
    invalid_json_schema = {
        "$defs": {
            "CarType": {
                "enum": ["sedan", "SUV", "Truck", "Coupe"],
                "title": "CarType",
                "type": "string",
            }
        },
        "properties": {
            "brand": {"title": "Brand", "type": "string"},
            "model": {"title": "Model", "type": "string"},
            "car_type": {"$ref": "#/$defs/CarType"},
            "foo": "bar",
        },
        "required": ["brand", "model", "car_type"],
        "title": "CarDescription",
        "type": "object",
    }
    prompt = (
        "Generate a JSON with the brand, model and car_type of"
        "the most iconic car from the 90's"
    )
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"json": invalid_json_schema}},
        )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_regex(client: openai.AsyncOpenAI, model_name: str):
    prompt = (
        "Generate an email address for Alan Turing, who works in Enigma."
        "End in .com and new line. Example result:"
        "alan.turing@enigma.com\n"
    )

    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]},
        )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_invalid_grammar(client: openai.AsyncOpenAI, model_name: str):
    invalid_simplified_sql_grammar = """
        root ::= select_statementinvalidsyntax

        select_statement ::= "SELECT " column " from " table " where " condition

        column ::= "col_1 " | "col_2 "

        table ::= "table_1 " | "table_2 "

        condition ::= column "= " number

        number ::= "1 " | "2 "
    """

    prompt = (
        "Generate an SQL query to show the 'username' and 'email'"
        "from the 'users' table."
    )
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={
                "structured_outputs": {"grammar": invalid_simplified_sql_grammar}
            },
        )


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model_name",
    [MODEL_NAME],
)
async def test_empty_grammar(client: openai.AsyncOpenAI, model_name: str) -> None:
    prompt = "Say hello"
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        await client.chat.completions.create(
            model=model_name,
            messages=[
                {
                    "role": "user",
                    "content": prompt,
                }
            ],
            extra_body={"structured_outputs": {"grammar": ""}},
        )


# Decode-side token reuse for disaggregated serving. The router forwards the
# prefill stage's prompt token ids in kv_transfer_params so the decode stage
# skips re-tokenizing.

TOKEN_IN_MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]
DECODE_MESSAGES = [{"role": "user", "content": "unrelated decode-side text"}]


@pytest.mark.asyncio
@pytest.mark.skip(reason="vLLM's decode-side token reuse (kv_transfer_params.prompt_token_ids replacing the request's own prompt) is not implemented")
async def test_kv_transfer_prompt_token_ids_round_trip(client: openai.AsyncOpenAI):
    """Ids forwarded in kv_transfer_params are used verbatim, skipping tokenize.

    The decode request carries different messages, so a response whose
    prompt_token_ids match the forwarded ids proves the ids were used rather
    than the request's own messages. Generated text is not compared across
    requests because vLLM greedy decoding is not bitwise-reproducible.
    """
    baseline = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=TOKEN_IN_MESSAGES,
        max_completion_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    reused_ids = baseline.prompt_token_ids
    assert reused_ids

    decode = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=DECODE_MESSAGES,
        max_completion_tokens=16,
        temperature=0,
        extra_body={
            "kv_transfer_params": {"prompt_token_ids": reused_ids},
            "return_token_ids": True,
        },
    )

    # The engine saw the forwarded ids, not the decode request's own messages.
    assert decode.prompt_token_ids == reused_ids
    # text-out: reuse still yields a detokenized message.
    assert decode.choices[0].message.content


@pytest.mark.asyncio
@pytest.mark.skip(reason="vLLM's decode-side token reuse (kv_transfer_params.prompt_token_ids replacing the request's own prompt) is not implemented")
async def test_kv_transfer_prompt_token_ids_streaming(client: openai.AsyncOpenAI):
    """Decode-side token reuse streams chat-formatted text-out."""
    baseline = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=TOKEN_IN_MESSAGES,
        max_completion_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    reused_ids = baseline.prompt_token_ids
    assert reused_ids

    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=DECODE_MESSAGES,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        extra_body={
            "kv_transfer_params": {"prompt_token_ids": reused_ids},
            "return_token_ids": True,
        },
    )

    content = ""
    delta_token_ids: list[int] = []
    first_chunk = True
    async for chunk in stream:
        if first_chunk:
            # prompt_token_ids arrives once, on the first chunk.
            assert chunk.prompt_token_ids == reused_ids
            first_chunk = False
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content:
            content += chunk.choices[0].delta.content
        if tids := getattr(chunk.choices[0], "token_ids", None):
            delta_token_ids.extend(tids)

    # streamed text-out, reconstructed from deltas, with generated token ids.
    assert content
    assert delta_token_ids


def _assert_complete_timing_metrics(metrics: object) -> None:
    assert isinstance(metrics, dict)
    timing_fields = {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    }
    assert timing_fields <= metrics.keys()
    assert all(metrics[field] >= 0 for field in timing_fields)


@pytest.mark.asyncio
@pytest.mark.skip(reason="vLLM's --enable-per-request-metrics (a metrics object of timings in each response) is not implemented")
async def test_per_request_metrics_non_streaming(client: openai.AsyncOpenAI):
    response = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count to four."}],
        max_completion_tokens=4,
        temperature=0,
        extra_body={"min_tokens": 4},
    )

    _assert_complete_timing_metrics(response.model_extra.get("metrics"))


@pytest.mark.asyncio
@pytest.mark.skip(reason="vLLM's --enable-per-request-metrics (a metrics object of timings in each response) is not implemented")
async def test_per_request_metrics_on_final_usage_chunk(client: openai.AsyncOpenAI):
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 1},
    )

    chunks = [chunk async for chunk in stream]
    assert len(chunks) > 1
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        assert "metrics" not in (chunk.model_extra or {})

    usage_chunk = chunks[-1]
    assert usage_chunk.usage is not None
    assert usage_chunk.choices == []
    metrics = (usage_chunk.model_extra or {}).get("metrics")
    assert isinstance(metrics, dict)
    assert metrics["time_to_first_token_ms"] >= 0
    assert metrics["generation_time_ms"] >= 0
    assert metrics["queue_time_ms"] >= 0
    assert metrics["tokens_per_second"] >= 0
    assert "mean_itl_ms" not in metrics
