"""Structured outputs, tools and reasoning through `pagedlm serve` and the openai client.

The model is a tiny random checkpoint: its outputs parse and validate only because of the
grammar. Outputs a test must be able to predict (a hermes tool call, a model's thinking) are
forced by a logits processor (``ForcedTextLogitsProcessor``, ``vllm_xargs``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_harness import API_KEY

FORCED = "pagedlm.core.testing.logits_processors:ForcedTextLogitsProcessor"
MESSAGES = [{"role": "user", "content": "Give me the data."}]

SCHEMAS = {
    "enums_and_bounds": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 1, "maximum": 20},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["colour", "count", "ratio"], "additionalProperties": False,
    },
    "bounded_strings_and_arrays": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 5},
                       "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "minItems": 1, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False,
    },
    "nested_with_ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                             "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"},
                       "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}},
        "required": ["start", "meta"], "additionalProperties": False,
    },
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def so_server(start_server, tiny_llama):
    """Auto tool choice with the hermes parser, the forcing processor, JSON without free whitespace."""
    return start_server(tiny_llama, "--max-model-len", "512", "--served-model-name", "tiny",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--logits-processors", FORCED,
                        "--structured-outputs-config", '{"disable_any_whitespace": true}')


@pytest.fixture()
def so_client(so_server):
    import openai

    with openai.OpenAI(base_url=so_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _finished_texts(choices) -> list[str]:
    out = []
    for c in choices:
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            out.append(c.message.content)
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema_validates(so_client, name):
    schema = SCHEMAS[name]
    resp = so_client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, seed=7, temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    texts = _finished_texts(resp.choices)
    assert len(texts) >= 2
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_cut_by_length(so_client):
    resp = so_client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, seed=1, max_tokens=80,
                                             response_format={"type": "json_object"})
    for text in _finished_texts(resp.choices):
        assert isinstance(json.loads(text), dict)
    cut = so_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                            response_format={"type": "json_object"})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2


def test_completions_structured_outputs_and_guided_aliases(so_client):
    def texts(**extra):
        resp = so_client.completions.create(model="tiny", prompt="x", n=2, seed=3, max_tokens=60, extra_body=extra)
        return [c.text for c in resp.choices if c.finish_reason == "stop"]

    assert all(re.fullmatch(r"[a-c]{2}-\d{2}", t) for t in texts(structured_outputs={"regex": r"[a-c]{2}-\d{2}"}))
    choices = ["alpha", "beta gamma"]
    got = texts(guided_choice=choices)
    assert len(got) == 2 and all(t in choices for t in got)
    assert all(re.fullmatch(r"\d+!", t) for t in texts(guided_regex=r"\d+!"))
    schema = SCHEMAS["bounded_strings_and_arrays"]
    for t in texts(guided_json=schema):
        jsonschema.validate(json.loads(t), schema)
    for t in texts(structured_outputs={"grammar": 'root ::= "<" [a-z]+ ">"'}):
        assert re.fullmatch("<[a-z]+>", t)


def test_streamed_structured_outputs(so_client):
    schema = SCHEMAS["enums_and_bounds"]
    stream = so_client.chat.completions.create(model="tiny", messages=MESSAGES, seed=2, max_tokens=120, stream=True,
                                               extra_body={"structured_outputs": {"json": schema}})
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    if reasons[-1] == "stop":
        jsonschema.validate(json.loads("".join(parts)), schema)
    stream = so_client.completions.create(model="tiny", prompt="x", max_tokens=20, stream=True,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("yes", "no")


def test_parse_with_a_pydantic_model(so_client):
    from pydantic import BaseModel, Field

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)
        y: int = Field(ge=0, le=9)
        label: str = Field(max_length=4)

    completion = so_client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Point,
                                                  max_tokens=100, seed=5)
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(choice.message.parsed, Point)


def _validate_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(so_client):
    resp = so_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             n=3, seed=11, max_tokens=150, parallel_tool_calls=False)
    done = [c for c in resp.choices if c.finish_reason != "length"]
    assert done
    for c in done:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _validate_calls(c.message.tool_calls)
    named = so_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        seed=4, max_tokens=60)
    c = named.choices[0]
    assert c.finish_reason == "stop" and [t.function.name for t in c.message.tool_calls] == ["add"]
    _validate_calls(c.message.tool_calls)


def _collect_streamed_calls(stream) -> tuple[dict[int, dict], list[str | None], list[dict]]:
    calls: dict[int, dict] = {}
    reasons, firsts = [], []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    firsts.append({"id": d.id, "type": d.type, "name": d.function.name})
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None  # only the first fragment names the call
                calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, reasons, firsts


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_calls(so_client, choice):
    stream = so_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               seed=8, max_tokens=150, stream=True, parallel_tool_calls=False)
    calls, reasons, firsts = _collect_streamed_calls(stream)
    assert len(calls) == 1
    assert reasons[-1] == ("tool_calls" if choice == "required" else "stop")
    assert all(f["id"].startswith("chatcmpl-tool-") and f["type"] == "function" and f["name"] for f in firsts)
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>')


def test_auto_tool_choice_parses_a_hermes_call(so_client):
    resp = so_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                             extra_body={"vllm_xargs": {"forced_text": HERMES}})
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 40})]
    assert len({t.id for t in c.message.tool_calls}) == 2
    stream = so_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                               stream=True, extra_body={"vllm_xargs": {"forced_text": HERMES}})
    calls, reasons, firsts = _collect_streamed_calls(stream)
    assert reasons[-1] == "tool_calls" and [f["name"] for f in firsts] == ["get_weather", "add"]
    assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [{"city": "Paris", "unit": "c"}, {"a": 2, "b": 40}]
    plain = so_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=50,
                                              extra_body={"vllm_xargs": {"forced_text": "No tools needed."}})
    assert plain.choices[0].message.content == "No tools needed." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_tool_results_go_through_the_template(so_client):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    resp = so_client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                             max_tokens=4)
    assert resp.choices[0].message.tool_calls is None and resp.usage.prompt_tokens > 10


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", ["bogus"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", ["uniqueItems"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", ["xml"]),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", ["regex", "parenthesis"]),
    ({"guided_choice": []}, "guided_choice", ["non-empty"]),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", ["exactly one"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", ["nope", "get_weather"]),
    ({"tools": TOOLS}, "tool_choice", ["--enable-auto-tool-choice"]),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", ["--tool-call-parser"]),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", []),
    ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
])
def test_bad_inputs_are_400s_naming_the_parameter(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    ok = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                    json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


# -- reasoning -------------------------------------------------------------------------------
def _with_think_tokens(src: str, dst: Path) -> str:
    """A copy of a tiny checkpoint whose tokenizer has ``<think>`` and ``</think>`` tokens (in
    place of its last two merges, so the vocabulary keeps the model's size), as Qwen3's has."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    top = max(by_id)
    merges = tok["model"]["merges"]
    for token_id, tag in ((top - 1, "<think>"), (top, "</think>")):
        piece = by_id[token_id]
        del vocab[piece]
        merges[:] = [m for m in merges if "".join(m.split(" ") if isinstance(m, str) else m) != piece]
        tok["added_tokens"].append({"id": token_id, "content": tag, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    return str(dst)


@pytest.fixture(scope="module")
def think_server(start_server, tiny_llama, tmp_path_factory):
    model = _with_think_tokens(tiny_llama, tmp_path_factory.mktemp("think") / "model")
    return start_server(model, "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
                        "--logits-processors", FORCED, "--structured-outputs-config",
                        '{"disable_any_whitespace": true}')


def test_reasoning_is_split_and_the_grammar_starts_after_it(think_server):
    import openai

    schema = SCHEMAS["enums_and_bounds"]
    body = {"vllm_xargs": {"forced_prefix": "<think>not json at all</think>"}, "structured_outputs": {"json": schema}}
    with openai.OpenAI(base_url=think_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, seed=1,
                                              extra_body=body)
        message = resp.choices[0].message
        assert message.reasoning_content == "not json at all" and message.reasoning == "not json at all"
        if resp.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(message.content), schema)
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=150, seed=1, stream=True,
                                                extra_body=body)
        reasoning, content = [], []
        for chunk in stream:
            for c in chunk.choices:
                reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
                content.append(c.delta.content or "")
        assert "".join(reasoning) == "not json at all" and "".join(content) == message.content
