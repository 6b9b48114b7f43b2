"""POST /v1/responses with the openai client (responses.create and responses.stream), validated
against OpenAI's schemas; the greedy text equals chat's for the same messages."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"


def test_create_matches_chat_and_the_schema(client, openai_schemas):
    response = client.responses.create(model=MODEL, input="Tell me a story", instructions="Be brief.",
                                       max_output_tokens=8, temperature=0.0, store=False)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=4, user="u1")
    openai_schemas.validate("Response", raw.http_response.json())
    # a message list with content parts
    parts = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0.0, input=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}])
    assert parts.output_text == response.output_text


def test_stream_events(client, server, openai_schemas):
    kinds, deltas = [], []
    with client.responses.stream(model=MODEL, input="Tell me a story", max_output_tokens=8,
                                 temperature=0.0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed" and final.status in ("completed", "incomplete")
    assert "".join(deltas) == final.output_text
    once = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=8, temperature=0.0)
    assert final.output_text == once.output_text
    # every raw event fits OpenAI's ResponseStreamEvent schema, numbered in order
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers, timeout=60,
                      json={"input": "hi", "max_output_tokens": 4, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        openai_schemas.validate("ResponseStreamEvent", event)


def test_refusals_by_name(client):
    for kwargs, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"text": {"format": {"type": "json_object"}}}, "text.format"),
                          ({"max_output_tokens": 10_000}, "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", **kwargs)
        assert e.value.body["param"] == param, e.value.body
